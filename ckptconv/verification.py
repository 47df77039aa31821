"""Verify: prove an output holds exactly its source's weights after the transforms.

Both sides are read lazily and compared tensor by tensor: keys, dtypes, shapes,
and a hash of the bytes each would write (after any cast), so memory stays
bounded by the read chunk size and a difference in any single bit is found.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional, Union

from .tensor import TensorRef
from .transforms import Pipeline, Transform

__all__ = ["VerifyReport", "compare", "verify"]

PathLike = Union[str, "os.PathLike[str]"]


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

    def summary(self) -> str:
        """One sentence: what matched, or the first differences."""
        if self.ok:
            return f"verified: all {self.checked} tensors match bit for bit"
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} missing (e.g. {self.missing[0]!r})")
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected (e.g. {self.unexpected[0]!r})")
        if self.mismatched:
            key, reason = self.mismatched[0]
            parts.append(f"{len(self.mismatched)} differ (e.g. {key!r}: {reason})")
        return "verification failed: " + "; ".join(parts)


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
    select: Optional[str] = None,
    transforms: Union[Pipeline, Sequence[Transform]] = (),
    trust: bool = False,
) -> VerifyReport:
    """Check that ``output`` is ``source``'s weights after ``transforms``, bit for bit.

    Args:
        source: the original checkpoint.
        output: the converted file.
        select: where the weights are in ``source`` (searched when None).
        transforms: the steps the conversion applied.
        trust: see :func:`ckptconv.open`. Dangerous.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` says whether they match.

    Example:
        >>> ckptconv.verify("dp.pkl", "model.pt", transforms=[ckptconv.StripPrefix("module")]).ok  # doctest: +SKIP
        True
    """
    from .loading import open as open_checkpoint

    pipeline = transforms if isinstance(transforms, Pipeline) else Pipeline.of(transforms)
    expected, _ = pipeline.apply(open_checkpoint(source, trust=trust).select(select).weights)
    actual = open_checkpoint(output).select().weights
    return compare(expected, actual)
