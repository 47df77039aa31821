"""A declared ``quantization_config``, parsed once into a frozen value: types, ranges and patterns checked.

The config is as untrusted as the tensors (a ``config.json`` beside them, or the safetensors
metadata). :func:`parse` reads every field a planner uses, checks its type and range, compiles
every regex through :mod:`.patterns` (linear time, or refused), and returns a
:class:`Declaration`; the planners read that value and never index the raw mapping. Sizes are
bounded here (block and group sizes at most :data:`MAX_SIZE`) and again against the tensors where
they are placed (a scale grid must fit its weight). Every refusal is one line naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptconv._text import short_repr
from ckptconv.errors import UnsupportedQuantizationError
from ckptconv.quantization.patterns import Patterns

__all__ = ["CT_FORMATS", "MAX_SIZE", "Declaration", "Names", "WeightArgs", "parse"]

#: The largest block, group or bit count a config may declare (a weight has fewer elements a row).
MAX_SIZE = 1 << 31

#: compressed-tensors formats dequantized here, with the tensor that holds each quantized weight.
CT_FORMATS = {
    "float-quantized": "weight",
    "int-quantized": "weight",
    "naive-quantized": "weight",
    "pack-quantized": "weight_packed",
    "nvfp4-pack-quantized": "weight_packed",
    "mxfp4-pack-quantized": "weight_packed",
}
_STRATEGIES = frozenset({"tensor", "channel", "group", "tensor_group", "block"})
_QUANTO_WEIGHTS = frozenset({"float8", "float8_e4m3fn", "float8_e5m2", "int8", "int4", "int2"})


class Names:
    """A list of module names and ``re:`` regexes (compressed-tensors' ``targets`` and ``ignore``), compiled."""

    def __init__(self, entries: tuple[str, ...], where: str) -> None:
        self.entries = entries
        self._exact = frozenset(entry for entry in entries if not entry.startswith("re:"))
        self._regexes = Patterns(tuple(entry[3:] for entry in entries if entry.startswith("re:")), where)

    def match(self, name: str) -> bool:
        """compressed-tensors' ``match_name``: the exact name, or a ``re:`` regex matching from the start."""
        return name in self._exact or self._regexes.match(name)

    def __bool__(self) -> bool:
        return bool(self.entries)


@dataclass(frozen=True)
class WeightArgs:
    """The weight quantization args of one compressed-tensors config group, checked."""

    format: str
    strategy: str
    num_bits: int
    symmetric: bool
    group_size: int | None
    block: tuple[int, int] | None
    targets: tuple[str, ...]
    name: str = ""
    matcher: Names | None = None


@dataclass(frozen=True)
class Declaration:
    """What a ``quantization_config`` declares, as the planners need it.

    Attributes:
        method: the ``quant_method``.
        block: fp8's ``weight_block_size`` (None: one scale per tensor).
        groups: compressed-tensors' config groups with weights, in order.
        ignore: compressed-tensors' ``ignore`` list.
        not_converted: ``modules_to_not_convert`` (fp8, mxfp4, quanto): checked, not used to decide; the tensors do.
        weights: optimum-quanto's ``weights`` qtype, if declared.
    """

    method: str
    block: tuple[int, int] | None = None
    groups: tuple[WeightArgs, ...] = ()
    ignore: Names | None = None
    not_converted: tuple[str, ...] = ()
    weights: str | None = None


def _refuse(method: str, field: str, value: Any, why: str) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(
        f"the {method} quantization_config's {field} is {short_repr(value)}, {why}", scheme=method
    )


def _size(method: str, field: str, value: Any, *, low: int = 1, high: int = MAX_SIZE) -> int:
    if type(value) is not int or not low <= value <= high:
        raise _refuse(method, field, value, f"not an integer from {low} to {high}")
    return value


def _pair(method: str, field: str, value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise _refuse(method, field, value, "not two positive integers")
    if any(type(v) is not int or not 1 <= v <= MAX_SIZE for v in value):
        raise _refuse(method, field, value, f"not two positive integers of at most {MAX_SIZE}")
    return value[0], value[1]


def _strings(method: str, field: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise _refuse(method, field, value, "not a list of module names")
    if len(value) > 100_000 or not all(isinstance(v, str) and len(v) <= 4096 for v in value):
        raise _refuse(method, field, value, "not a list of module names")
    return tuple(value)


def _bool(method: str, field: str, value: Any, default: bool) -> bool:
    if value is None:
        return default
    if type(value) is not bool:
        raise _refuse(method, field, value, "not true or false")
    return value


def _weight_args(name: str, group: Mapping[str, Any], default_format: Any) -> WeightArgs | None:
    method, where = "compressed-tensors", f"config_groups.{name}"
    fmt = group.get("format") or default_format or ""
    if not isinstance(fmt, str):
        raise _refuse(method, f"{where}.format", fmt, "not a format name")
    weights = group.get("weights")
    if fmt == "dense" or weights is None:
        return None
    if not isinstance(weights, Mapping):
        raise _refuse(method, f"{where}.weights", weights, "not a mapping")
    if fmt not in CT_FORMATS:
        raise _refuse(method, f"{where}.format", fmt, "a format ckptconv cannot dequantize exactly")
    strategy = weights.get("strategy") or "tensor"
    if not isinstance(strategy, str) or strategy not in _STRATEGIES:
        raise _refuse(method, f"{where}.weights.strategy", strategy, f"not one of {', '.join(sorted(_STRATEGIES))}")
    kind = weights.get("type", "int")
    if not isinstance(kind, str) or kind not in ("int", "float"):
        raise _refuse(method, f"{where}.weights.type", kind, "not 'int' or 'float'")
    num_bits = _size(method, f"{where}.weights.num_bits", weights.get("num_bits", 8), high=8)
    if weights.get("actorder") == "group":
        raise _refuse(method, f"{where}.weights.actorder", "group", "which reorders the groups")
    group_size = weights.get("group_size")
    if group_size is not None:
        group_size = _size(method, f"{where}.weights.group_size", group_size)
    if strategy in ("group", "tensor_group") and group_size is None:
        raise _refuse(method, f"{where}.weights.group_size", None, f"but the strategy is {strategy!r}")
    block = _pair(method, f"{where}.weights.block_structure", weights.get("block_structure"))
    if strategy == "block" and block is None:
        raise _refuse(method, f"{where}.weights.block_structure", None, "but the strategy is 'block'")
    targets = _strings(method, f"{where}.targets", group.get("targets"))
    return WeightArgs(
        fmt,
        strategy,
        num_bits,
        _bool(method, f"{where}.weights.symmetric", weights.get("symmetric"), True),
        group_size,
        block,
        targets,
        name,
        Names(tuple(t for t in targets if t != "Linear"), f"{where}.targets"),
    )


def _compressed_tensors(config: Mapping[str, Any]) -> Declaration:
    method = "compressed-tensors"
    for key in ("sparsity_config", "transform_config"):
        if config.get(key):
            raise UnsupportedQuantizationError(
                f"the {method} quantization_config's {key} is set; ckptconv dequantizes quantized weights, "
                "not sparse or transformed ones",
                scheme=method,
            )
    raw = config.get("config_groups") or {}
    if not isinstance(raw, Mapping) or len(raw) > 10_000:
        raise _refuse(method, "config_groups", raw, "not a mapping of groups")
    groups = []
    for name, group in raw.items():
        if not isinstance(group, Mapping):
            raise _refuse(method, f"config_groups.{name}", group, "not a mapping")
        args = _weight_args(str(name)[:100], group, config.get("format"))
        if args is not None:
            groups.append(args)
    ignore = _strings(method, "ignore", config.get("ignore"))
    return Declaration(method, groups=tuple(groups), ignore=Names(ignore, "ignore"))


def parse(method: str, config: Mapping[str, Any]) -> Declaration:
    """``config`` (a declared quantization_config whose ``quant_method`` is ``method``), checked.

    Raises:
        UnsupportedQuantizationError: a field of the wrong type or out of range, a regex that does not
            compile or could backtrack, a sparsity or transform config.
    """
    not_converted = _strings(method, "modules_to_not_convert", config.get("modules_to_not_convert"))
    if method == "fp8":
        return Declaration(
            method,
            block=_pair(method, "weight_block_size", config.get("weight_block_size")),
            not_converted=not_converted,
        )
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method == "quanto":
        weights = config.get("weights")
        if weights is not None and (not isinstance(weights, str) or weights not in _QUANTO_WEIGHTS):
            raise _refuse(method, "weights", weights, f"not one of {', '.join(sorted(_QUANTO_WEIGHTS))}")
        return Declaration(method, not_converted=not_converted, weights=weights)
    return Declaration(method, not_converted=not_converted)
