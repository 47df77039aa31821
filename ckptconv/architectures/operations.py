"""The vocabulary of name mappings: a few declarative operations, each one rule of a table, each with its inverse.

A rule names its sources and its targets by patterns (``{L}`` a layer number, ``{E}`` an expert
number), like transformers v5's ``WeightRenaming`` / ``WeightConverter`` (whose ``ConversionOps``
declare a ``reverse_op``) or Megatron-Bridge's ``QKVMapping`` / ``GatedMLPMapping``. Every operation
says its :meth:`~Operation.inverse`, so one table gives both directions (``tuple(op.inverse() for op
in table)``), and ``tests/test_operations.py`` round-trips every table bit for bit:

=====================================  =====================================  ===========================
operation                              its inverse                            transformers 5 calls them
=====================================  =====================================  ===========================
:class:`Rename` a → b                  :class:`Rename` b → a                  ``WeightRenaming``
:class:`Rows` (padding stripped)       :class:`PadRows` (zeros put back)      ``Inkling2UnpadVocab``
:class:`Chunk` (dim 0 into n)          :class:`Concatenate` (n on dim 0)      ``Chunk`` / ``Concatenate``
:class:`SplitQKV` (per query group)    :class:`MergeQKV`                      —
:class:`Unstack` (dim 0 into ``{E}``)  :class:`Stack` (``{E}`` on new dim 0)  ``SplitModulelist`` /
                                                                              ``MergeModulelist``
:class:`Permute` (dims reordered)      :class:`Permute` (argsort of dims)     ``Transpose``
=====================================  =====================================  ===========================

:class:`Stack` of several sources concatenates each expert's pieces along dim 0 before stacking
(transformers' ``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)``: per-expert gate and up into
``experts.gate_up_proj`` ``[E, 2I, H]``), and :class:`Unstack` to several targets cuts them apart again.

A table runs in :func:`ckptconv.architectures.mapping.run_table`: each name goes to the first rule
one of whose source patterns matches it; names matching one rule with the same fields (all but the
gathered ``{E}``) form a group, handed whole to :meth:`Operation.map`; a group lacking one of its
sources is refused, naming the missing tensor.

Views are :class:`TensorRef`\\ s over a :class:`Window` of the source's storage (no byte moves, each
with a storage of its own so writers see no tie); computed results are
:func:`ckptconv.reading.sources.computed_tensor`\\ s, made when a writer reads them, memory
bounded by one weight (a stack: by the stacked tensor). Nothing here reads a tensor.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptconv.errors import TransformError
from ckptconv.reading.sources import Source, computed_tensor
from ckptconv.values.tensor import ReadInto, Storage, TensorRef, contiguous_strides

__all__ = [
    "Chunk",
    "Concatenate",
    "MergeQKV",
    "Operation",
    "PadRows",
    "Permute",
    "Rename",
    "Rows",
    "SplitQKV",
    "Stack",
    "Unstack",
    "Window",
    "compile_pattern",
]

Fields = Mapping[str, str]
Config = Mapping[str, Any]
#: a group's tensors by (index of the source pattern, the gathered field's value or None)
Pieces = Mapping[tuple[int, int | None], TensorRef]


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """``decoder.layers.{L}.x`` as a regex whose groups are the fields (``L``, ``E``)."""
    parts = re.split(r"\{([A-Z])\}", pattern)
    regex = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>\\d+)" for i, p in enumerate(parts))
    return re.compile(f"^{regex}$")


@dataclass(frozen=True)
class Window(Source):
    """Bytes ``[start, start + length)`` of another storage: a view with a storage of its own."""

    storage: Storage
    start: int

    @contextlib.contextmanager
    def opened(self) -> Iterator[ReadInto]:
        with self.storage.reader() as read_into:

            def read_window(start: int, out: memoryview) -> None:
                read_into(self.start + start, out)

            yield read_window

    def paths(self) -> frozenset[str]:
        return self.storage.source.paths()


@dataclass(frozen=True)
class Joined(Source):
    """The bytes of several tensors one after another (``(storage, start, length)`` each): a stack or concatenation
    of contiguous tensors along dim 0 is their bytes in order, read piece by piece, so memory stays bounded by what
    the writer asks for at once, never by the stack."""

    parts: tuple[tuple[Storage, int, int], ...]

    @contextlib.contextmanager
    def opened(self) -> Iterator[ReadInto]:
        with contextlib.ExitStack() as stack:
            current: list[Any] = [None, None, None]  # the part open now: its storage, reader and ExitStack

            def reader(storage: Storage) -> ReadInto:
                if current[0] is not storage:  # one part open at a time: a stack of 256 experts holds one file
                    if current[2] is not None:
                        current[2].close()
                    inner = stack.enter_context(contextlib.ExitStack())
                    current[:] = [storage, inner.enter_context(storage.reader()), inner]
                return current[1]  # type: ignore[no-any-return]

            def read_joined(start: int, out: memoryview) -> None:
                end, at = start + out.nbytes, 0
                for storage, begin, length in self.parts:
                    lo, hi = max(start, at), min(end, at + length)
                    if lo < hi:
                        reader(storage)(begin + lo - at, out[lo - start : hi - start])
                    at += length
                    if at >= end:
                        break

            yield read_joined

    def paths(self) -> frozenset[str]:
        return frozenset().union(*(storage.source.paths() for storage, _, _ in self.parts))


def _viewable(ref: TensorRef) -> bool:
    return ref.is_contiguous and ref.is_stored_as_is and ref.storage.byteorder == "little"


def _joined(
    name: str, refs: list[TensorRef], shape: tuple[int, ...], join: Callable[[Mapping[str, Any]], Any]
) -> TensorRef:
    """``refs`` joined along dim 0 into ``shape``: their bytes in order where each can be viewed, else computed."""
    first = refs[0]
    if all(_viewable(ref) and ref.dtype == first.dtype for ref in refs):
        parts = tuple((ref.storage, ref.byte_span[0], ref.nbytes) for ref in refs)
        storage = Storage(sum(ref.nbytes for ref in refs), Joined(parts), location=first.storage.location, name=name)
        return TensorRef(storage, first.dtype, shape, contiguous_strides(shape))
    return computed_tensor(name, join, {str(i): ref for i, ref in enumerate(refs)}, first.out_dtype, shape)


def _flat(ref: TensorRef, start: int, shape: tuple[int, ...], name: str) -> TensorRef:
    """Elements ``[start, start + prod(shape))`` of ``ref`` in row-major order, as ``shape``: a view when ``ref``
    is contiguous and stored as it is written, else computed."""
    count = math.prod(shape)
    if _viewable(ref):
        size = ref.dtype.itemsize
        window = Window(ref.storage, ref.byte_span[0] + start * size)
        storage = Storage(count * size, window, location=ref.storage.location, name=name)
        return TensorRef(storage, ref.dtype, shape, contiguous_strides(shape))
    return computed_tensor(
        name, lambda a: a["x"].reshape(-1)[start : start + count].reshape(shape), {"x": ref}, ref.out_dtype, shape
    )


def _rows(ref: TensorRef, start: int, count: int, name: str) -> TensorRef:
    """Rows ``[start, start + count)`` of ``ref`` along dim 0."""
    row = math.prod(ref.shape[1:])
    return _flat(ref, start * row, (count, *ref.shape[1:]), name)


def _computed(name: str, ref: TensorRef, shape: tuple[int, ...], fn: Callable[[Any], Any]) -> TensorRef:
    return computed_tensor(name, lambda a: fn(a["x"]), {"x": ref}, ref.out_dtype, shape)


def _all(op: Operation, fields: Fields, pieces: Pieces, index: int | None = None) -> list[TensorRef]:
    """The group's tensor for every source of ``op`` (at ``index`` of the gathered field), or a one-line refusal
    naming the first that is missing."""
    found = []
    for i, pattern in enumerate(op.sources):
        ref = pieces.get((i, index))
        if ref is None:
            named = dict(fields, **({op.gathers: str(index)} if op.gathers and index is not None else {}))
            partner = next(op.sources[j].format(**named) for j, at in pieces if at == index)
            raise TransformError(
                f"{pattern.format(**named)} is missing: the source holds {partner} but not it, and "
                f"{op.targets[0].format(**named)} needs both; a source that lacks a tensor cannot make the model"
            )
        found.append(ref)
    return found


class Operation:
    """One rule: ``sources`` patterns in, ``targets`` patterns out, and the rule that undoes it."""

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    #: the source field whose matches are gathered into one group (Stack's ``E``), or None
    gathers: str | None = None

    def map(self, fields: Fields, pieces: Pieces, config: Config) -> Iterator[tuple[str, TensorRef]]:
        raise NotImplementedError

    def inverse(self) -> Operation:
        raise NotImplementedError

    def describe(self) -> str:
        return f"{type(self).__name__}: {', '.join(self.sources)} -> {', '.join(self.targets)}"


@dataclass(frozen=True)
class _OneToOne(Operation):
    source: str
    target: str

    @property
    def sources(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.source,)

    @property
    def targets(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.target,)


@dataclass(frozen=True)
class _OneToMany(Operation):
    source: str
    targets: tuple[str, ...]

    @property
    def sources(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.source,)


@dataclass(frozen=True)
class _ManyToOne(Operation):
    sources: tuple[str, ...]
    target: str

    @property
    def targets(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.target,)


@dataclass(frozen=True)
class Rename(_OneToOne):
    """One tensor, a new name."""

    def map(self, fields: Fields, pieces: Pieces, config: Config) -> Iterator[tuple[str, TensorRef]]:
        (ref,) = _all(self, fields, pieces)
        yield self.target.format(**fields), ref

    def inverse(self) -> Operation:
        return Rename(self.target, self.source)


@dataclass(frozen=True)
class Rows(_OneToOne):
    """The first ``config[size]`` rows: the vocabulary without Megatron's padding."""

    size: str = "vocab_size"
    padded: str = "padded_vocab_size"

    def map(self, fields: Fields, pieces: Pieces, config: Config) -> Iterator[tuple[str, TensorRef]]:
        (ref,) = _all(self, fields, pieces)
        count = int(config[self.size])
        name = self.target.format(**fields)
        if not ref.shape or ref.shape[0] < count:
            raise TransformError(
                f"{self.source.format(**fields)} has {ref.shape[0] if ref.shape else 0} rows, fewer than the "
                f"config's {self.size}={count}; it is not this model's"
            )
        yield name, ref if ref.shape[0] == count else _rows(ref, 0, count, name)

    def inverse(self) -> Operation:
        return PadRows(self.target, self.source, self.size, self.padded)


