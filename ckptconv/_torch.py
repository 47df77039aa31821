"""The only place ckptconv turns lazy tensors into torch tensors, and back.

Importing torch costs over a second, so everything else in the package works on
:class:`~ckptconv.tensor.TensorRef` and only the functions here import it, when
a caller asks for real tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Union

from ._transfer import Span, read_spans
from .dtypes import DType, dtype_by_name
from .errors import CkptconvError
from .tensor import InMemory, Storage, TensorRef

if TYPE_CHECKING:
    import torch

__all__ = ["from_torch", "to_torch"]

# Storage spans are read starting at a multiple of this, so views of any
# dtype sharing a storage keep their element alignment.
_SPAN_ALIGNMENT = 64


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


DeviceSpec = Union[None, str, "torch.device", Mapping[str, Union[str, "torch.device"]]]


def to_torch(
    refs: Mapping[str, TensorRef], *, device: DeviceSpec = None, crcs: dict[Storage, int] | None = None
) -> dict[str, torch.Tensor]:
    """Read lazy tensors into torch tensors, keeping shared storages shared.

    Each storage is read once, and only the span its tensors use: a small
    view of a huge tensor does not drag the rest of it into memory. Parallel
    reader threads fill the tensors (see :mod:`ckptconv._transfer`); on a GPU
    the bytes go from the file to device memory through each reader's two
    pinned staging buffers, so host memory stays at those buffers however big
    the checkpoint.

    Args:
        refs: names to lazy tensors.
        device: where to put them: None or "cpu", a device ("cuda:1"), or a
            mapping from key to device (keys not in it go to the CPU).
        crcs: when given, receives the CRC-32 of the whole zip records read,
            taken as they were read (see :func:`ckptconv._transfer.read_spans`).
    """
    import torch

    def device_of(key: str) -> torch.device:
        target = device.get(key, "cpu") if isinstance(device, Mapping) else device
        return torch.device(target if target is not None else "cpu")

    spans: dict[Storage, tuple[int, int, torch.device]] = {}
    for key, ref in refs.items():
        if _shares_bytes(ref):
            start, stop = ref.byte_span
            known = spans.get(ref.storage)
            where = known[2] if known is not None else device_of(key)
            spans[ref.storage] = (
                (start, stop, where) if known is None else (min(known[0], start), max(known[1], stop), where)
            )
    buffers: dict[Storage, tuple[torch.Tensor, int]] = {}
    work: list[Span] = []
    for storage, (start, stop, where) in spans.items():
        first = start - start % _SPAN_ALIGNMENT
        buffer = torch.empty(stop - first, dtype=torch.uint8, device=where)
        work.append(Span(storage, first, stop, buffer))
        buffers[storage] = (buffer, first)
    # Parallel readers; to a GPU through pinned buffers and one CUDA stream per reader.
    read_spans(work, crcs=crcs)

    result: dict[str, torch.Tensor] = {}
    for key, ref in refs.items():
        if _shares_bytes(ref):
            buffer, start = buffers[ref.storage]
            itemsize = ref.dtype.itemsize
            tensor = torch.empty(0, dtype=torch_dtype(ref.dtype), device=buffer.device)
            tensor.set_(buffer.untyped_storage(), (ref.offset * itemsize - start) // itemsize, ref.shape, ref.stride)
            # The bits, as torch.load sets them: views stay views, whatever they expand to.
            if ref.conj:
                tensor = tensor.conj()
            if ref.neg:
                tensor = torch._neg_view(tensor)
        else:
            tensor = _from_numpy(ref)
        target = device_of(key)
        if tensor.device != target:
            tensor = tensor.to(target)
        result[key] = tensor
    return result


def _shares_bytes(ref: TensorRef) -> bool:
    """True when the stored bytes can back a torch tensor as they are (conj/neg bits set on the view)."""
    import torch

    bits_ok = not ref.neg or hasattr(torch, "_neg_view")
    return ref.cast_to is None and ref.storage.byteorder == "little" and bits_ok


def _from_numpy(ref: TensorRef) -> torch.Tensor:
    import torch

    array = ref.numpy()
    tensor = torch.from_numpy(array.copy() if not array.flags.writeable else array)
    out = torch_dtype(ref.out_dtype)
    return tensor.view(out) if tensor.dtype != out else tensor


def _without_plain_bytes(tensor: Any) -> str:
    """Why ``tensor``'s values are not one strided run of bytes, and what to do; ``""`` if they are."""
    import torch

    if tensor.is_nested:  # nested tensors report the strided layout
        return "it is a nested tensor; unbind it into ordinary tensors (tensor.unbind()) first"
    if tensor.is_quantized:
        return "it is a quantized tensor; dequantize it (tensor.dequantize()) first"
    if tensor.layout != torch.strided:
        return f"it is a sparse tensor ({tensor.layout}); make it dense (tensor.to_dense()) first"
    if tensor.is_meta:
        return "it is a meta-device tensor, which holds no data; load real weights into it first"
    return ""


def from_torch(tensor: Any, cache: dict[Any, Storage] | None = None, *, quantized_as_stored: bool = False) -> TensorRef:
    """A lazy tensor over a torch tensor's CPU bytes, without copying them.

    Tensors handed in with one ``cache`` that share a storage get one
    :class:`Storage`, so ties survive ``ckptconv.save(model.state_dict(), ...)``.
    GPU tensors are copied to the CPU first.

    ``quantized_as_stored``: take a quantized tensor's stored integers as they
    are (its scale and zero point are not kept), as torch.load rebuilds a tensor
    of a quantized dtype saved through its storage (``QInt8Storage``); the
    reference reader compares those bytes. Otherwise quantized tensors are refused.
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    why = "" if quantized_as_stored and tensor.is_quantized else _without_plain_bytes(tensor)
    if why:
        raise CkptconvError(why)
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
        storage,
        dtype,
        tuple(tensor.shape),
        tuple(tensor.stride()),
        int(tensor.storage_offset()),
        conj=bool(tensor.is_conj()),
        neg=bool(tensor.is_neg()),
    )
