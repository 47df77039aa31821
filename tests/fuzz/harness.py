"""What the fuzzers run on each input: everything a conversion does, expecting only CkptconvError."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import ckptconv
from ckptconv.errors import CkptconvError
from ckptconv.reading.unpickling.unpickler import Unpickler

from ..hostile import CANARY

CORPUS = Path(__file__).resolve().parent / "corpus"
# Inputs past this many bytes of tensor data are not read (the limits tests cover big reads).
_MAX_READ = 64 << 20


def exercise(data: bytes, folder: Path) -> None:
    """Open ``data`` as a file, select weights, read every tensor, write both formats.

    Raises anything that is not a CkptconvError, and AssertionError if a payload ran.
    """
    path = folder / "input"
    path.write_bytes(data)
    exercise_path(path, folder)


def exercise_path(path: Path, folder: Path) -> None:
    """The same for a checkpoint already on disk (a file, or a sharded or DCP folder)."""
    try:
        checkpoint = ckptconv.open(path)
        total = 0
        for _, ref in checkpoint.tensors():
            total += ref.nbytes
            if total > _MAX_READ:
                break
            for _chunk in ref.iter_bytes():
                pass
        ckptconv.inspect(path)
        weights = checkpoint.select().weights
        if sum(ref.nbytes for ref in weights.values()) <= _MAX_READ:
            for suffix in (".pt", ".safetensors"):
                ckptconv.save(weights, folder / f"out{suffix}", overwrite=True, fsync=False)
    except CkptconvError:
        pass
    finally:
        assert not os.path.exists(CANARY) and not (folder / CANARY).exists(), "a payload ran"


def exercise_pickle(data: bytes) -> None:
    with contextlib.suppress(CkptconvError):
        Unpickler(data, source="fuzz", max_items=1_000_000).load()
    assert not os.path.exists(CANARY), "a payload ran"
