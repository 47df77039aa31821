"""A byte source whose bytes are computed: a dequantized weight, made from its quantized inputs.

:class:`Dequantized` implements ckptconv's ``ByteSource`` protocol: ``opened()`` reads the
quantized inputs, computes the whole dequantized tensor once, and serves byte ranges of it for
as long as the context stays open, so a writer streams it with memory bounded by that one
weight, its inputs and the temporaries of its formula.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from ckptconv.dtypes import DType
from ckptconv.quantization._exact import Array
from ckptconv.reading.sources import Source
from ckptconv.values.tensor import ReadInto, Storage, TensorRef, contiguous_strides

__all__ = ["Dequantized", "computed_tensor"]


@dataclass(frozen=True, eq=False)
class Dequantized(Source):
    """Bytes of ``compute(inputs)``: a contiguous array in the output dtype's storage representation.

    Attributes:
        compute: takes the inputs' arrays (``TensorRef.numpy()``, by name) and returns the result.
        inputs: the quantized tensors the result is made of, by role (``"weight"``, ``"scale"``).
        nbytes: the size the result must have, checked on every computation.
    """

    compute: Callable[[Mapping[str, Array]], Array]
    inputs: Mapping[str, TensorRef]
    nbytes: int

    @contextlib.contextmanager
    def opened(self) -> Iterator[ReadInto]:
        arrays = {role: ref.numpy() for role, ref in self.inputs.items()}
        result = np.ascontiguousarray(self.compute(arrays))
        del arrays
        data = result.reshape(-1).data.cast("B")
        if data.nbytes != self.nbytes:
            raise RuntimeError(f"dequantized {data.nbytes} bytes where {self.nbytes} were planned")  # a bug

        def read_into(start: int, out: memoryview) -> None:
            out.cast("B")[:] = data[start : start + out.nbytes]

        try:
            yield read_into
        finally:
            data.release()

    def paths(self) -> frozenset[str]:
        files: frozenset[str] = frozenset()
        for ref in self.inputs.values():
            files |= ref.storage.source.paths()
        return files


def computed_tensor(
    name: str,
    compute: Callable[[Mapping[str, Array]], Array],
    inputs: Mapping[str, TensorRef],
    dtype: DType,
    shape: tuple[int, ...],
) -> TensorRef:
    """A lazy ``dtype`` tensor of ``shape`` whose bytes are ``compute``'s result on ``inputs``."""
    nbytes = math.prod(shape) * dtype.itemsize
    storage = Storage(nbytes, Dequantized(compute, dict(inputs), nbytes), name=name)
    return TensorRef(storage, dtype, tuple(shape), contiguous_strides(tuple(shape)))
