"""Plain pickle files: a state dict pickled without torch's storage records.

Tensors cannot live in a plain pickle without torch's persistent ids, but
numpy arrays can, and some projects ship weights as a pickled dict of numpy
arrays. The file is read into memory once; arrays become in-memory tensors.
"""

from __future__ import annotations

import pickletools

from ckptconv._text import short_repr
from ckptconv.errors import MalformedCheckpointError
from ckptconv.reading import read_policy
from ckptconv.reading.formats._base import ReadResult
from ckptconv.reading.formats._other_files import TEXT_PROBE_BYTES, not_a_checkpoint
from ckptconv.reading.unpickling.unpickler import DEFAULT_MAX_ITEMS, Unpickler

__all__ = ["read"]

FORMAT = "pickle"


def read(path: str, *, max_items: int | None = None) -> ReadResult:
    with read_policy.open_file(path) as file:
        data = file.read()
    unpickler = Unpickler(data, source=path, max_items=max_items or DEFAULT_MAX_ITEMS)
    try:
        tree = unpickler.load()
    except MalformedCheckpointError:
        if data[:1] == b"\x80" or _parses(data):
            raise  # a pickle, whatever it holds: say what is wrong with what it holds
        # Only the first byte suggested an old-protocol pickle; it was a guess.
        raise not_a_checkpoint(path, data[:TEXT_PROBE_BYTES], len(data)) from None
    if data[unpickler.end : unpickler.end + 1] == b"\x80" and not isinstance(tree, (dict, list)):
        # A plain pickle is one pickle; a legacy torch.save file is several, the first of them a magic number.
        raise MalformedCheckpointError(
            f"{path!r} holds several pickles one after another, as a legacy torch.save file does, but the "
            f"first is {short_repr(tree)} instead of torch's magic number; the file is damaged",
            path=path,
        )
    unpickler.check_end()
    return ReadResult(FORMAT, tree, unpickler.foreign_globals)


def _parses(data: bytes) -> bool:
    """True when ``data`` starts with a complete, well-formed pickle (protocol 0 and 1 have no header to
    tell them by): its opcodes are only parsed by ``pickletools``, never run."""
    try:
        for _ in pickletools.genops(data):  # stops after STOP
            pass
    except Exception:
        return False
    return True
