"""The only place ckptconv turns lazy tensors into torch tensors, and back.

Importing torch costs over a second, so everything else in the package works on
:class:`~ckptconv.tensor.TensorRef` and only the functions here import it, when
a caller asks for real tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional

from .dtypes import DType, dtype_by_name
from .errors import CkptconvError
from .tensor import InMemory, Storage, TensorRef

if TYPE_CHECKING:
    import torch

__all__ = ["from_torch", "to_torch"]

# Storage spans are read starting at a multiple of this, so views of any
# dtype sharing a storage keep their element alignment.
_SPAN_ALIGNMENT = 64


def torch_dtype(dtype: DType) -> torch.dtype:
    import torch

    value = getattr(torch, dtype.name, None)
    if value is None:
        raise CkptconvError(f"this torch has no {dtype.name} dtype; upgrade torch to load these tensors")
    return value  # type: ignore[no-any-return]


def to_torch(refs: Mapping[str, TensorRef], *, device: Optional[str] = None) -> dict[str, torch.Tensor]:
    """Read lazy tensors into torch tensors on the CPU, keeping shared storages shared.

    Each storage is read once, and only the span its tensors use: a small
    view of a huge tensor does not drag the rest of it into memory.
    """
    import torch

    spans: dict[Storage, tuple[int, int]] = {}
    for ref in refs.values():
        if _shares_bytes(ref):
            start, stop = ref.byte_span
            known = spans.get(ref.storage)
            spans[ref.storage] = (start, stop) if known is None else (min(known[0], start), max(known[1], stop))
    buffers: dict[Storage, tuple[torch.Tensor, int]] = {}
    for storage, (start, stop) in spans.items():
        start -= start % _SPAN_ALIGNMENT
        buffer = torch.empty(stop - start, dtype=torch.uint8)
        if stop > start:
            storage.read_into(start, buffer.numpy().data)
        buffers[storage] = (buffer, start)

    result: dict[str, torch.Tensor] = {}
    for key, ref in refs.items():
        if _shares_bytes(ref):
            buffer, start = buffers[ref.storage]
            itemsize = ref.dtype.itemsize
            tensor = torch.empty(0, dtype=torch_dtype(ref.dtype))
            tensor.set_(buffer.untyped_storage(), (ref.offset * itemsize - start) // itemsize, ref.shape, ref.stride)
        else:
            tensor = _from_numpy(ref)
        if device is not None and device != "cpu":
            tensor = tensor.to(device)
        result[key] = tensor
    return result


def _shares_bytes(ref: TensorRef) -> bool:
    """True when the stored bytes can back a torch tensor as they are."""
    return ref.cast_to is None and ref.storage.byteorder == "little"


def _from_numpy(ref: TensorRef) -> torch.Tensor:
    import torch

    array = ref.numpy()
    tensor = torch.from_numpy(array.copy() if not array.flags.writeable else array)
    out = torch_dtype(ref.out_dtype)
    return tensor.view(out) if tensor.dtype != out else tensor


def from_torch(tensor: Any, cache: Optional[dict[Any, Storage]] = None) -> TensorRef:
    """A lazy tensor over a torch tensor's CPU bytes, without copying them.

    Tensors handed in with one ``cache`` that share a storage get one
    :class:`Storage`, so ties survive ``ckptconv.save(model.state_dict(), ...)``.
    GPU tensors are copied to the CPU first.
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse or tensor.is_quantized or tensor.layout != torch.strided:
        raise CkptconvError("sparse, quantized and other non-strided tensors cannot be converted")
    dtype = dtype_by_name(str(tensor.dtype))
    if dtype is None:
        raise CkptconvError(f"ckptconv cannot store tensors of dtype {tensor.dtype}")
    untyped = tensor.untyped_storage()
    key = (untyped.data_ptr(), str(tensor.device), untyped.nbytes())
    storage = cache.get(key) if cache is not None else None
    if storage is None:
        cpu = untyped if tensor.device.type == "cpu" else untyped.cpu()  # type: ignore[no-untyped-call]
        as_bytes = torch.empty(0, dtype=torch.uint8).set_(cpu)
        # .detach() so tensors that require grad can be viewed as numpy.
        storage = Storage(cpu.nbytes(), InMemory(as_bytes.detach().numpy().data))
        if cache is not None:
            cache[key] = storage
    return TensorRef.checked(
        storage, dtype, tuple(tensor.shape), tuple(tensor.stride()), int(tensor.storage_offset())
    )
