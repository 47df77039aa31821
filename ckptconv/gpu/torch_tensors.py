"""The only place ckptconv turns lazy tensors into torch tensors, and back.

Importing torch costs over a second, so everything else in the package works on
:class:`~ckptconv.values.tensor.TensorRef` and only the functions here import it, when
a caller asks for real tensors.
"""

from __future__ import annotations

import os
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
    from ckptconv.runtime.extras import require_torch

    require_torch("torch tensors")
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
    sizes = [(stop - (start - start % SPAN_ALIGNMENT), where) for start, stop, where in spans.values()]
    reserved = _reserve(sizes)
    for storage, (start, stop, where) in spans.items():
        first = start - start % SPAN_ALIGNMENT
        buffer = torch.empty(stop - first, dtype=torch.uint8, device=where)
        work.append(Span(storage, first, stop, buffer))
        buffers[storage] = (buffer, first)
    _check_reserved(reserved, work)
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


#: Reserve each GPU's large destinations with one allocation before they are made (:func:`_reserve`).
#: For benchmarks and tests.
reserve_destinations = True

# torch's caching allocator serves requests up to 1 MiB from its small pool, larger ones from the large
# pool, whose free blocks it splits; only the large ones can come out of one reservation.
_SMALL_POOL_BYTES = 1 << 20
_MIN_RESERVE_BYTES = 64 << 20


def _rounded(nbytes: int) -> int:
    return -(-nbytes // 512) * 512  # the caching allocator's own rounding


def _reserve(sizes: list[tuple[int, torch.device]]) -> dict[torch.device, tuple[int, int]]:
    """Make torch's caching allocator take each CUDA device's large destinations in one ``cudaMalloc``.

    Why: one allocation of the whole size, freed at once, stays in the allocator's cache, and the
    destinations made next are split out of it. In fresh processes on one H200, 8 GiB safetensors
    loads took 30.6 GB/s this way against 27.7 with one ``cudaMalloc`` per tensor (medians of 3
    alternating rounds, round 8 of bench/results/bench_gpu_load_h200.md). Each tensor still has its
    storage of its own. Skipped where an allocator setting is given (``max_split_size_mb`` would keep
    the block whole; expandable segments need no help), and on ROCm.

    Returns ``{device: (address, size)}`` of what was reserved, for :func:`_check_reserved`.
    """
    import torch

    settings = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
    if not reserve_destinations or settings or torch.version.hip:
        return {}
    totals: dict[torch.device, int] = {}
    for nbytes, where in sizes:
        if where.type == "cuda" and nbytes > _SMALL_POOL_BYTES:
            totals[where] = totals.get(where, 0) + _rounded(nbytes)
    reserved: dict[torch.device, tuple[int, int]] = {}
    for where, total in totals.items():
        if total < _MIN_RESERVE_BYTES:
            continue
        try:
            block = torch.empty(total, dtype=torch.uint8, device=where)
        except torch.cuda.OutOfMemoryError:  # the destinations one by one may still fit the cache
            continue
        reserved[block.device] = (block.data_ptr(), total)  # "cuda" named with its index, as tensors give it
        del block
    return reserved


def _check_reserved(reserved: dict[torch.device, tuple[int, int]], work: list[Span]) -> None:
    """Return the reservation to CUDA if the allocator did not split the destinations out of it."""
    import torch

    for span in work:
        where = span.out.device
        if where in reserved and span.out.numel() > _SMALL_POOL_BYTES:
            address, total = reserved[where]
            if not address <= span.out.data_ptr() < address + total:
                torch.cuda.empty_cache()  # frees only blocks no tensor uses: the unused reservation
                return


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
