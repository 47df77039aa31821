"""The only place ckptconv turns lazy tensors into torch tensors, and back.

Importing torch costs over a second, so everything else in the package works on
:class:`~ckptconv.values.tensor.TensorRef` and only the functions here import it, when
a caller asks for real tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Union

from ckptconv.dtypes import dtype_by_name
from ckptconv.errors import CkptconvError
from ckptconv.gpu.transfer import Span, read_spans
from ckptconv.reading.sources import InMemory
from ckptconv.reading.torch_views import SPAN_ALIGNMENT, from_numpy, shares_bytes, view_of
from ckptconv.values.tensor import Storage, TensorRef

if TYPE_CHECKING:
    import torch

__all__ = ["from_torch", "to_torch"]


DeviceSpec = Union[None, str, "torch.device", Mapping[str, Union[str, "torch.device"]]]


def to_torch(
    refs: Mapping[str, TensorRef], *, device: DeviceSpec = None, crcs: dict[Storage, int] | None = None
) -> dict[str, torch.Tensor]:
    """Read lazy tensors into torch tensors, keeping shared storages shared.

    Each storage is read once, and only the span its tensors use: a small
    view of a huge tensor does not drag the rest of it into memory. Parallel
    reader threads fill the tensors (see :mod:`ckptconv.gpu.transfer`); on a GPU
    the bytes go from the file to device memory through each reader's two
    pinned staging buffers, so host memory stays at those buffers however big
    the checkpoint.

    Args:
        refs: names to lazy tensors.
        device: where to put them: None or "cpu", a device ("cuda:1"), or a
            mapping from key to device (keys not in it go to the CPU).
        crcs: when given, receives the CRC-32 of the whole zip records read,
            taken as they were read (see :func:`ckptconv.gpu.transfer.read_spans`).
    """
    import torch

    def device_of(key: str) -> torch.device:
        target = device.get(key, "cpu") if isinstance(device, Mapping) else device
        return torch.device(target if target is not None else "cpu")

    spans: dict[Storage, tuple[int, int, torch.device]] = {}
    for key, ref in refs.items():
        if shares_bytes(ref):
            start, stop = ref.byte_span
            known = spans.get(ref.storage)
            where = known[2] if known is not None else device_of(key)
            spans[ref.storage] = (
                (start, stop, where) if known is None else (min(known[0], start), max(known[1], stop), where)
            )
    buffers: dict[Storage, tuple[torch.Tensor, int]] = {}
    work: list[Span] = []
    for storage, (start, stop, where) in spans.items():
        first = start - start % SPAN_ALIGNMENT
        buffer = torch.empty(stop - first, dtype=torch.uint8, device=where)
        work.append(Span(storage, first, stop, buffer))
        buffers[storage] = (buffer, first)
    # Parallel readers; to a GPU through pinned buffers and one CUDA stream per reader.
    read_spans(work, crcs=crcs)

    result: dict[str, torch.Tensor] = {}
    for key, ref in refs.items():
        if shares_bytes(ref):
            buffer, start = buffers[ref.storage]
            tensor = view_of(buffer, start, ref)
        else:
            tensor = from_numpy(ref)
        target = device_of(key)
        if tensor.device != target:
            tensor = tensor.to(target)
        result[key] = tensor
    return result


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
