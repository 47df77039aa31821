"""The one error the dequantization package adds: a quantization scheme it will not guess at.

It is a leaf under :class:`~ckptconv.errors.UnsupportedFormatError` (a caller that refuses
unreadable inputs refuses these too); ``scheme`` names the scheme, ``key`` the tensor that
gave it away, when a tensor did.
"""

from __future__ import annotations

from ..errors import UnsupportedFormatError

__all__ = ["UnsupportedQuantizationError"]


class UnsupportedQuantizationError(UnsupportedFormatError):
    """The checkpoint is quantized with a scheme ckptconv cannot dequantize exactly."""

    def __init__(self, message: str, *, scheme: str, key: str | None = None) -> None:
        super().__init__(message)
        self.scheme = scheme
        self.key = key
