"""Which quantization scheme a checkpoint declares, checked against what its tensors show.

The scheme is declared by the ``quantization_config`` of the checkpoint's ``config.json`` (or that
config itself, or the older ``compression_config``), else a ``quantization_config`` in the safetensors
metadata, and parsed once (:mod:`.declaration`: types, ranges, regexes). The tensors then have the
last word: a weight's companions (:mod:`.evidence`: ``weight_scale_inv``, ``weight_scale``,
``weight_packed``, ``*_blocks`` with ``*_scales``, ``weight._data`` with ``weight._scale`` ...) must be
the declared scheme's, or the checkpoint is refused. A declared scheme ckptconv dequantizes becomes a
:class:`Scheme`; any other is refused. With no declaration, optimum-quanto's ``_data``/``_scale`` pairs
(whose layout the tensors fully show) are dequantized; the companions of any other scheme are refused,
since casting them alone is silently wrong. Only a checkpoint with neither (plain float8 data with no
scale included) is unquantized: :func:`detect` returns None and a plain cast applies.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptconv._text import short_repr
from ckptconv.errors import UnsupportedQuantizationError
from ckptconv.quantization.declaration import Declaration, parse
from ckptconv.quantization.evidence import check_declared, companions
from ckptconv.values.tensor import TensorRef

__all__ = ["DECLARATION_KEYS", "SUPPORTED_METHODS", "Scheme", "detect", "refuse", "refuse_config"]

#: The safetensors metadata keys that declare a scheme (read by :func:`detect`, dropped once dequantized).
DECLARATION_KEYS = ("quantization_config", "quant_method")

#: ``quant_method`` values dequantized here, with the module that does it.
SUPPORTED_METHODS = {
    "fp8": "ckptconv.quantization.fp8_block",
    "compressed-tensors": "ckptconv.quantization.compressed_tensors",
    "mxfp4": "ckptconv.quantization.mxfp4",
    "quanto": "ckptconv.quantization.quanto",
}

# How the refusals name the schemes transformers knows (quant_method -> name).
_NAMES = {
    "gptq": "GPTQ",
    "awq": "AWQ",
    "bitsandbytes": "bitsandbytes",
    "hqq": "HQQ",
    "aqlm": "AQLM",
    "eetq": "EETQ",
    "torchao": "torchao",
    "fbgemm_fp8": "FBGEMM fp8",
    "higgs": "HIGGS",
    "vptq": "VPTQ",
    "spqr": "SpQR",
    "bitnet": "BitNet",
    "fp_quant": "FP-Quant",
    "quark": "Quark",
    "auto-round": "AutoRound",
    "modelopt": "NVIDIA ModelOpt",
    "gguf": "GGUF",
}


@dataclass(frozen=True)
class Scheme:
    """A declared quantization scheme that ckptconv dequantizes exactly.

    Attributes:
        method: the declared ``quant_method``: ``"fp8"``, ``"compressed-tensors"``, ``"mxfp4"`` or ``"quanto"``.
        config: the whole quantization config as declared (block sizes, config groups, ignore lists).
        declaration: ``config`` parsed and checked (what the planners read).
    """

    method: str
    config: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    declaration: Declaration | None = field(default=None, compare=False, hash=False)

    @property
    def declared(self) -> Declaration:
        """The parsed declaration (parsed here when the Scheme was made by hand)."""
        return self.declaration if self.declaration is not None else parse(self.method, self.config)

    def __str__(self) -> str:
        return self.method


def _declaration(config: Mapping[str, Any] | None, metadata: Mapping[str, str] | None) -> Mapping[str, Any] | None:
    if config:
        for key in ("quantization_config", "compression_config"):
            value = config.get(key)
            if isinstance(value, Mapping) and value:
                return value
        if "quant_method" in config:
            return config
    for key in ("quantization_config", "quant_method"):
        text = (metadata or {}).get(key)
        if not text:
            continue
        if key == "quant_method":
            return {"quant_method": text}
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, Mapping):
            raise UnsupportedQuantizationError(
                f"the safetensors metadata's quantization_config is not a JSON object ({text[:60]!r}); "
                "ckptconv cannot tell how the checkpoint was quantized",
                scheme="unknown",
            )
        return value
    return None


# Tensor-name endings that only quantized checkpoints have, and the scheme each gives away.
_GIVEAWAYS: tuple[tuple[str, str], ...] = (
    ("weight_scale_inv", "fp8 block-scaled"),
    ("_scale_inv", "fp8 block-scaled"),
    ("weight_packed", "compressed-tensors"),
    ("weight_global_scale", "compressed-tensors nvfp4"),
    ("weight_zero_point", "compressed-tensors"),
    ("weight_scale", "compressed-tensors"),
    ("weight_shape", "compressed-tensors"),
    ("qweight", "GPTQ/AWQ"),
    ("qzeros", "GPTQ/AWQ"),
    ("g_idx", "GPTQ"),
    ("quant_state", "bitsandbytes"),
    ("quant_map", "bitsandbytes"),
    ("absmax", "bitsandbytes"),
    ("SCB", "bitsandbytes int8"),
    ("weight_format", "bitsandbytes int8"),
)


def _giveaway(tensors: Mapping[str, TensorRef]) -> tuple[str, str] | None:
    for key in tensors:
        leaf = key.rpartition(".")[2]
        if ".quant_state." in f".{key}.":
            return key, "bitsandbytes"
        for ending, scheme in _GIVEAWAYS:
            if leaf == ending or (ending.startswith("_") and leaf.endswith(ending)):
                return key, scheme
        if leaf.endswith("_blocks") and f"{key[: -len('_blocks')]}_scales" in tensors:
            return key, "mxfp4"
    return None


def detect(
    config: Mapping[str, Any] | None,
    metadata: Mapping[str, str] | None,
    tensors: Mapping[str, TensorRef],
) -> Scheme | None:
    """The quantization scheme the checkpoint declares, or None for an unquantized checkpoint.

    Args:
        config: the model's ``config.json`` (or its ``quantization_config`` alone), if any.
        metadata: the safetensors ``__metadata__``, if any.
        tensors: the checkpoint's tensors by name (only the names are looked at).

    Returns:
        The declared :class:`Scheme`, or None when nothing is declared and no tensor is a
        quantization scale, packed weight or zero point.

    Raises:
        UnsupportedQuantizationError: the declared scheme is one ckptconv cannot dequantize
            exactly, or tensors come in weight/scale pairs with no declaration.

    Example:
        >>> detect({"quantization_config": {"quant_method": "gptq"}}, None, {})
        Traceback (most recent call last):
        ...
        ckptconv.errors.UnsupportedQuantizationError: the checkpoint is quantized with GPTQ (quant_method 'gptq'), which ckptconv cannot dequantize exactly; load it with its quantization library and save it dequantized first
    """  # noqa: E501 - the doctest's one-line message
    declared = _declaration(config, metadata)
    if declared is not None:
        raw = declared.get("quant_method", "")
        if not isinstance(raw, str):
            raise UnsupportedQuantizationError(
                f"the quantization_config's quant_method is {short_repr(raw)}, not a name; "
                "ckptconv cannot tell how the checkpoint was quantized",
                scheme="unknown",
            )
        method = raw.strip().lower()[:100]
        if method in SUPPORTED_METHODS:
            result = Scheme(method, declared, parse(method, declared))
            check_declared(method, tensors)
            return result
        if not method:
            raise UnsupportedQuantizationError(
                "the checkpoint declares a quantization_config without a quant_method; "
                "ckptconv cannot tell how it was quantized",
                scheme="unknown",
            )
        name = _NAMES.get(method, method)
        raise UnsupportedQuantizationError(
            f"the checkpoint is quantized with {name} (quant_method {method!r}), which ckptconv cannot "
            "dequantize exactly; load it with its quantization library and save it dequantized first",
            scheme=method,
        )
    found = _giveaway(tensors)
    if found is None and any(companion.method == "quanto" for companion in companions(tensors)):
        check_declared("quanto", tensors)
        return Scheme("quanto", {}, parse("quanto", {}))  # the pairs show the whole layout: nothing to declare
    if found is not None:
        key, scheme = found
        raise UnsupportedQuantizationError(
            f"tensor {key!r} belongs to a {scheme} quantized checkpoint, but no quantization_config declares "
            "the scheme; convert the model folder it came from (its config.json declares it), since a plain cast "
            "would drop its scales",
            scheme=scheme,
            key=key,
        )
    return None


def refuse(scheme: str, key: str, problem: str) -> UnsupportedQuantizationError:
    """The error for a tensor of a declared scheme that does not have the layout the scheme defines."""
    return UnsupportedQuantizationError(f"{scheme} tensor {key!r} {problem}", scheme=scheme, key=key)


def refuse_config(scheme: str, field: str, problem: str) -> UnsupportedQuantizationError:
    """The error for a declared quantization_config that ckptconv cannot follow exactly."""
    return UnsupportedQuantizationError(f"the {scheme} quantization_config's {field} {problem}", scheme=scheme)
