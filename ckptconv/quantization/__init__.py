"""Exact CPU dequantization of quantized checkpoints, decided by the declared scheme.

:func:`detect` reads the declaration (``config.json``'s ``quantization_config``, the
safetensors metadata) and refuses what it cannot undo exactly; :func:`dequantize` plans the
unquantized state dict, whose weights are computed one at a time as a writer reads them.
One module per scheme, each with its reference order of operations in its docstring:
:mod:`.fp8_block`, :mod:`.compressed_tensors`, :mod:`.mxfp4`. numpy only; no torch.
"""

from __future__ import annotations

from ckptconv.quantization.plan import TARGETS, dequantize
from ckptconv.quantization.schemes import Scheme, detect

__all__ = ["TARGETS", "Scheme", "dequantize", "detect"]
