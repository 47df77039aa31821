"""The quantization stage of a conversion: what a quantized checkpoint's weights become.

:func:`ckptconv.quantization.detect` finds the scheme (or refuses it); a :class:`Dequantization` says
what the selected weights become: dequantized to the ``--dtype`` target, or kept with their scales.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from ckptconv._text import plural
from ckptconv.dtypes import DType
from ckptconv.quantization.plan import dequantize
from ckptconv.quantization.schemes import Scheme, detect
from ckptconv.reading.model_folder import model_folder, read_config
from ckptconv.selection.weights import Selection
from ckptconv.values.tensor import TensorRef

__all__ = ["Dequantization", "declared_scheme"]

# The formats whose metadata can declare a scheme (safetensors' __metadata__, and a sharded index's).
_DECLARING_FORMATS = ("safetensors", "sharded")


def declared_scheme(
    source: str, format: str, metadata: Mapping[str, str], weights: Mapping[str, TensorRef]
) -> Scheme | None:
    """The scheme the checkpoint at ``source`` declares (its model folder's ``config.json``, its metadata) or gives
    away (weight/scale pairs), or None; the one place ``convert`` and ``inspect`` ask.

    Raises:
        UnsupportedQuantizationError: a scheme ckptconv cannot undo exactly.
    """
    folder = model_folder(source)
    config = read_config(folder) if folder is not None else None
    return detect(config, metadata if format in _DECLARING_FORMATS else None, weights)


@dataclass(frozen=True)
class Dequantization:
    """A quantized checkpoint's scheme, and the dtype its weights are dequantized to (None: kept as they are)."""

    scheme: Scheme
    target: DType | None

    def apply(self, selection: Selection) -> Selection:
        if self.target is None:
            return selection
        return dataclasses.replace(selection, weights=dequantize(selection.weights, self.scheme, self.target))

    def note(self, selection: Selection, state: Mapping[str, TensorRef]) -> str:
        if self.target is None:
            return (
                f"the weights are quantized ({self.scheme}) and were kept so, with their scales; "
                "pass --dtype bf16, fp16 or fp32 to dequantize them exactly"
            )
        gone = len(selection.weights) - len(state)
        return (
            f"dequantized the {self.scheme} weights to {self.target.name}, exactly as the scheme's reference does; "
            f"left out {plural(gone, 'scale, zero point or shape tensor', 'scale, zero point and shape tensors')}"
        )
