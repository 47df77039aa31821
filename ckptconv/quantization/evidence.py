"""What the tensors themselves say about their quantization: the companions beside each weight.

A quantized weight never travels alone: DeepSeek's fp8 blocks have ``X.weight_scale_inv``,
compressed-tensors ``X.weight_scale`` / ``X.weight_packed`` / ``X.weight_shape`` /
``X.weight_zero_point`` / ``X.weight_global_scale``, gpt-oss's MXFP4 ``X_blocks`` with ``X_scales``,
optimum-quanto ``X.weight._data`` with ``X.weight._scale``. :func:`companions` names each such
tensor and the scheme it belongs to; the declared scheme is checked against them
(:func:`check_declared`), and the output of every conversion against them again
(:mod:`.output_check`). Names only: no byte is read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ckptconv.errors import UnsupportedQuantizationError
from ckptconv.values.tensor import TensorRef

__all__ = ["Companion", "check_declared", "companions", "partner_missing"]


@dataclass(frozen=True)
class Companion:
    """A tensor that only a quantized weight has beside it.

    Attributes:
        key: the tensor's name.
        method: the ``quant_method`` whose layout it is (``fp8``, ``compressed-tensors``, ``mxfp4``, ``quanto``),
            or the name of a scheme ckptconv does not dequantize.
        what: how a message names it (``"a DeepSeek fp8 block scale"``).
    """

    key: str
    method: str
    what: str


_CT_LEAVES = {
    "weight_packed": "a compressed-tensors packed weight",
    "weight_scale": "a compressed-tensors weight scale",
    "weight_zero_point": "a compressed-tensors zero point",
    "weight_global_scale": "a compressed-tensors nvfp4 global scale",
    "weight_shape": "a compressed-tensors packed weight's shape",
    "weight_g_idx": "a compressed-tensors group index",
}
_OTHER_LEAVES = {
    "qweight": "GPTQ/AWQ",
    "qzeros": "GPTQ/AWQ",
    "g_idx": "GPTQ",
    "quant_state": "bitsandbytes",
    "quant_map": "bitsandbytes",
    "absmax": "bitsandbytes",
    "SCB": "bitsandbytes int8",
    "weight_format": "bitsandbytes int8",
}


def _companion(key: str, names: Mapping[str, TensorRef] | frozenset[str]) -> Companion | None:
    base, _, leaf = key.rpartition(".")
    if leaf.endswith("_scale_inv"):
        return Companion(key, "fp8", "a DeepSeek fp8 block scale")
    if leaf in _CT_LEAVES:
        return Companion(key, "compressed-tensors", _CT_LEAVES[leaf])
    if leaf in ("_data", "_scale", "_shift") and base:
        return Companion(key, "quanto", f"an optimum-quanto {leaf} tensor")
    if leaf.endswith("_blocks") and key[: -len("_blocks")] + "_scales" in names:
        return Companion(key, "mxfp4", "an MXFP4 block tensor")
    if leaf.endswith("_scales") and key[: -len("_scales")] + "_blocks" in names:
        return Companion(key, "mxfp4", "an MXFP4 scale tensor")
    if leaf in _OTHER_LEAVES or ".quant_state." in f".{key}.":
        scheme = _OTHER_LEAVES.get(leaf, "bitsandbytes")
        return Companion(key, scheme, f"a {scheme} tensor")
    return None


def companions(names: Iterable[str]) -> list[Companion]:
    """Every tensor of ``names`` that only a quantized weight has beside it, in order."""
    known = frozenset(names)
    return [found for key in known if (found := _companion(key, known)) is not None]


def check_declared(method: str, tensors: Mapping[str, TensorRef]) -> None:
    """Refuse a declared ``method`` that the tensors contradict (another scheme's companions beside a weight).

    Raises:
        UnsupportedQuantizationError: one line naming the first tensor (by name) of another scheme.
    """
    conflicts = [found for key in tensors if (found := _companion(key, tensors)) and found.method != method]
    if conflicts:
        found = min(conflicts, key=lambda companion: companion.key)
        key = found.key
        raise UnsupportedQuantizationError(
            f"tensor {key!r} is {found.what}, but the quantization_config declares {method}; the config and "
            "the tensors disagree, so ckptconv cannot tell how to dequantize it: fix the quantization_config",
            scheme=method,
            key=key,
        )


# The tensor each companion leaf needs beside it (any one of them).
_NEEDS = {
    "weight_scale_inv": ("weight",),
    "weight_scale": ("weight", "weight_packed"),
    "weight_zero_point": ("weight", "weight_packed"),
    "weight_global_scale": ("weight_packed",),
    "weight_shape": ("weight_packed",),
    "weight_packed": ("weight_scale",),
}


def partner_missing(key: str, names: Mapping[str, object] | frozenset[str]) -> str | None:
    """The tensor ``key`` (a companion) needs and ``names`` lacks, or None: what an orphan scale is missing."""
    base, _, leaf = key.rpartition(".")
    prefix = f"{base}." if base else ""
    if leaf in _NEEDS:
        needed = [prefix + name for name in _NEEDS[leaf]]
        return None if any(name in names for name in needed) else needed[0]
    if leaf.endswith("_scale_inv"):
        weight = key[: -len("_scale_inv")]
        return None if weight in names else weight
    if leaf in ("_scale", "_shift"):
        return None if f"{prefix}_data" in names or f"{prefix}_data._data" in names else f"{prefix}_data"
    if leaf == "_data" and not base.endswith("._data"):
        return None if f"{prefix}_scale" in names else f"{prefix}_scale"
    return None
