"""The vocabulary of name mappings: a few declarative operations, each one rule of a family's table.

A rule names its source by a pattern (``{L}`` a layer number, ``{E}`` an expert number) and its
targets by patterns over the same fields, like transformers v5's ``WeightRenaming`` /
``WeightConverter`` or Megatron-Bridge's ``QKVMapping`` / ``GatedMLPMapping``:

- :class:`Rename` — one tensor, a new name;
- :class:`Rows` — the first ``config[size]`` rows (vocabulary padding stripped), a view;
- :class:`Chunk` — equal contiguous blocks along dim 0 (``linear_fc1`` into gate, up), views;
- :class:`SplitQKV` — Megatron's fused QKV, whose rows interleave per query group
  ``[q x heads/groups, k, v]``, into q, k, v (computed: k and v are strided);
- :class:`Unstack` — a tensor stacked along dim 0 (experts) into one per index, views;
- :class:`Stack` — one tensor per index (``{E}``) stacked along a new dim 0, computed.

Views are :class:`TensorRef`\\ s over a :class:`Window` of the source's storage (no byte moves, each
with a storage of its own so writers see no tie); computed results are
:func:`ckptconv.reading.sources.computed_tensor`\\ s, made when a writer reads them, memory
bounded by one weight. Nothing here reads a tensor.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptconv.errors import TransformError
from ckptconv.reading.sources import Source, computed_tensor
from ckptconv.values.tensor import ReadInto, Storage, TensorRef, contiguous_strides

__all__ = ["Chunk", "Operation", "Rename", "Rows", "SplitQKV", "Stack", "Unstack", "Window", "compile_pattern"]

Fields = Mapping[str, str]
Config = Mapping[str, Any]


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


def _viewable(ref: TensorRef) -> bool:
    return ref.is_contiguous and ref.is_stored_as_is


def _rows(ref: TensorRef, start: int, count: int, name: str) -> TensorRef:
    """Rows ``[start, start + count)`` of ``ref`` along dim 0: a view when ``ref`` is contiguous."""
    shape = (count, *ref.shape[1:])
    if _viewable(ref):
        row = math.prod(ref.shape[1:]) * ref.dtype.itemsize
        window = Window(ref.storage, ref.byte_span[0] + start * row)
        storage = Storage(count * row, window, location=ref.storage.location, name=name)
        return TensorRef(storage, ref.dtype, shape, contiguous_strides(shape))
    return computed_tensor(name, lambda a: a["x"][start : start + count], {"x": ref}, ref.out_dtype, shape)


def _computed(name: str, ref: TensorRef, shape: tuple[int, ...], fn: Callable[[Any], Any]) -> TensorRef:
    return computed_tensor(name, lambda a: fn(a["x"]), {"x": ref}, ref.out_dtype, shape)


class Operation:
    """One rule: ``source`` pattern in, ``targets`` patterns out. ``grouped_by`` fields gather several inputs."""

    source: str
    targets: tuple[str, ...]
    #: the source field whose matches are gathered into one call (Stack's ``E``), or None
    gathers: str | None = None

    def map(self, matches: Sequence[tuple[Fields, TensorRef]], config: Config) -> Iterator[tuple[str, TensorRef]]:
        raise NotImplementedError

    def describe(self) -> str:
        return f"{type(self).__name__}: {self.source} -> {', '.join(self.targets)}"


@dataclass(frozen=True)
class Rename(Operation):
    source: str
    target: str

    @property
    def targets(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.target,)

    def map(self, matches: Sequence[tuple[Fields, TensorRef]], config: Config) -> Iterator[tuple[str, TensorRef]]:
        for fields, ref in matches:
            yield self.target.format(**fields), ref


@dataclass(frozen=True)
class Rows(Operation):
    """The first ``config[size]`` rows: the vocabulary without Megatron's padding."""

    source: str
    target: str
    size: str = "vocab_size"

    @property
    def targets(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.target,)

    def map(self, matches: Sequence[tuple[Fields, TensorRef]], config: Config) -> Iterator[tuple[str, TensorRef]]:
        count = int(config[self.size])
        for fields, ref in matches:
            name = self.target.format(**fields)
            if not ref.shape or ref.shape[0] < count:
                raise TransformError(
                    f"{self.source.format(**fields)} has {ref.shape[0] if ref.shape else 0} rows, fewer than the "
                    f"config's {self.size}={count}; it is not this model's"
                )
            yield name, ref if ref.shape[0] == count else _rows(ref, 0, count, name)


