"""Frames: how batch's parent and worker processes pass pickled jobs and results over pipes.

Each frame is a length, then that many bytes of pickle.
"""

from __future__ import annotations

import pickle
import struct
from typing import IO, Any


def write_frame(stream: IO[bytes], value: Any) -> None:
    """Send one pickled value, and flush it."""
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def read_frame(stream: IO[bytes]) -> Any:
    """Receive one value; EOFError when the other side has closed the pipe (or died)."""
    header = _read_exactly(stream, _LENGTH.size)
    # Trusted: these bytes come from the ckptconv process at the other end of a private pipe,
    # never from a checkpoint.
    return pickle.loads(_read_exactly(stream, _LENGTH.unpack(header)[0]))  # noqa: S301 - trusted, see above


def _read_exactly(stream: IO[bytes], size: int) -> bytes:
    chunks = []
    while size:
        chunk = stream.read(size)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


_LENGTH = struct.Struct(">Q")