@dataclass(frozen=True)
class PadRows(_OneToOne):
    """Zero rows appended up to ``config[padded]`` (none when the config has no such field): the inverse of
    :class:`Rows` on the rows that are kept; Megatron's padding rows are never read (the logits past
    ``vocab_size`` are cut off), so zeros stand for them."""

    size: str = "vocab_size"
    padded: str = "padded_vocab_size"

    def map(self, fields: Fields, pieces: Pieces, config: Config) -> Iterator[tuple[str, TensorRef]]:
        (ref,) = _all(self, fields, pieces)
        name = self.target.format(**fields)
        if not ref.shape or ref.shape[0] != int(config[self.size]):
            raise TransformError(
                f"{self.source.format(**fields)} has shape {list(ref.shape)}, not the config's "
                f"{self.size}={config[self.size]} rows"
            )
        count = int(config.get(self.padded) or ref.shape[0])
        if count < ref.shape[0]:
            raise TransformError(f"the config's {self.padded}={count} is below its {self.size}={ref.shape[0]}")
        shape = (count, *ref.shape[1:])

        def pad(x: Any) -> Any:
            return np.concatenate([x, np.zeros((count - x.shape[0], *x.shape[1:]), dtype=x.dtype)])

        yield name, ref if count == ref.shape[0] else _computed(name, ref, shape, pad)

    def inverse(self) -> Operation:
        return Rows(self.target, self.source, self.size, self.padded)


