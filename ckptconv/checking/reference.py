"""Independent readers: a checkpoint's weights as ``torch.load(weights_only=True)`` or safetensors read them.

``verify`` and ``--verify`` normally re-read both sides with ckptconv's own readers,
which proves the writer right but cannot catch a reader bug: a value the reader
gets wrong is wrong on both sides. With ``reference="torch"`` the weights are read
by the libraries people load them with instead, wherever those can read the file
safely: ``torch.load(weights_only=True)`` for ``torch.save`` files (memory-mapped
for the zip format), the safetensors library for safetensors files. Where neither
can (a raw pickle, a file that needs classes ``weights_only`` refuses, sharded and
DCP folders), ckptconv's reader is used and the report says so.

Only *where* the weights sit in the file (``state_dict``, ``model.state_dict``) is
taken from ckptconv's selection; every tensor's dtype, shape, strides, conj/neg bits
and bytes come from the reference library.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptconv.dtypes import dtype_by_safetensors_code
from ckptconv.errors import CkptconvError
from ckptconv.loading import Checkpoint
from ckptconv.reading.sources import Source
from ckptconv.selection.weights import Selection
from ckptconv.values.tensor import ReadInto, Storage, TensorRef, contiguous_strides

if TYPE_CHECKING:
    from ckptconv.transforms.casts import Array

__all__ = ["CKPTCONV_READER", "SAFETENSORS_READER", "TORCH_READER", "ReferenceWeights", "reference_weights"]

TORCH_READER = "torch.load(weights_only=True)"
SAFETENSORS_READER = "the safetensors library"
CKPTCONV_READER = "ckptconv's reader"

# Formats the reference libraries read.
_TORCH_FORMATS = ("torch-zip", "torch-legacy")
_ALIASES_KEY = "ckptconv.aliases"


@dataclass(frozen=True)
class ReferenceWeights:
    """Weights read by an independent reader.

    Attributes:
        weights: names to tensors, after the same selection ckptconv made.
        reader: who read the values (:data:`TORCH_READER`, :data:`SAFETENSORS_READER`,
            or :data:`CKPTCONV_READER` with the reason the others could not).
    """

    weights: dict[str, TensorRef]
    reader: str


def reference_weights(checkpoint: Checkpoint, selection: Selection) -> ReferenceWeights:
    """The selected weights of ``checkpoint``, read by torch or the safetensors library where they can.

    Args:
        checkpoint: the file, opened by :func:`ckptconv.open` (its format decides the reader).
        selection: where the weights are (``checkpoint.select(...)``).

    Returns:
        A :class:`ReferenceWeights`; its ``reader`` says which reader was used.

    Raises:
        MissingDependencyError: torch is not installed (both readers give torch tensors).
    """
    from ckptconv.runtime.extras import require_torch

    require_torch("--verify=torch (torch's and the safetensors library's readers)")
    if checkpoint.format == "safetensors":
        from ckptconv.reading.torch_views import torch_lacks

        # safe_open(framework="pt") makes torch tensors: of a dtype this torch lacks it raises AttributeError.
        lacking = next(filter(None, (torch_lacks(ref.dtype) for ref in selection.weights.values())), "")
        if lacking:
            return _ckptconv(selection, f"the safetensors library cannot give it to torch: {lacking}")
        return ReferenceWeights(_safetensors_weights(checkpoint.path), SAFETENSORS_READER)
    if checkpoint.format in _TORCH_FORMATS:
        if selection.kind != "state_dict":
            return _ckptconv(selection, "torch.load(weights_only=True) cannot rebuild a pickled module")
        try:
            tree = _torch_load(checkpoint.path, mmap=checkpoint.format == "torch-zip")
        except Exception as error:  # torch refuses the file (needs classes weights_only will not rebuild, ...)
            lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
            # torch's message opens with advice ("Weights only load failed. ... two options"); the reason
            # is its "WeightsUnpickler error: ..." line.
            why = next((line for line in lines if line.startswith("WeightsUnpickler error:")), lines[0])
            why = why.split(". ")[0].rstrip(".")  # its first sentence: the advice after it is for torch users
            return _ckptconv(selection, f"torch.load(weights_only=True) refused it: {why[:200]}")
        state = _follow(tree, selection.path)
        if state is None:
            return _ckptconv(selection, f"torch.load gives no state dict at {selection.where!r}")
        return ReferenceWeights(state, TORCH_READER)
    return _ckptconv(
        selection, f"neither torch.load(weights_only=True) nor safetensors reads {checkpoint.format} input"
    )


def _ckptconv(selection: Selection, reason: str) -> ReferenceWeights:
    return ReferenceWeights(dict(selection.weights), f"{CKPTCONV_READER} ({reason})")


def _torch_load(path: str, *, mmap: bool) -> Any:
    import torch

    kwargs: dict[str, Any] = {"map_location": "cpu", "weights_only": True}
    if mmap:
        kwargs["mmap"] = True  # tensors stay in the file: memory is not the checkpoint's size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own notes (TypedStorage is deprecated, ...) are not ours to print
        return torch.load(path, **kwargs)


def _follow(tree: Any, path: tuple[Any, ...]) -> dict[str, TensorRef] | None:
    """The state dict at ``path`` in a tree torch loaded, as lazy tensors over torch's own memory."""
    import torch

    from ckptconv.gpu.torch_tensors import from_torch

    node = tree
    for part in path:
        in_mapping = isinstance(node, Mapping) and part in node
        in_sequence = isinstance(node, (list, tuple)) and isinstance(part, int) and -len(node) <= part < len(node)
        if not (in_mapping or in_sequence):
            return None
        node = node[part]
    if not isinstance(node, Mapping):
        return None
    cache: dict[Any, Storage] = {}
    weights: dict[str, TensorRef] = {}
    for key, value in node.items():
        if isinstance(value, torch.Tensor) and _has_quantizer(value):
            # A torch.ao quantized tensor: ckptconv reads it as its dequantize().
            weights[str(key)] = from_torch(value.dequantize(), cache)
        elif isinstance(value, torch.Tensor):
            # Bytes, strides, offset and the conj/neg bits exactly as torch rebuilt them.
            weights[str(key)] = from_torch(value, cache, quantized_as_stored=True)
        elif value is not None and not str(key).endswith("_extra_state"):
            return None
    return weights


