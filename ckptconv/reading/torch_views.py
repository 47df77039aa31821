"""Torch tensors over lazy tensors' bytes: the dtype each becomes, and the view that torch.load would make.

Shared by a single tensor's ``TensorRef.torch()`` (:func:`cpu_tensor`) and by
:func:`ckptconv.gpu.torch_tensors.to_torch`, which reads many to any device. torch is imported
only inside these functions, when a caller asks for torch tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptconv.dtypes import DType
from ckptconv.errors import CkptconvError

if TYPE_CHECKING:
    import torch

    from ckptconv.values.tensor import TensorRef

__all__ = ["SPAN_ALIGNMENT", "cpu_tensor", "from_numpy", "shares_bytes", "torch_dtype", "torch_lacks", "view_of"]

# Storage spans are read starting at a multiple of this, so views of any
# dtype sharing a storage keep their element alignment.
SPAN_ALIGNMENT = 64

# The torch release that added each dtype ckptconv reads but torch 2.4 (the oldest supported) lacks.
_ADDED_IN = {"float8_e8m0fnu": "2.7", "float4_e2m1fn_x2": "2.8"}


def torch_lacks(dtype: DType) -> str:
    """Why this torch has no tensors of ``dtype`` (``"this torch (2.4.1) has no float8_e8m0fnu dtype
    (torch 2.7 added it)"``), or ``""`` when it has them. ckptconv reads and writes such tensors without
    torch; only torch tensors of them need a newer torch."""
    import torch

    if isinstance(getattr(torch, dtype.name, None), torch.dtype):
        return ""
    added = _ADDED_IN.get(dtype.name)
    since = f" (torch {added} added it)" if added else ""
    return f"this torch ({torch.__version__}) has no {dtype.name} dtype{since}"


def torch_dtype(dtype: DType) -> torch.dtype:
    import torch

    lacking = torch_lacks(dtype)
    if lacking:
        raise CkptconvError(f"{lacking}; upgrade torch to load these tensors")
    return getattr(torch, dtype.name)  # type: ignore[no-any-return]


def shares_bytes(ref: TensorRef) -> bool:
    """True when the stored bytes can back a torch tensor as they are (conj/neg bits set on the view)."""
    import torch

    bits_ok = not ref.neg or hasattr(torch, "_neg_view")
    return ref.cast_to is None and ref.storage.byteorder == "little" and bits_ok


def from_numpy(ref: TensorRef) -> torch.Tensor:
    import torch

    array = ref.numpy()
    tensor = torch.from_numpy(array.copy() if not array.flags.writeable else array)
    out = torch_dtype(ref.out_dtype)
    return tensor.view(out) if tensor.dtype != out else tensor


def view_of(buffer: torch.Tensor, start: int, ref: TensorRef) -> torch.Tensor:
    """``ref`` as a view of ``buffer``, which holds its storage's bytes from byte ``start`` on."""
    import torch

    itemsize = ref.dtype.itemsize
    tensor = torch.empty(0, dtype=torch_dtype(ref.dtype), device=buffer.device)
    tensor.set_(buffer.untyped_storage(), (ref.offset * itemsize - start) // itemsize, ref.shape, ref.stride)
    # The bits, as torch.load sets them: views stay views, whatever they expand to.
    if ref.conj:
        tensor = tensor.conj()
    if ref.neg:
        tensor = torch._neg_view(tensor)
    return tensor


def cpu_tensor(ref: TensorRef) -> torch.Tensor:
    """One lazy tensor read into a CPU torch tensor, on this thread (:func:`ckptconv.gpu.torch_tensors.to_torch`
    reads many, in parallel, to any device)."""
    from ckptconv.runtime.extras import require_torch

    require_torch("TensorRef.torch()")
    import torch

    if not shares_bytes(ref):
        return from_numpy(ref)
    start, stop = ref.byte_span
    first = start - start % SPAN_ALIGNMENT
    buffer = torch.empty(stop - first, dtype=torch.uint8)
    if stop > first:
        with ref.storage.reader() as read_into:
            read_into(first, buffer.numpy().data)
    return view_of(buffer, first, ref)
