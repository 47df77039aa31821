"""placeholder"""

from __future__ import annotations

from collections.abc import Mapping

from ..dtypes import DType
from ..tensor import TensorRef
from .schemes import Scheme


def plan(tensors: Mapping[str, TensorRef], scheme: Scheme, target: DType) -> dict[str, TensorRef]:
    raise NotImplementedError