@dataclass(frozen=True)
class Permute(_OneToOne):
    """The dimensions reordered (``dims`` as ``numpy.transpose`` takes them): ``Permute(dims=(1, 0))`` transposes."""

    dims: tuple[int, ...] = (1, 0)

    def map(self, fields: Fields, pieces: Pieces, config: Config) -> Iterator[tuple[str, TensorRef]]:
        (ref,) = _all(self, fields, pieces)
        if len(ref.shape) != len(self.dims):
            raise TransformError(f"{self.source.format(**fields)} has {len(ref.shape)} dims, not {len(self.dims)}")
        name = self.target.format(**fields)
        shape = tuple(ref.shape[d] for d in self.dims)
        yield name, _computed(name, ref, shape, lambda x: np.ascontiguousarray(np.transpose(x, self.dims)))

    def inverse(self) -> Operation:
        return Permute(self.target, self.source, tuple(int(d) for d in np.argsort(self.dims)))


@dataclass(frozen=True)
class Chunk(_OneToMany):
    """Equal contiguous blocks along dim 0, in order (``linear_fc1``: gate first, then up)."""

    def map(self, fields: Fields, pieces: Pieces, config: Config) -> Iterator[tuple[str, TensorRef]]:
        (ref,) = _all(self, fields, pieces)
        parts = len(self.targets)
        if not ref.shape or ref.shape[0] % parts:
            raise TransformError(f"{self.source.format(**fields)} of shape {list(ref.shape)} splits into {parts}")
        rows = ref.shape[0] // parts
        for i, target in enumerate(self.targets):
            name = target.format(**fields)
            yield name, _rows(ref, i * rows, rows, name)

    def inverse(self) -> Operation:
        return Concatenate(self.targets, self.source)


