"""Coverage-guided fuzzing of the readers with atheris (optional; not run by the test suite).

    pip install atheris
    python tests/fuzz/atheris_fuzz.py -atheris_runs=200000 tests/fuzz/corpus-work tests/fuzz/corpus

Any exception other than CkptconvError, a crash, or a payload that ran is a
bug: atheris stops and writes the input as crash-*. The seed corpus is read
from tests/fuzz/corpus; new inputs go to the first folder given.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

with atheris.instrument_imports():
    import ckptconv  # noqa: F401 - imported under instrumentation, so atheris covers its code
    from tests.fuzz.harness import exercise, exercise_pickle

_FOLDER = Path(tempfile.mkdtemp(prefix="ckptconv-atheris-"))


def one_input(data: bytes) -> None:
    if data[:1] == b"\x00" and len(data) > 1:
        exercise_pickle(data[1:])  # the unpickler alone, on raw bytes
    else:
        exercise(data, _FOLDER)


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
