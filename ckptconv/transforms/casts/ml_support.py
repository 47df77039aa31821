"""ml_dtypes, where it helps: its bfloat16 cast, found without importing it where that is slow.

Whether its casts are used is measured once per process by the dispatch
(:func:`ckptconv.transforms.casts._ml_faster`).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
from functools import cache
from typing import Any, Callable

import numpy as np

#: ml_dtypes releases before this one import in milliseconds and cast faster than the numpy
#: passes, so ckptconv imports them where installed; from it on (0.7.0: 0.55 s to import with
#: numpy before 2.5, its ufunc loops registered one by one, each a linear search, and casts slower
#: than the numpy passes), only where a program has loaded ml_dtypes already.
_ML_DTYPES_IMPORTED_BELOW = (0, 7)


def _installed_ml_dtypes_version() -> tuple[int, ...] | None:
    """The installed ml_dtypes' release, from its ``.dist-info`` folder's name (without importing
    it, or importlib.metadata's 20 ms); None where not installed, or not one clear answer."""
    try:
        spec = importlib.util.find_spec("ml_dtypes")
        if spec is None or spec.origin is None:
            return None
        folder = os.path.dirname(os.path.dirname(spec.origin))
        names = [name for name in os.listdir(folder) if name.startswith("ml_dtypes-") and name.endswith(".dist-info")]
    except (ImportError, ValueError, OSError):
        return None
    if len(names) != 1:
        return None
    parts = names[0][len("ml_dtypes-") : -len(".dist-info")].split(".")
    numbers = tuple(int(part) for part in itertools.takewhile(str.isdigit, parts))
    return numbers or None


def _ml_dtypes_module() -> Any:
    """The ml_dtypes module where a program has loaded it, or a release fast to import is
    installed (:data:`_ML_DTYPES_IMPORTED_BELOW`); else None."""
    if "ml_dtypes" not in sys.modules:
        version = _installed_ml_dtypes_version()
        if version is None or version >= _ML_DTYPES_IMPORTED_BELOW:
            return None
    # An import statement even where sys.modules holds it: the first pieces of a cast start on
    # every worker at once, and while one imports ml_dtypes, the module there is half made; the
    # statement waits for that import to finish (a 6-thread conversion failed without it).
    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - a broken install
        return None
    return ml_dtypes


@cache
def _ml_bfloat16() -> np.dtype[Any] | None:
    """ml_dtypes' bfloat16, where ml_dtypes is at hand (:func:`_ml_dtypes_module`); else None.

    Its float32 -> bfloat16 cast is one vectorised pass, with ml_dtypes 0.6.0
    1.2-1.7x faster than the five numpy passes of :func:`_f32_to_bf16`'s other
    path, and rounds every
    non-NaN float32 exactly as torch does (checked against torch for all
    2**32 patterns with ml_dtypes 0.5.4, 0.6.0 and 0.7.0). It encodes NaNs its own way
    (``0x7FC0`` with the sign), which is overwritten like the numpy path's.
    """
    ml_dtypes = _ml_dtypes_module()
    if ml_dtypes is None:
        return None
    dtype: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return dtype


# Which of ml_dtypes' cast and the numpy passes is faster here: timed by the casts' dispatch
# (:func:`ckptconv.transforms.casts._ml_faster`, which runs the kernels this module's users are),
# which hands it over when it is imported, before any kernel runs.
_faster: Callable[[str], bool] = lambda target: False  # noqa: E731 - replaced at import, see above


def faster(target: str) -> bool:
    """Whether ml_dtypes' cast from float32 to ``target`` is the faster here (see :func:`time_with`)."""
    return _faster(target)


def time_with(faster: Callable[[str], bool]) -> None:
    """Set what :func:`_fast_ml_dtype` asks whether ml_dtypes' cast to a target is the faster here."""
    global _faster  # noqa: PLW0603 - the one hand-over, from the dispatch
    _faster = faster