def _same(name: str, refs: list[TensorRef], rest: tuple[int, ...] | None = None) -> None:
    """Pieces joined into one tensor share a dtype and their dims after the first (``rest``: those dims)."""
    first = refs[0]
    want = first.shape[1:] if rest is None else rest
    if any(not r.shape or r.shape[1:] != want or r.out_dtype != first.out_dtype for r in refs):
        shown = ", ".join(f"{list(r.shape)} {r.out_dtype.name}" for r in refs[:4])
        raise TransformError(f"{name}: its pieces ({shown}) do not join: they differ in dtype or shape")


@dataclass(frozen=True)
class Concatenate(_ManyToOne):
    """Several tensors joined along dim 0, in order: the inverse of :class:`Chunk` (equal blocks)."""

    def map(self, fields: Fields, pieces: Pieces, config: Config) -> Iterator[tuple[str, TensorRef]]:
        refs = _all(self, fields, pieces)
        name = self.target.format(**fields)
        _same(name, refs)
        if len({r.shape[0] for r in refs}) != 1:
            raise TransformError(f"{name}: its pieces {[list(r.shape) for r in refs]} are not equal blocks")
        shape = (sum(r.shape[0] for r in refs), *refs[0].shape[1:])
        yield name, _joined(name, refs, shape, lambda a: np.concatenate([a[str(i)] for i in range(len(refs))]))

    def inverse(self) -> Operation:
        return Chunk(self.target, self.sources)


def _qkv_sizes(config: Config) -> tuple[int, int, int]:
    heads = int(config["num_attention_heads"])
    groups = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    if heads % groups:
        raise TransformError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}")
    return heads, groups, head_dim


@dataclass(frozen=True)
class SplitQKV(_OneToMany):
    """Megatron's ``linear_qkv``: per query group, ``heads/groups`` query heads, then one key, one value."""

    def map(self, fields: Fields, pieces: Pieces, config: Config) -> Iterator[tuple[str, TensorRef]]:
        (ref,) = _all(self, fields, pieces)
        heads, groups, head_dim = _qkv_sizes(config)
        per_group = heads // groups
        rows = (heads + 2 * groups) * head_dim
        if not ref.shape or ref.shape[0] != rows:
            raise TransformError(
                f"{self.source.format(**fields)} has shape {list(ref.shape)}; the config's {heads} heads in "
                f"{groups} query groups of head_dim {head_dim} make {rows} rows"
            )
        rest = ref.shape[1:]
        blocks = ((0, per_group), (per_group, per_group + 1), (per_group + 1, per_group + 2))
        for target, (lo, hi) in zip(self.targets, blocks):
            shape = (groups * (hi - lo) * head_dim, *rest)

            def pick(x: Any, lo: int = lo, hi: int = hi, shape: tuple[int, ...] = shape) -> Any:
                grouped = x.reshape(groups, per_group + 2, head_dim, *rest)
                return np.ascontiguousarray(grouped[:, lo:hi]).reshape(shape)

            yield target.format(**fields), _computed(target.format(**fields), ref, shape, pick)

    def inverse(self) -> Operation:
        return MergeQKV(self.targets, self.source)


