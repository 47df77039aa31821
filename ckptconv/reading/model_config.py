"""A model's ``config.json``, parsed once through one schema into a frozen value.

A config comes from the checkpoint, so it is as untrusted as a pickle. :func:`parse_model_config` turns
the JSON object into a :class:`ModelConfig`: every field ckptconv reads (the model's kind, its sizes and
counts, its tie flag and dtype) is checked for its type and range there, and code past the parser reads
the typed attributes, or :meth:`ModelConfig.fields` (the checked fields alone, for the architecture
tables, which name their fields as data). Sizes are then bounded against the tensors present
(:meth:`ModelConfig.check_against`) before any code sizes a loop or an allocation by them, so
``num_hidden_layers: 1e9`` is refused in one line instead of listing a billion layers.

The rules:

- the file: UTF-8 JSON of at most :data:`MAX_CONFIG_BYTES`, an object, no key named twice, no ``NaN`` or
  ``Infinity`` (not JSON; Python's ``json`` reads them), nested at most :data:`MAX_DEPTH` deep;
- counts and sizes: JSON integers (not ``true``, not ``8.0``, not ``"8"``), within their range
  (:data:`_INTEGERS`); ``null`` is taken as absent, as transformers takes it; a few sizes may be lists of such
  integers, one per layer (Gemma 3n's ``intermediate_size``), which a caller that needs one number refuses;
- flags (``tie_word_embeddings``, ``attention_bias``, ``mlp_bias``): ``true`` or ``false``;
- names (``model_type``, ``torch_dtype``/``dtype``): strings; ``architectures``: a list of strings.

Fields a config does not hold stay None: families differ (a diffusers UNet has no ``num_hidden_layers``),
and the code that needs a field asks for it (:meth:`ModelConfig.require`), which names the file and field.
Every error is an :class:`~ckptconv.errors.InvalidConfigError`: one line naming the file, the field and
what to do. ``quantization_config`` is handed on as it is: its schema is the quantization stage's.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptconv._text import short_repr
from ckptconv.errors import InvalidConfigError
from ckptconv.reading.formats._base import unique_pairs

__all__ = ["MAX_CONFIG_BYTES", "MAX_DEPTH", "ModelConfig", "parse_config_text", "parse_model_config"]

#: A model's config.json is kilobytes; a hundred times the largest real one is still refused past this.
MAX_CONFIG_BYTES = 16 << 20
#: Real configs nest four or five objects deep (``text_config.rope_scaling``); deeper is refused.
MAX_DEPTH = 64

# field -> the least value it may take. Counts may be 0 (a model of no layers, a dense model's 0 experts).
_INTEGERS: Mapping[str, int] = {
    "num_hidden_layers": 0,
    "hidden_size": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 1,
    "intermediate_size": 1,
    "moe_intermediate_size": 1,
    "vocab_size": 1,
    "num_local_experts": 0,
    "num_experts": 0,
    "decoder_sparse_step": 1,
}
# Sizes some families give per layer, as a list of integers (Gemma 3n's intermediate_size).
_PER_LAYER = frozenset({"num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"})
_FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias")
_NAMES = ("model_type", "torch_dtype", "dtype")
# Counts: how many of something the tensors hold; sizes: a dimension of a tensor.
_COUNTS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "num_experts")
_SIZES = ("hidden_size", "head_dim", "intermediate_size", "moe_intermediate_size", "vocab_size")


def _refuse(path: str, name: str, problem: str) -> InvalidConfigError:
    return InvalidConfigError(
        f"{path!r} is not a valid model config: {name} {problem}; fix the field or give a config that matches "
        "the weights",
        path=path,
        field=name,
    )


def _shown(value: Any) -> str:
    """``value`` as the JSON it was written as (``true``, ``"eight"``), shortened."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError, RecursionError):
        return short_repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _not_json_number(text: str) -> Any:
    raise ValueError(f"{text} is not a JSON number")


