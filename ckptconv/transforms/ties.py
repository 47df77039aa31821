"""Tied weights: one tensor under two names (a language model's head and its input embeddings).

A model that ties its head to its embeddings (``tie_word_embeddings: true``) holds one tensor under both names;
``torch.save`` of its state dict stores it once, with both keys viewing the same storage, while formats that cannot
share storage (safetensors, DCP) store either one name (``save_pretrained`` leaves the head out) or two equal
copies. :func:`same_data` tells whether two tensors are one (the same storage, offset, shape, strides and dtype)
or bit-identical copies (their bytes read and compared, a chunk at a time: memory stays bounded by two chunks);
:func:`shared_keys` finds the keys a state dict ties; :func:`input_embedding` names a model's input embeddings
among its keys, the tensor Hugging Face models tie the head to.

Nothing here decides to drop anything: ``fit`` does, only where the reference ties the two names.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ckptconv.values.tensor import TensorRef

__all__ = ["HEAD", "SAME_BYTES", "SAME_STORAGE", "input_embedding", "same_data", "shared_keys"]

#: The head Hugging Face language models tie to their input embeddings.
HEAD = "lm_head.weight"
# Input embeddings as Hugging Face models name them, in the order they are looked for: T5/BART's shared table,
# Llama/Mistral/Qwen, GPT-2, BERT-likes, GPT-NeoX, InternLM, then any plain `embeddings.weight`.
_EMBEDDINGS = (
    "shared.weight",
    "embed_tokens.weight",
    "wte.weight",
    "word_embeddings.weight",
    "embed_in.weight",
    "tok_embeddings.weight",
    "embeddings.weight",
)
SAME_STORAGE = "shares storage with"
SAME_BYTES = "is a bit-identical copy of"
_CHUNK = 16 << 20


def input_embedding(keys: Iterable[str]) -> str | None:
    """The key of the input embeddings among ``keys`` (``model.embed_tokens.weight``), or None."""
    keys = list(keys)
    for suffix in _EMBEDDINGS:
        found = [key for key in keys if key == suffix or key.endswith(f".{suffix}")]
        if found:
            return min(found, key=len)  # the outermost: `model.embed_tokens` rather than a submodule's
    return None


def _one_tensor(a: TensorRef, b: TensorRef) -> bool:
    return a.storage is b.storage and (a.offset, a.shape, a.stride, a.dtype, a.cast_to, a.conj, a.neg) == (
        b.offset,
        b.shape,
        b.stride,
        b.dtype,
        b.cast_to,
        b.conj,
        b.neg,
    )


def _piece(stream: Iterator[memoryview]) -> memoryview | None:
    for piece in stream:
        if len(piece):
            return piece.cast("B")
    return None


def _equal_streams(left: Iterator[memoryview], right: Iterator[memoryview]) -> bool:
    """True when two byte streams, cut in pieces anyhow, hold the same bytes (each piece used before the next)."""
    a: memoryview | None = memoryview(b"")
    b: memoryview | None = memoryview(b"")
    while True:
        if a is not None and not a:
            a = _piece(left)
        if b is not None and not b:
            b = _piece(right)
        if a is None or b is None:
            return a is None and b is None
        size = min(len(a), len(b))
        if a[:size] != b[:size]:
            return False
        a, b = a[size:], b[size:]


def same_data(a: Any, b: Any) -> str:
    """:data:`SAME_STORAGE` when ``a`` and ``b`` are one tensor, :data:`SAME_BYTES` when they are equal copies, bit
    for bit (NaN payloads and signed zeros included), ``""`` otherwise or when either is no tensor (a name).

    Reads both tensors' bytes only when they are not one tensor but have one shape and dtype.
    """
    if isinstance(a, TensorRef) and isinstance(b, TensorRef):
        if a.shape != b.shape or a.out_dtype != b.out_dtype:
            return ""
        if _one_tensor(a, b):
            return SAME_STORAGE
        return SAME_BYTES if _equal_streams(a.iter_bytes(_CHUNK), b.iter_bytes(_CHUNK)) else ""
    if hasattr(a, "untyped_storage") and hasattr(b, "untyped_storage"):  # torch tensors (fit's callers may pass them)
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            return ""
        if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
            return SAME_STORAGE
        import torch  # they are torch tensors: torch is there

        bits = [t.detach().reshape(-1).contiguous().view(torch.uint8).cpu() for t in (a, b)]
        return SAME_BYTES if torch.equal(bits[0], bits[1]) else ""
    return ""


def shared_keys(state: Mapping[str, Any]) -> dict[str, str]:
    """Each key whose tensor is one tensor with another key's (no byte read): that other key, both ways (a model
    whose ``lm_head`` is its ``tok_emb`` loads either name from a file that kept the other)."""
    groups: dict[Any, list[str]] = {}
    for key, value in state.items():
        if isinstance(value, TensorRef):
            identity: Any = (id(value.storage), value.offset, value.shape, value.stride, value.dtype, value.cast_to)
        elif hasattr(value, "untyped_storage") and hasattr(value, "data_ptr"):
            identity = (value.data_ptr(), tuple(value.shape), value.stride(), str(value.dtype), str(value.device))
            if identity[0] == 0:  # meta or empty tensors all say 0
                continue
        else:
            continue
        groups.setdefault(identity, []).append(key)
    return {
        key: next(other for other in group if other != key)
        for group in groups.values()
        if len(group) > 1
        for key in group
    }