@dataclass(frozen=True)
class MergeQKV(_ManyToOne):
    """q, k, v into Megatron's ``linear_qkv``, interleaved per query group: the inverse of :class:`SplitQKV`."""

    def map(self, fields: Fields, pieces: Pieces, config: Config) -> Iterator[tuple[str, TensorRef]]:
        q, k, v = refs = _all(self, fields, pieces)
        heads, groups, head_dim = _qkv_sizes(config)
        per_group = heads // groups
        name = self.target.format(**fields)
        _same(name, refs)
        if (q.shape[0], k.shape[0], v.shape[0]) != (heads * head_dim, groups * head_dim, groups * head_dim):
            raise TransformError(
                f"{name}: q, k, v have {q.shape[0]}, {k.shape[0]}, {v.shape[0]} rows; the config's {heads} heads in "
                f"{groups} query groups of head_dim {head_dim} make {heads * head_dim}, {groups * head_dim} each"
            )
        rest = q.shape[1:]

        def merge(a: Mapping[str, Any]) -> Any:
            parts = [a["q"].reshape(groups, per_group, head_dim, *rest)]
            parts += [a[p].reshape(groups, 1, head_dim, *rest) for p in "kv"]
            return np.concatenate(parts, axis=1).reshape(-1, *rest)

        shape = ((heads + 2 * groups) * head_dim, *rest)
        yield name, computed_tensor(name, merge, {"q": q, "k": k, "v": v}, q.out_dtype, shape)

    def inverse(self) -> Operation:
        return SplitQKV(self.target, self.sources)


@dataclass(frozen=True)
class Unstack(_OneToMany):
    """A tensor stacked along dim 0 into one per index, the index filling ``{E}`` of every target; with several
    targets each index's slice is cut into equal blocks along its dim 0 (fused ``gate_up_proj`` into gate, up)."""

    def map(self, fields: Fields, pieces: Pieces, config: Config) -> Iterator[tuple[str, TensorRef]]:
        (ref,) = _all(self, fields, pieces)
        parts = len(self.targets)
        if len(ref.shape) < 1 + (parts > 1) or (parts > 1 and ref.shape[1] % parts):
            raise TransformError(
                f"{self.source.format(**fields)} of shape {list(ref.shape)} is not a stack of {parts} equal parts"
            )
        one = ref.shape[1:]
        shape = one if parts == 1 else (one[0] // parts, *one[1:])
        for index in range(ref.shape[0]):
            for part, target in enumerate(self.targets):
                name = target.format(**fields, E=index)
                yield name, _flat(ref, (index * parts + part) * math.prod(shape), shape, name)

    def inverse(self) -> Operation:
        return Stack(self.targets, self.source)


@dataclass(frozen=True)
class Stack(_ManyToOne):
    """One tensor per ``{E}`` (0 … N-1, all present, one shape) stacked along a new dim 0; with several sources,
    each index's tensors are first joined along dim 0 (per-expert gate, up into a fused ``gate_up_proj``)."""

    gathers: str | None = "E"

    def map(self, fields: Fields, pieces: Pieces, config: Config) -> Iterator[tuple[str, TensorRef]]:
        name = self.target.format(**fields)
        numbers = sorted({index for _, index in pieces if index is not None})
        what = "layer" if self.gathers == "L" else "expert"
        if numbers != list(range(len(numbers))):
            missing = sorted(set(range(max(numbers) + 1)) - set(numbers))
            raise TransformError(
                f"{name}: the {what}s numbered {numbers[:8]}{' …' if len(numbers) > 8 else ''} are not 0 to "
                f"{len(numbers) - 1}; {what} {missing[0]} is missing "
                f"({self.sources[0].format(**fields, **{self.gathers or 'E': missing[0]})})"
            )
        refs = [ref for index in numbers for ref in _all(self, fields, pieces, index)]
        _same(name, refs, refs[0].shape[1:])
        if any(r.shape != refs[0].shape for r in refs):
            raise TransformError(f"{name}: its pieces {[list(r.shape) for r in refs[:4]]} differ in shape")
        parts, count = len(self.sources), len(numbers)
        one = refs[0].shape
        shape = (count, *one) if parts == 1 else (count, parts * one[0], *one[1:])

        def stack(arrays: Mapping[str, Any]) -> Any:
            joined = [arrays[str(i)] for i in range(count * parts)]
            return np.stack(joined).reshape(shape)

        yield name, _joined(name, refs, shape, stack)

    def inverse(self) -> Operation:
        return Unstack(self.target, self.sources)
