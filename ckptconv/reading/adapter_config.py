"""``adapter_config.json``: a PEFT LoRA adapter's settings, parsed once through one schema.

The file is untrusted input. It is read with a size cap, parsed as JSON without duplicate keys, and turned
into a frozen :class:`AdapterConfig`; every value that decides the merge (``r``, ``lora_alpha``,
``use_rslora``, ``use_dora``, ``rank_pattern``, ``alpha_pattern``, ``modules_to_save``) is type- and
range-checked here, and code past this module never indexes the raw dict.

Settings under which PEFT's merge is something ckptconv does not reproduce exactly are refused in one line,
naming the setting: the LoRA variants other than DoRA (aLoRA, VeLoRA, MonteCLoRA, KaSA, BD-LoRA, Arrow,
QALoRA), initializations that change the base weights when PEFT loads the adapter (PiSSA, OLoRA, CorDA,
LoftQ, EVA, LoRA-GA ...), ``layer_replication``, ``trainable_token_indices``,
trainable biases (``bias`` other than ``"none"``), weight tying (``ensure_weight_tying``), and any key this
module does not know that is set to something other than null, false or empty.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from ckptconv._text import short_repr
from ckptconv.errors import TransformError
from ckptconv.reading import read_policy
from ckptconv.reading.formats._base import json_object

__all__ = ["CONFIG_NAME", "MAX_CONFIG_BYTES", "WEIGHTS_NAMES", "AdapterConfig", "parse_config", "read_config"]

CONFIG_NAME = "adapter_config.json"
#: The adapter weights files PEFT writes, in the order it looks for them.
WEIGHTS_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
#: An adapter config is a few kB; a larger file is refused before it is parsed.
MAX_CONFIG_BYTES = 1 << 20
#: The most entries a rank_pattern or alpha_pattern may hold, and the longest key.
_MAX_PATTERNS = 100_000
_MAX_PATTERN_CHARS = 1_000
#: Ranks and alphas beyond these are not a real adapter's.
_MAX_RANK = 1 << 20
_MAX_ALPHA = 1e12
# Pattern keys are regular expressions to PEFT (``re.match(rf"(.*\.)?({key})$", name)``): ckptconv takes
# the ones made of module-name characters (``.`` matching any character, as it does for PEFT, ``\.`` a dot)
# and refuses any other regex syntax, which it does not evaluate (a hostile pattern can take exponential time).
_PATTERN_KEY = re.compile(r"(?:[A-Za-z0-9_\-.]|\\\.)+")

# Keys whose value does not change what a merge computes (bookkeeping, training-time settings, and which
# modules get LoRA layers: the adapter's tensors say that).
_IGNORED = frozenset(
    {
        "auto_mapping",
        "base_model_name_or_path",
        "revision",
        "task_type",
        "peft_version",
        "inference_mode",
        "lora_dropout",
        "target_modules",
        "exclude_modules",
        "layers_to_transform",
        "layers_pattern",
        "megatron_config",
        "megatron_core",
        "qalora_group_size",
        "runtime_config",
        # Configuration of initializations refused below by init_lora_weights; alone they do nothing.
        "loftq_config",
        "eva_config",
        "corda_config",
        "lora_ga_config",
    }
)
_USED = frozenset(
    {
        "peft_type",
        "r",
        "lora_alpha",
        "use_rslora",
        "use_dora",
        "fan_in_fan_out",
        "rank_pattern",
        "alpha_pattern",
        "modules_to_save",
        "init_lora_weights",
        "lora_bias",
        "bias",
        "target_parameters",
    }
)
# Set to anything but null, false or empty, these make PEFT's merged weights something ckptconv does not
# compute: the reason, for the one-line refusal.
_REFUSED = {
    "layer_replication": "layer_replication (layers duplicated when PEFT loads the adapter)",
    "trainable_token_indices": "trainable_token_indices (trainable tokens)",
    "use_qalora": "QALoRA (use_qalora)",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)",
    "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "kasa_config": "KaSA (kasa_config)",
    "use_bdlora": "BD-LoRA (use_bdlora)",
    "arrow_config": "Arrow (arrow_config)",
    "ensure_weight_tying": "tied adapters (ensure_weight_tying)",
    "target_modules_to_tie": "tied adapters (target_modules_to_tie)",
    "modules_to_tie": "tied adapters (modules_to_tie)",
}
# init_lora_weights values whose initialization PEFT's loading overwrites entirely (A and B come from the file).
_PLAIN_INITS = (True, False, "gaussian")

_V = TypeVar("_V", int, "int | float")


@dataclass(frozen=True)
class AdapterConfig:
    """What an ``adapter_config.json`` says about a merge.

    Attributes:
        r: the rank, unless ``rank_pattern`` names the module.
        lora_alpha: the alpha, unless ``alpha_pattern`` names the module.
        use_rslora: scaling is ``alpha / sqrt(r)`` instead of ``alpha / r``.
        use_dora: DoRA: each target has a magnitude vector.
        fan_in_fan_out: what the config says (PEFT sets it per module from the module's class).
        rank_pattern, alpha_pattern: ``(pattern, value)`` in the file's order.
        modules_to_save: modules the adapter holds whole.
        lora_bias: ``lora_B`` has a bias that is added to the base's.
        base_model: ``base_model_name_or_path``, or "".
    """

    r: int
    lora_alpha: int | float
    use_rslora: bool = False
    use_dora: bool = False
    fan_in_fan_out: bool = False
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, int | float], ...] = ()
    modules_to_save: tuple[str, ...] = ()
    lora_bias: bool = False
    base_model: str = ""
    target_modules: tuple[str, ...] = ()
    target_parameters: tuple[str, ...] = ()

    def rank(self, module: str) -> int:
        """The rank PEFT gives ``module`` (its name in the model): the first rank_pattern entry that matches."""
        return _pattern_value(self.rank_pattern, module, self.r)

    def alpha(self, module: str) -> int | float:
        """The alpha PEFT gives ``module``: the first alpha_pattern entry that matches."""
        return _pattern_value(self.alpha_pattern, module, self.lora_alpha)

    def scaling(self, module: str) -> float:
        """``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), as Python floats, as ``LoraLayer.update_layer``."""
        r, alpha = self.rank(module), self.alpha(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def saves(self, module: str) -> bool:
        """True when ``module`` is one of ``modules_to_save`` (PEFT matches a name or a name's last parts)."""
        return any(module == name or module.endswith("." + name) for name in self.modules_to_save)


def _pattern_value(patterns: tuple[tuple[str, _V], ...], module: str, default: _V) -> _V:
    # peft.utils.other.get_pattern_key: the first key for which re.match(rf"(.*\.)?({key})$", module) matches.
    for key, value in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _refuse(path: str, field: str, why: str) -> TransformError:
    return TransformError(f"{path!r}: {field} {why}; ckptconv does not merge it (PEFT can: merge_and_unload)")


def _unset(value: Any) -> bool:
    return value is None or value is False or value in ({}, [], "")


def _number(path: str, name: str, value: Any, *, integer: bool) -> Any:
    ok = type(value) is int if integer else type(value) in (int, float)
    if not ok or not math.isfinite(value) or not 0 < value <= (_MAX_RANK if integer else _MAX_ALPHA):
        kind = "a positive integer" if integer else "a positive number"
        bound = _MAX_RANK if integer else _MAX_ALPHA
        raise TransformError(f"{path!r}: {name} is {short_repr(value)}, not {kind} up to {bound:g}")
    return value


def _patterns(path: str, name: str, value: Any, *, integer: bool) -> tuple[tuple[str, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > _MAX_PATTERNS:
        raise TransformError(
            f"{path!r}: {name} is {short_repr(value)}, not an object of at most {_MAX_PATTERNS:,} entries"
        )
    pairs = []
    for key, item in value.items():
        if len(key) > _MAX_PATTERN_CHARS or not _PATTERN_KEY.fullmatch(key):
            raise TransformError(
                f"{path!r}: {name} key {short_repr(key)} is not a module name (letters, digits, '_', '-', '.', '\\.'); "
                "ckptconv does not evaluate other regular expressions: write the module names out"
            )
        pairs.append((key, _number(path, f"{name}[{key!r}]", item, integer=integer)))
    return tuple(pairs)


def _names(path: str, name: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or len(value) > _MAX_PATTERNS or not all(isinstance(v, str) for v in value):
        raise TransformError(f"{path!r}: {name} is {short_repr(value)}, not a list of module names")
    return tuple(value)


def _flag(path: str, config: Mapping[str, Any], name: str) -> bool:
    value = config.get(name, False)
    if value is None:
        return False
    if type(value) is not bool:
        raise TransformError(f"{path!r}: {name} is {short_repr(value)}, not true or false")
    return value


def parse_config(config: Any, path: str = CONFIG_NAME) -> AdapterConfig:
    """The :class:`AdapterConfig` of an ``adapter_config.json``'s parsed content.

    Raises:
        TransformError: not a LoRA adapter's config, a value out of its type or range, or a setting whose
            merge ckptconv does not reproduce exactly (named in the message).
    """
    if not isinstance(config, dict):
        raise TransformError(f"{path!r} holds {short_repr(config)}, not a JSON object")
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise TransformError(f"{path!r}: peft_type is {short_repr(peft_type)}; ckptconv merges LORA adapters only")
    for name, what in _REFUSED.items():
        if not _unset(config.get(name)):
            raise _refuse(path, what, f"is set ({short_repr(config[name])})")
    unknown = sorted(name for name in config if name not in _IGNORED | _USED | _REFUSED.keys())
    for name in unknown:
        if not _unset(config[name]):
            raise _refuse(
                path, f"{short_repr(name)}", f"is set ({short_repr(config[name])}), a setting ckptconv does not know"
            )
    init = config.get("init_lora_weights", True)
    if not any(init is plain or (isinstance(plain, str) and init == plain) for plain in _PLAIN_INITS):
        raise _refuse(
            path, f"init_lora_weights={short_repr(init)}", "changes the base weights when PEFT loads the adapter"
        )
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise _refuse(path, f"bias={short_repr(bias)}", "trains the base's biases")
    base_model = config.get("base_model_name_or_path") or ""
    return AdapterConfig(
        r=_number(path, "r", config.get("r", 8), integer=True),
        lora_alpha=_number(path, "lora_alpha", config.get("lora_alpha", 8), integer=False),
        use_rslora=_flag(path, config, "use_rslora"),
        use_dora=_flag(path, config, "use_dora"),
        fan_in_fan_out=_flag(path, config, "fan_in_fan_out"),
        rank_pattern=_patterns(path, "rank_pattern", config.get("rank_pattern"), integer=True),
        alpha_pattern=_patterns(path, "alpha_pattern", config.get("alpha_pattern"), integer=False),
        modules_to_save=_names(path, "modules_to_save", config.get("modules_to_save")),
        lora_bias=_flag(path, config, "lora_bias"),
        base_model=base_model if isinstance(base_model, str) else "",
        target_parameters=_names(path, "target_parameters", config.get("target_parameters")),
        target_modules=_names(path, "target_modules", config.get("target_modules"))
        if not isinstance(config.get("target_modules"), str)
        else (config["target_modules"],),
    )


def read_config(folder: str) -> AdapterConfig:
    """The :class:`AdapterConfig` in ``folder``'s ``adapter_config.json``.

    Raises:
        LoadError: the file is missing, a link out of the folder, or unreadable.
        MalformedCheckpointError: larger than :data:`MAX_CONFIG_BYTES`.
        TransformError: not JSON, or see :func:`parse_config`.
    """
    path = os.path.join(folder, CONFIG_NAME)
    data = read_policy.read_limited(path, limit=MAX_CONFIG_BYTES, folder=folder, what="PEFT adapter config")
    try:
        config = json_object(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise TransformError(f"{path!r} is not an adapter config: it is not JSON ({type(error).__name__})") from None
    return parse_config(config, path)