@dataclass(frozen=True)
class Chunk(Operation):
    """Equal contiguous blocks along dim 0, in order (``linear_fc1``: gate first, then up)."""

    source: str
    targets: tuple[str, ...]

    def map(self, matches: Sequence[tuple[Fields, TensorRef]], config: Config) -> Iterator[tuple[str, TensorRef]]:
        parts = len(self.targets)
        for fields, ref in matches:
            if not ref.shape or ref.shape[0] % parts:
                raise TransformError(f"{self.source.format(**fields)} of shape {list(ref.shape)} splits into {parts}")
            rows = ref.shape[0] // parts
            for i, target in enumerate(self.targets):
                name = target.format(**fields)
                yield name, _rows(ref, i * rows, rows, name)


@dataclass(frozen=True)
class SplitQKV(Operation):
    """Megatron's ``linear_qkv``: per query group, ``heads/groups`` query heads, then one key, one value."""

    source: str
    targets: tuple[str, ...]  # q, k, v

    def map(self, matches: Sequence[tuple[Fields, TensorRef]], config: Config) -> Iterator[tuple[str, TensorRef]]:
        heads = int(config["num_attention_heads"])
        groups = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        if heads % groups:
            raise TransformError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}")
        per_group = heads // groups
        for fields, ref in matches:
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

                def pick(
                    x: Any, lo: int = lo, hi: int = hi, shape: tuple[int, ...] = shape, rest: tuple[int, ...] = rest
                ) -> Any:
                    grouped = x.reshape(groups, per_group + 2, head_dim, *rest)
                    return np.ascontiguousarray(grouped[:, lo:hi]).reshape(shape)

                yield target.format(**fields), _computed(target.format(**fields), ref, shape, pick)


@dataclass(frozen=True)
class Unstack(Operation):
    """A tensor stacked along dim 0 into one per index, the index filling ``{E}`` of every target."""

    source: str
    target: str

    @property
    def targets(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.target,)

    def map(self, matches: Sequence[tuple[Fields, TensorRef]], config: Config) -> Iterator[tuple[str, TensorRef]]:
        for fields, ref in matches:
            if not ref.shape:
                raise TransformError(f"{self.source.format(**fields)} is a scalar, not a stack")
            for index in range(ref.shape[0]):
                name = self.target.format(**fields, E=index)
                one = _rows(ref, index, 1, name)
                yield name, TensorRef(one.storage, one.dtype, ref.shape[1:], contiguous_strides(ref.shape[1:]))


@dataclass(frozen=True)
class Stack(Operation):
    """One tensor per ``{E}`` (0 … N-1, all present, one shape) stacked along a new dim 0."""

    source: str
    target: str
    gathers: str | None = "E"

    @property
    def targets(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.target,)

    def map(self, matches: Sequence[tuple[Fields, TensorRef]], config: Config) -> Iterator[tuple[str, TensorRef]]:
        groups: dict[tuple[tuple[str, str], ...], dict[int, TensorRef]] = {}
        for fields, ref in matches:
            key = tuple(sorted((k, v) for k, v in fields.items() if k != "E"))
            groups.setdefault(key, {})[int(fields["E"])] = ref
        for key, by_index in groups.items():
            fields = dict(key)
            name = self.target.format(**fields)
            count = len(by_index)
            first = by_index.get(0)
            if sorted(by_index) != list(range(count)) or first is None:
                raise TransformError(f"{name}: the experts numbered {sorted(by_index)} are not 0 to {count - 1}")
            if any(ref.shape != first.shape or ref.out_dtype != first.out_dtype for ref in by_index.values()):
                raise TransformError(f"{name}: its {count} experts differ in shape or dtype")
            inputs = {str(i): by_index[i] for i in range(count)}

            def stack(arrays: Mapping[str, Any], n: int = count) -> Any:
                return np.stack([arrays[str(i)] for i in range(n)])

            yield name, computed_tensor(name, stack, inputs, first.out_dtype, (count, *first.shape))
