"""The only place ckptconv turns lazy tensors into torch tensors, and back.

Importing torch costs over a second, so everything else in the package works on
:class:`~ckptconv.tensor.TensorRef` and only the functions here import it, when
a caller asks for real tensors.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Union

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


DeviceSpec = Union[None, str, "torch.device", Mapping[str, Union[str, "torch.device"]]]

# Host memory used to stage bytes on their way to a GPU: a few pinned buffers,
# filled from the file by reader threads (reading from the page cache is a
# memory copy, faster on several cores) while earlier ones are copied to the GPU.
STAGING_BYTES = 32 << 20
STAGING_BUFFERS = 4


def to_torch(refs: Mapping[str, TensorRef], *, device: DeviceSpec = None) -> dict[str, torch.Tensor]:
    """Read lazy tensors into torch tensors, keeping shared storages shared.

    Each storage is read once, and only the span its tensors use: a small
    view of a huge tensor does not drag the rest of it into memory. On a GPU
    the bytes go straight from the file to device memory through two pinned
    staging buffers, so host memory stays at those buffers however big the
    checkpoint.

    Args:
        refs: names to lazy tensors.
        device: where to put them: None or "cpu", a device ("cuda:1"), or a
            mapping from key to device (keys not in it go to the CPU).
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
    uploader: _Uploader | None = None
    buffers: dict[Storage, tuple[torch.Tensor, int]] = {}
    for storage, (start, stop, where) in spans.items():
        start -= start % _SPAN_ALIGNMENT
        if where.type == "cpu":
            buffer = torch.empty(stop - start, dtype=torch.uint8)
            if stop > start:
                storage.read_into(start, buffer.numpy().data)
        else:
            uploader = uploader or _Uploader()
            buffer = uploader.upload(storage, start, stop, where)
        buffers[storage] = (buffer, start)
    if uploader is not None:
        uploader.finish()

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


class _Uploader:
    """Streams storage bytes into GPU memory through a few pinned host buffers.

    Reader threads fill the buffers (preadv releases the GIL); the calling
    thread queues each full buffer's copy to the GPU without waiting for it,
    and a buffer is refilled only once its copy has finished (a CUDA event).
    """

    def __init__(self) -> None:
        import torch

        self.pinned = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(STAGING_BUFFERS)]
        self.free: list[int] = list(range(STAGING_BUFFERS))
        self.done: dict[int, Any] = {}
        self.order = itertools.count()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=STAGING_BUFFERS)

    def _slot(self) -> int:
        """A buffer whose last copy to the GPU has finished."""
        if not self.free:
            oldest = min(self.done, key=lambda slot: self.done[slot][0])
            self.done.pop(oldest)[1].synchronize()
            self.free.append(oldest)
        return self.free.pop()

    def upload(self, storage: Storage, start: int, stop: int, device: torch.device) -> torch.Tensor:
        import torch

        out = torch.empty(stop - start, dtype=torch.uint8, device=device)
        with storage.reader() as read_into, torch.cuda.device(device):
            pending: collections.deque[tuple[int, int, int, concurrent.futures.Future[None]]] = collections.deque()
            positions = iter(range(start, stop, STAGING_BYTES))

            def submit() -> bool:
                position = next(positions, None)
                if position is None:
                    return False
                slot = self._slot()
                count = min(STAGING_BYTES, stop - position)
                future = self.pool.submit(read_into, position, self.pinned[slot][:count].numpy().data)
                pending.append((slot, position, count, future))
                return True

            while len(pending) < STAGING_BUFFERS - 1 and submit():
                pass
            while pending:
                slot, position, count, future = pending.popleft()
                future.result()
                out[position - start : position - start + count].copy_(self.pinned[slot][:count], non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record()
                self.done[slot] = (next(self.order), event)
                submit()
        return out

    def finish(self) -> None:
        for _, event in self.done.values():
            event.synchronize()
        self.pool.shutdown()


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


def from_torch(tensor: Any, cache: dict[Any, Storage] | None = None) -> TensorRef:
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
        storage,
        dtype,
        tuple(tensor.shape),
        tuple(tensor.stride()),
        int(tensor.storage_offset()),
        conj=bool(tensor.is_conj()),
        neg=bool(tensor.is_neg()),
    )