def _depth(value: Any) -> int:
    """How deep ``value`` nests, counted without recursion (a hostile file may nest deeper than the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                return deepest
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_config_text(data: bytes, path: str, *, what: str = "a model config") -> dict[str, Any]:
    """The JSON object a config file holds (``what`` it is, for the error), under the file rules of the module
    docstring: Megatron's ``metadata.json`` and a model's ``config.json`` alike.

    Raises:
        InvalidConfigError: the bytes are not such an object.
    """
    if len(data) > MAX_CONFIG_BYTES:
        raise InvalidConfigError(
            f"{path!r} is not {what}: it is larger than {MAX_CONFIG_BYTES:,} bytes; fix or remove it",
            path=path,
        )
    try:
        document = json.loads(data.decode("utf-8"), object_pairs_hook=unique_pairs, parse_constant=_not_json_number)
    except UnicodeDecodeError:
        reason = "it is not UTF-8"
    except RecursionError:
        reason = f"it nests deeper than {MAX_DEPTH} levels"
    except ValueError as error:
        reason = f"it is not JSON ({str(error).splitlines()[0][:120]})"
    else:
        if not isinstance(document, dict):
            reason = f"it holds {short_repr(document)}, not a JSON object"
        elif _depth(document) > MAX_DEPTH:
            reason = f"it nests deeper than {MAX_DEPTH} levels"
        else:
            return document
    raise InvalidConfigError(f"{path!r} is not {what}: {reason}; fix or remove it", path=path)


@dataclass(frozen=True, eq=False)
class ModelConfig(Mapping[str, Any]):
    """A model's ``config.json``, its fields checked (see the module docstring). Also a read-only mapping
    over the whole document, for what is handed on unread (``quantization_config``) or carried verbatim.

    Attributes:
        path: the file (or what the config was given as), named in every error.
        document: the JSON object as read.
        model_type, architectures, num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads,
        head_dim, intermediate_size, moe_intermediate_size, vocab_size, decoder_sparse_step, mlp_only_layers,
        attention_bias, mlp_bias, tie_word_embeddings: the fields of the same names, None where absent.
        num_experts: ``num_local_experts`` (Mixtral) or ``num_experts`` (Qwen-MoE), None where neither is.
        dtype: ``dtype`` (transformers 5) or ``torch_dtype``, None where neither is.
    """

    path: str
    document: Mapping[str, Any] = field(repr=False)
    model_type: str | None = None
    architectures: tuple[str, ...] = ()
    num_hidden_layers: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    moe_intermediate_size: int | None = None
    vocab_size: int | None = None
    num_experts: int | None = None
    decoder_sparse_step: int | None = None
    mlp_only_layers: tuple[int, ...] = ()
    attention_bias: bool | None = None
    mlp_bias: bool | None = None
    tie_word_embeddings: bool | None = None
    dtype: str | None = None

    def __getitem__(self, key: str) -> Any:
        return self.document[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.document)

    def __len__(self) -> int:
        return len(self.document)

    def fields(self) -> dict[str, Any]:
        """The checked fields the config holds, by their JSON names: what the architecture tables read."""
        checked: dict[str, Any] = {}
        for name in (*_INTEGERS, *_FLAGS, "model_type"):
            if self.document.get(name) is not None and not isinstance(self.document[name], list):
                checked[name] = self.document[name]
        if self.mlp_only_layers:
            checked["mlp_only_layers"] = list(self.mlp_only_layers)
        return checked

    def require(self, *names: str) -> None:
        """Refuse a config that lacks one of ``names`` (a field the caller cannot do without).

        Raises:
            InvalidConfigError: naming the first field missing.
        """
        for name in names:
            if self.document.get(name) is None:
                raise _refuse(self.path, name, "is missing")
            if isinstance(self.document[name], list):
                raise _refuse(self.path, name, "is a list (one per layer); this conversion needs one number")

    def check_against(self, shapes: Iterable[tuple[int, ...]]) -> None:
        """Refuse counts and sizes that the tensors present cannot hold, before anything is sized by them: no
        size exceeds the largest dimension of a tensor, and no count (layers, heads, experts, layers times
        experts) exceeds the rows the tensors hold (each layer, head or expert is at least one row of one).

        Raises:
            InvalidConfigError: naming the field, its value and the bound.
        """
        largest, rows = 0, 0
        for shape in shapes:
            largest = max(largest, *shape) if shape else largest
            rows += shape[0] if shape else 1
        for name in _SIZES:
            value = getattr(self, name)
            if value is not None and value > largest:
                raise _refuse(self.path, name, f"is {value}, larger than any dimension of the tensors ({largest})")
        experts_field = "num_local_experts" if self.document.get("num_local_experts") is not None else "num_experts"
        for name in _COUNTS:
            value = getattr(self, name)
            if value is not None and value > rows:
                shown = experts_field if name == "num_experts" else name
                raise _refuse(self.path, shown, f"is {value}, more than the {rows} rows the tensors hold")
        layers, experts = self.num_hidden_layers or 0, self.num_experts or 0
        if layers * experts > rows:
            raise _refuse(
                self.path,
                experts_field,
                f"is {experts}: {layers} layers of {experts} experts are more than the {rows} rows the tensors hold",
            )


def _whole(value: Any, least: int) -> bool:
    return type(value) is int and value >= least


def _integer(document: Mapping[str, Any], path: str, name: str, least: int) -> int | None:
    value = document.get(name)
    if value is None:
        return None
    if name in _PER_LAYER and isinstance(value, list) and value and all(_whole(item, least) for item in value):
        return None  # one per layer (Gemma 3n's intermediate_size): valid, but no one number; require() says so
    if isinstance(value, bool) or not isinstance(value, int):
        shown = _shown(value)
        if isinstance(value, float) and math.isfinite(value) and value == int(value):
            raise _refuse(path, name, f"is {shown}, a float; write it as the integer {int(value)}")
        raise _refuse(path, name, f"is {shown}, not an integer")
    if value < least:
        raise _refuse(path, name, f"is {value}; it must be at least {least}")
    return value


def parse_model_config(document: Mapping[str, Any], *, path: str | os.PathLike[str] = "config") -> ModelConfig:
    """``document`` (a model's ``config.json`` as a JSON object) checked into a :class:`ModelConfig`.

    Args:
        document: the JSON object.
        path: the file it came from, named in errors.

    Raises:
        InvalidConfigError: a field ckptconv reads has the wrong type or is out of range.

    Example:
        >>> parse_model_config({"model_type": "llama", "num_hidden_layers": 2}).num_hidden_layers
        2
    """
    where = os.fspath(path)
    if isinstance(document, ModelConfig):
        return document
    if not isinstance(document, Mapping):
        raise InvalidConfigError(f"{where!r} is not a model config: it is not a JSON object", path=where)
    integers = {name: _integer(document, where, name, least) for name, least in _INTEGERS.items()}
    flags: dict[str, bool | None] = {}
    for name in _FLAGS:
        value = document.get(name)
        if value is not None and not isinstance(value, bool):
            raise _refuse(where, name, f"is {_shown(value)}, not true or false")
        flags[name] = value
    names: dict[str, str | None] = {}
    for name in _NAMES:
        value = document.get(name)
        if value is not None and not isinstance(value, str):
            raise _refuse(where, name, f"is {_shown(value)}, not a string")
        names[name] = value
    architectures = document.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(item, str) for item in architectures):
        raise _refuse(where, "architectures", f"is {_shown(architectures)}, not a list of class names")
    layers = document.get("mlp_only_layers") or []
    if not isinstance(layers, list) or not all(
        isinstance(item, int) and not isinstance(item, bool) and item >= 0 for item in layers
    ):
        raise _refuse(where, "mlp_only_layers", f"is {_shown(layers)}, not a list of layer numbers")
    experts = integers["num_local_experts"] if integers["num_local_experts"] is not None else integers["num_experts"]
    return ModelConfig(
        path=where,
        document=document,
        model_type=names["model_type"],
        architectures=tuple(architectures),
        num_hidden_layers=integers["num_hidden_layers"],
        hidden_size=integers["hidden_size"],
        num_attention_heads=integers["num_attention_heads"],
        num_key_value_heads=integers["num_key_value_heads"],
        head_dim=integers["head_dim"],
        intermediate_size=integers["intermediate_size"],
        moe_intermediate_size=integers["moe_intermediate_size"],
        vocab_size=integers["vocab_size"],
        num_experts=experts,
        decoder_sparse_step=integers["decoder_sparse_step"],
        mlp_only_layers=tuple(layers),
        attention_bias=flags["attention_bias"],
        mlp_bias=flags["mlp_bias"],
        tie_word_embeddings=flags["tie_word_embeddings"],
        dtype=names["dtype"] if names["dtype"] is not None else names["torch_dtype"],
    )
