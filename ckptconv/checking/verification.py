"""Verify: prove an output holds exactly its source's weights after the transforms.

Both sides are read lazily and compared tensor by tensor: keys, dtypes, shapes,
and a hash of the bytes each would write (after any cast), so memory stays
bounded by the read chunk size and a difference in any single bit is found.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptconv._paths import PathLike
from ckptconv.errors import TransformError
from ckptconv.options import REFERENCES
from ckptconv.reading.integrity import check_record_crcs
from ckptconv.reading.streaming import keeping_workers
from ckptconv.transforms.keys import AddPrefix, Canonicalize, Pipeline, StripPrefix, Transform
from ckptconv.values.tensor import TensorRef

if TYPE_CHECKING:
    from ckptconv.loading import Checkpoint
    from ckptconv.selection.weights import Selection
    from ckptconv.transforms.casts import Array

__all__ = ["DiffReport", "TensorDifference", "VerifyReport", "compare", "diff", "verify"]


@dataclass(frozen=True)
class VerifyReport:
    """The result of comparing an output with its source.

    Attributes:
        ok: True when every key, dtype, shape and byte matches.
        checked: tensors compared.
        missing: keys the output lacks.
        unexpected: keys the output has but should not.
        mismatched: ``(key, reason)`` for tensors that differ.
    """

    ok: bool
    checked: int
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[tuple[str, str], ...] = ()
    readers: tuple[str, str] = ("", "")

    def summary(self) -> str:
        """One sentence: what matched, or the first differences (and who read each side, when asked)."""
        read = f" (source read by {self.readers[0]}; output by {self.readers[1]})" if any(self.readers) else ""
        if self.ok:
            return f"verified: all {self.checked} tensors match bit for bit{read}"
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} missing (e.g. {self.missing[0]!r})")
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected (e.g. {self.unexpected[0]!r})")
        if self.mismatched:
            key, reason = self.mismatched[0]
            parts.append(f"{len(self.mismatched)} differ (e.g. {key!r}: {reason})")
        return "verification failed: " + "; ".join(parts) + read


def _digest(ref: TensorRef) -> bytes:
    digest = hashlib.blake2b(digest_size=32)
    for chunk in ref.iter_bytes():
        digest.update(chunk)
    return digest.digest()


def compare(expected: Mapping[str, TensorRef], actual: Mapping[str, TensorRef]) -> VerifyReport:
    """Compare two state dicts of lazy tensors, by value, bit for bit."""
    missing = tuple(key for key in expected if key not in actual)
    unexpected = tuple(key for key in actual if key not in expected)
    mismatched: list[tuple[str, str]] = []
    checked = 0
    with keeping_workers():  # the expected side casts, if the conversion did
        for key, want in expected.items():
            got = actual.get(key)
            if got is None:
                continue
            checked += 1
            if want.out_dtype != got.out_dtype:
                mismatched.append((key, f"dtype {got.out_dtype.name}, expected {want.out_dtype.name}"))
            elif want.shape != got.shape:
                mismatched.append((key, f"shape {list(got.shape)}, expected {list(want.shape)}"))
            elif _digest(want) != _digest(got):
                mismatched.append((key, "values differ"))
    ok = not (missing or unexpected or mismatched)
    return VerifyReport(ok, checked, missing, unexpected, tuple(mismatched))


def verify(
    source: PathLike,
    output: PathLike,
    *,
    select: str | None = None,
    transforms: Pipeline | Sequence[Transform] = (),
    trust: bool = False,
    reference: str = "ckptconv",
) -> VerifyReport:
    """Check that ``output`` is ``source``'s weights after ``transforms``, bit for bit.

    Args:
        source: the original checkpoint.
        output: the converted file.
        select: where the weights are in ``source`` (searched when None).
        transforms: the steps the conversion applied.
        trust: see :func:`ckptconv.open`. Dangerous.
        reference: who reads the tensors. ``"ckptconv"`` uses ckptconv's readers
            (fast, memory bounded by a chunk). ``"torch"`` reads both sides with
            ``torch.load(weights_only=True)`` or the safetensors library wherever
            they can read the file, so a bug in ckptconv's readers cannot hide
            behind itself; :attr:`VerifyReport.readers` says who read what.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` says whether they match.

    Raises:
        ValueError: ``reference`` is not one of :data:`REFERENCES`.

    Example:
        >>> ckptconv.verify("dp.pkl", "model.pt", transforms=[ckptconv.StripPrefix("module")]).ok  # doctest: +SKIP
        True
        >>> ckptconv.verify("cn.pt", "cn.safetensors", reference="torch").readers  # doctest: +SKIP
        ('torch.load(weights_only=True)', 'the safetensors library')
    """
    from ckptconv.loading import open as open_checkpoint

    pipeline = transforms if isinstance(transforms, Pipeline) else Pipeline.of(transforms)
    source_checkpoint = open_checkpoint(source, trust=trust)
    selection = source_checkpoint.select(select)
    if reference == "torch":
        return compare_with_reference(
            source_checkpoint, selection, open_checkpoint(output), transform=lambda weights: pipeline.apply(weights)[0]
        )
    if reference != "ckptconv":
        raise ValueError(f"reference must be one of {', '.join(REFERENCES)}, not {reference!r}")
    check_record_crcs(selection.weights.items())
    expected, _ = pipeline.apply(selection.weights)
    actual = open_checkpoint(output).select().weights
    return compare(expected, actual)


def compare_with_reference(
    source: Checkpoint,
    selection: Selection,
    output: Checkpoint,
    *,
    transform: Callable[[dict[str, TensorRef]], Mapping[str, TensorRef]],
) -> VerifyReport:
    """Compare ``output`` with ``transform`` of its source's weights, both sides read by torch
    or the safetensors library where they can (see :mod:`ckptconv.checking.reference`)."""
    from ckptconv.checking.reference import CKPTCONV_READER, reference_weights

    source_read = reference_weights(source, selection)
    if source_read.reader.startswith(CKPTCONV_READER):
        check_record_crcs(source_read.weights.items())
    expected = transform(source_read.weights)
    output_read = reference_weights(output, output.select())
    report = compare(expected, output_read.weights)
    return dataclasses.replace(report, readers=(source_read.reader, output_read.reader))


@dataclass(frozen=True)
class TensorDifference:
    """How one tensor differs between two checkpoints.

    Attributes:
        key: the tensor's name.
        reason: ``"dtype"``, ``"shape"`` or ``"values"``.
        a: dtype or shape in the first checkpoint (``""`` for values).
        b: dtype or shape in the second.
        max_abs_diff: the largest absolute difference of the values (``nan`` when
            NaNs do not line up), for ``"values"``, and for ``"dtype"`` when the
            shapes agree: both sides are then compared in float64 (complex128),
            which holds every value of either dtype, so an fp32 tensor and its
            bf16 cast report the rounding error the cast made. Between two
            integer tensors it is an exact ``int`` (int64 2**60 against 2**60 + 1
            is 1, the extremes of uint64 and int64 included). ``nan`` where they
            were not compared (``compared`` is False).
        compared: False where the values were not compared: a side's elements
            are not numbers (packed or opaque bits such as float4_e2m1fn_x2 and
            bits16, or quantized integers, which mean nothing without their
            scale), or, for ``"dtype"``, the shapes differ too.
    """

    key: str
    reason: str
    a: str = ""
    b: str = ""
    max_abs_diff: float | int = 0.0
    compared: bool = True


@dataclass(frozen=True)
class DiffReport:
    """What differs between two checkpoints' weights.

    Attributes:
        identical: True when both hold the same keys with bit-identical tensors.
        only_in_a: keys only the first has.
        only_in_b: keys only the second has.
        differences: tensors present in both that differ.
        same: how many tensors are bit-identical.
    """

    identical: bool
    only_in_a: tuple[str, ...]
    only_in_b: tuple[str, ...]
    differences: tuple[TensorDifference, ...]
    same: int

    def to_dict(self) -> dict[str, object]:
        """A JSON-serialisable dict (what ``ckptconv diff --json`` prints)."""
        return {
            "identical": self.identical,
            "same": self.same,
            "only_in_a": list(self.only_in_a),
            "only_in_b": list(self.only_in_b),
            "differences": [vars(d) | {"max_abs_diff": _json_float(d.max_abs_diff)} for d in self.differences],
        }


def _json_float(value: float) -> object:
    return value if math.isfinite(value) else repr(value)


_DIFF_ELEMENTS = 4 << 20
# Kinds whose stored elements are not the numbers they stand for (packed float4, opaque bits; quantized
# integers without their scale): diff does not compare them as numbers.
_NOT_NUMBERS = ("bits", "quantized")


def _as_float64(ref: TensorRef, values: Array) -> Array:
    import numpy as np

    from ckptconv.transforms.casts import cast_array

    if ref.out_dtype.kind == "float":
        return cast_array(values, ref.out_dtype.name, "float64")
    if ref.out_dtype.kind == "complex":
        return np.asarray(values).astype(np.complex128)
    return np.asarray(values).astype(np.float64)


def _max_abs_difference(a: TensorRef, b: TensorRef) -> float | int:
    """The largest |a - b|; nan if NaNs differ; an exact ``int`` when both sides hold integers.

    Both tensors are read whole (each bounded by its own size); their float64
    copies are made ``_DIFF_ELEMENTS`` at a time, so the extra memory is a few windows.
    """
    import numpy as np

    a_values = a.numpy().reshape(-1)
    b_values = b.numpy().reshape(-1)
    if a.out_dtype.kind in _INTEGERS and b.out_dtype.kind in _INTEGERS:
        return _max_abs_integer_difference(a_values, b_values)
    largest = 0.0
    for start in range(0, a_values.size, _DIFF_ELEMENTS):
        x = _as_float64(a, a_values[start : start + _DIFF_ELEMENTS])
        y = _as_float64(b, b_values[start : start + _DIFF_ELEMENTS])
        with np.errstate(invalid="ignore", over="ignore"):
            nan_x, nan_y = np.isnan(x), np.isnan(y)
            if not np.array_equal(nan_x, nan_y):
                return float("nan")
            both = ~nan_x
            delta = np.abs(x[both] - y[both])
            same_inf = np.isinf(x[both]) & (x[both] == y[both])
            delta[same_inf] = 0.0
        if delta.size:
            largest = max(largest, float(np.max(delta)))
    return largest


_INTEGERS = ("int", "uint", "bool")
# float64 rounds a 64-bit integer by at most 2**11, and the difference of two by at most 2**12 more:
# every element within this much of the largest rounded difference may be the largest exact one.
_ROUNDING_MARGIN = float(1 << 14)


def _max_abs_integer_difference(a_values: Array, b_values: Array) -> int:
    """The largest |a - b| of two integer arrays, exactly (float64 would round 2**60 + 1 to 2**60).

    Integers of up to 32 bits subtract exactly in int64. For 64-bit ones the float64 differences
    find the few elements that can be the largest, and those are subtracted as Python integers.
    """
    import numpy as np

    largest = 0
    for start in range(0, a_values.size, _DIFF_ELEMENTS):
        x = np.asarray(a_values[start : start + _DIFF_ELEMENTS])
        y = np.asarray(b_values[start : start + _DIFF_ELEMENTS])
        if x.size == 0:
            continue
        if x.dtype.itemsize < 8 and y.dtype.itemsize < 8:
            largest = max(largest, int(np.max(np.abs(x.astype(np.int64) - y.astype(np.int64)))))
            continue
        rounded = np.abs(x.astype(np.float64) - y.astype(np.float64))
        candidates = np.flatnonzero(rounded >= float(np.max(rounded)) - _ROUNDING_MARGIN)
        exact = np.abs(x[candidates].astype(object) - y[candidates].astype(object))
        largest = max(largest, int(np.max(exact)))
    return largest


def diff(
    a: PathLike,
    b: PathLike,
    *,
    select_a: str | None = None,
    select_b: str | None = None,
    trust: bool = False,
    transforms: Pipeline | Sequence[Transform] = (),
) -> DiffReport:
    """Compare the weights of two checkpoints: keys on one side only, dtype/shape mismatches, value differences.

    Args:
        a, b: any checkpoints :func:`ckptconv.open` reads.
        select_a, select_b: where the weights are in each (searched when None).
        trust: see :func:`ckptconv.open`. Dangerous.
        transforms: steps applied to ``a``'s weights first (``ckptconv diff --strip-prefix module``).

    Returns:
        A :class:`DiffReport`.

    Example:
        >>> ckptconv.diff("epoch10.pt", "epoch11.pt").differences[0].max_abs_diff  # doctest: +SKIP
        0.0123
    """
    from ckptconv.loading import open as open_checkpoint

    pipeline = transforms if isinstance(transforms, Pipeline) else Pipeline.of(transforms)
    first, _ = pipeline.apply(open_checkpoint(a, trust=trust).select(select_a).weights)
    second = open_checkpoint(b, trust=trust).select(select_b).weights
    differences = []
    same = 0
    for key, left in first.items():
        right = second.get(key)
        if right is None:
            continue
        numbers = left.out_dtype.kind not in _NOT_NUMBERS and right.out_dtype.kind not in _NOT_NUMBERS
        if left.out_dtype != right.out_dtype:
            compared = numbers and left.shape == right.shape
            largest = _max_abs_difference(left, right) if compared else math.nan
            differences.append(
                TensorDifference(key, "dtype", left.out_dtype.name, right.out_dtype.name, largest, compared=compared)
            )
        elif left.shape != right.shape:
            differences.append(TensorDifference(key, "shape", str(list(left.shape)), str(list(right.shape))))
        elif _digest(left) == _digest(right):
            same += 1
        elif numbers:
            differences.append(TensorDifference(key, "values", max_abs_diff=_max_abs_difference(left, right)))
        else:
            differences.append(TensorDifference(key, "values", max_abs_diff=math.nan, compared=False))
    only_a = tuple(key for key in first if key not in second)
    only_b = tuple(key for key in second if key not in first)
    identical = not (only_a or only_b or differences)
    return DiffReport(identical, only_a, only_b, tuple(differences), same)


# The prefixes a wrapper puts in front of every key (DataParallel/DDP, torch.compile, Lightning), and a
# training framework's own (`model.`): tried when two sides' keys differ only by one of them.
_PREFIXES = ("module", "_orig_mod", "_forward_module", "model")


def prefix_difference(only_in_a: Sequence[str], only_in_b: Sequence[str]) -> tuple[str, str, Transform] | None:
    """When removing or adding one wrapper prefix (or every wrapper, ``--canonical``) turns the keys only
    ``a`` has into exactly the keys only ``b`` has: what differs (``"the 'module.' prefix"``), the flag that
    makes them the same (``"--strip-prefix module"``) and its step. None otherwise."""
    if not only_in_a or len(only_in_a) != len(only_in_b):
        return None
    candidates: list[tuple[str, str, Transform]] = [
        *((f"the '{p}.' prefix", f"--strip-prefix {p}", StripPrefix(p)) for p in _PREFIXES),
        *((f"the '{p}.' prefix", f"--add-prefix {p}", AddPrefix(p)) for p in _PREFIXES),
        ("wrapper prefixes", "--canonical", Canonicalize()),
    ]
    wanted = set(only_in_b)
    for candidate in candidates:
        try:
            renamed, _ = candidate[2].apply({key: key for key in only_in_a})  # type: ignore[misc]
        except TransformError:
            continue
        if set(renamed) == wanted:
            return candidate
    return None