def _safetensors_weights(path: str) -> dict[str, TensorRef]:
    """Each tensor read by the safetensors library when its bytes are asked for, one at a time."""
    from safetensors import safe_open

    weights: dict[str, TensorRef] = {}
    with safe_open(path, framework="pt") as file:
        metadata = file.metadata() or {}
        for key in file.keys():  # noqa: SIM118 (safe_open is not a mapping)
            piece = file.get_slice(key)
            code = piece.get_dtype()
            dtype = dtype_by_safetensors_code(code)
            if dtype is None:
                raise CkptconvError(f"the safetensors library reads {key!r} as {code}, which ckptconv does not know")
            shape = tuple(int(n) for n in piece.get_shape())
            if code == "F4" and shape:
                shape = (*shape[:-1], shape[-1] // 2)  # the library gives torch two 4-bit floats a byte
            count = 1
            for n in shape:
                count *= n
            storage = Storage(count * dtype.itemsize, _LibraryTensor(path, key), name=key)
            weights[key] = TensorRef(storage, dtype, shape, contiguous_strides(shape))
    # ckptconv's own outputs store a tied tensor once and name its other keys in the metadata.
    aliases = json.loads(metadata.get(_ALIASES_KEY, "{}"))
    if isinstance(aliases, dict):
        for alias, target in aliases.items():
            if isinstance(target, str) and target in weights and alias not in weights:
                weights[alias] = weights[target]
    return weights


@dataclass(frozen=True, eq=False)
class _LibraryTensor(Source):
    """A byte source that asks the safetensors library for one tensor when opened."""

    path: str
    key: str

    @contextlib.contextmanager
    def opened(self) -> Iterator[ReadInto]:
        data = self._bytes()

        def read_into(start: int, out: memoryview) -> None:
            out.cast("B")[:] = data.data[start : start + out.nbytes]

        yield read_into

    def _bytes(self) -> Array:
        import torch
        from safetensors import safe_open

        with safe_open(self.path, framework="pt") as file:
            tensor = file.get_tensor(self.key)
        flat = torch.empty(tensor.numel(), dtype=tensor.dtype)
        flat.copy_(tensor.reshape(-1))
        return flat.view(torch.uint8).numpy()

    def paths(self) -> frozenset[str]:
        return frozenset({self.path})


def _has_quantizer(tensor: Any) -> bool:
    """True for a torch.ao quantized tensor; False for bytes viewed as a quantized dtype (saved through a
    ``QInt8Storage``), which have no quantizer: torch's ``qscheme()`` fails an internal assert on them."""
    if not tensor.is_quantized:
        return False
    try:
        tensor.qscheme()
    except RuntimeError:
        return False
    return True
