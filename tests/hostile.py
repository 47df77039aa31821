"""Builders of hostile checkpoints, shared by the tests and ``tests/fuzz/make_corpus.py``.

Every payload, when a real unpickler runs it, creates the file ``CANARY`` in
the current directory (the tests run them from ``tmp_path``). ckptconv must
never create it. Each body pushes one object, so it can stand anywhere a value
can: at the top, deep inside dicts, or after valid tensors.
"""

from __future__ import annotations

import io
import pickletools
import struct
import zipfile
from typing import Callable

CANARY = "ckptconv-canary"
COMMAND = f"touch {CANARY}"


def _text(value: str) -> bytes:
    raw = value.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _global(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()


_CMD = _text(COMMAND)
_SETSTATE = b"}" + _text("__setstate__") + _global("os", "system") + b"sb" + _CMD + b"b"

# name -> (pickle body pushing one object, note on when it runs code)
ROUTES: dict[str, bytes] = {
    "GLOBAL+REDUCE": _global("os", "system") + _CMD + b"\x85R",
    "STACK_GLOBAL": b"\x8c\x02os\x8c\x06system\x93" + _CMD + b"\x85R",
    "INST": b"(" + _CMD + b"ios\nsystem\n",
    "OBJ": b"(" + _global("os", "system") + _CMD + b"o",
    # NEWOBJ/NEWOBJ_EX make a harmless object; BUILD then stores os.system as its
    # __setstate__ and a second BUILD calls it (the classic BUILD route).
    "NEWOBJ+BUILD __setstate__": _global("argparse", "Namespace") + b")\x81" + _SETSTATE,
    "NEWOBJ_EX+BUILD __setstate__": _global("argparse", "Namespace") + b")}\x92" + _SETSTATE,
    # The payload runs while the persistent id tuple is being built.
    "persistent id": b"(" + _text("storage") + _global("os", "system") + _CMD + b"\x85RNNNtQ",
    # GLOBAL memoised and popped, fetched back later: scanners that look only at
    # what is on the stack around REDUCE miss it.
    "memo trick": _global("os", "system") + b"q\x170N0h\x17" + _CMD + b"\x85R",
    # getattr(__import__("os"), "system")(cmd): no module named os.system anywhere.
    "getattr chain": _global("builtins", "getattr")
    + b"("
    + _global("builtins", "__import__")
    + _text("os")
    + b"\x85R"
    + _text("system")
    + b"tR"
    + _CMD
    + b"\x85R",
    # A pickle inside the pickle (scanners that do not recurse).
    "nested pickle": _global("_pickle", "loads") + b"C" + bytes([0]) + b"\x85R",  # bytes filled in below
    # copyreg extension code 0xF0: runs only where a program registered os.system under it.
    "EXT1": b"\x82\xf0" + _CMD + b"\x85R",
    # Globals that picklescan/fickling-style deny lists missed (bypass reports).
    "pydoc.pipepager": _global("pydoc", "pipepager") + _text("") + _CMD + b"\x86R",
    "uuid._get_command_stdout": _global("uuid", "_get_command_stdout") + _text("touch") + _text(CANARY) + b"\x86R",
    "_osx_support._read_output": _global("_osx_support", "_read_output") + _CMD + b"\x85R",
    "torch.utils.collect_env.run": _global("torch.utils.collect_env", "run") + _CMD + b"\x85R",
    "numpy runstring": _global("numpy.testing._private.utils", "runstring")
    + _text(f"import os; os.system({COMMAND!r})")
    + b"}\x86R",
    "cProfile.run": _global("cProfile", "run") + _text(f"import os; os.system({COMMAND!r})") + b"\x85R",
    "subprocess.getoutput": _global("subprocess", "getoutput") + _CMD + b"\x85R",
    "timeit": _global("timeit", "timeit")
    + b"("
    + _text(f"import os; os.system({COMMAND!r})")
    + _text("pass")
    + _global("time", "perf_counter")
    + b"K\x01tR",
}
_INNER = b"\x80\x02" + ROUTES["GLOBAL+REDUCE"] + b"."
ROUTES["nested pickle"] = _global("_pickle", "loads") + b"C" + bytes([len(_INNER)]) + _INNER + b"\x85R"

# Routes that run code under pickle.loads only with help from the host program.
NEEDS_REGISTRATION = {"EXT1"}
# Routes whose code needs a module that may be missing on some platforms.
PLATFORM = {"_osx_support._read_output"}


def raw_pickle(body: bytes) -> bytes:
    return b"\x80\x02" + body + b"."


def nested_pickle(body: bytes, depth: int = 1000) -> bytes:
    """The payload as the innermost value of ``depth`` nested dicts."""
    return b"\x80\x02" + (b"}" + _text("k")) * depth + body + b"s" * depth + b"."


def _torch_bytes(obj: object, **kwargs: object) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer, **kwargs)  # type: ignore[arg-type]
    return buffer.getvalue()


def _valid_state() -> object:
    import torch

    return {"w": torch.arange(4, dtype=torch.float32), "b": torch.ones(2)}


def _after_tensors(pickle_bytes: bytes, body: bytes) -> bytes:
    """A torch dict pickle (``... u.``) with one more entry holding the payload, after the tensors."""
    assert pickle_bytes.endswith(b"u."), pickle_bytes[-4:]
    return pickle_bytes[:-2] + _text("evil") + body + b"u."


def zip_checkpoint(data_pkl: Callable[[bytes], bytes], *, extra: dict[str, bytes] | None = None) -> bytes:
    """A valid torch zip checkpoint whose data.pkl is replaced by ``data_pkl(original)``."""
    good = zipfile.ZipFile(io.BytesIO(_torch_bytes(_valid_state())))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for info in good.infolist():
            data = good.read(info)
            if info.filename.endswith("/data.pkl"):
                data = data_pkl(data)
            archive.writestr(info, data)
        for name, data in (extra or {}).items():
            archive.writestr(name, data)
    return out.getvalue()


def legacy_pickles(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of each pickle at the front of a legacy checkpoint (five of them)."""
    spans = []
    start = 0
    for _ in range(5):
        end = start
        for opcode, _arg, position in pickletools.genops(io.BytesIO(data[start:])):
            if opcode.name == "STOP":
                end = start + position + 1
                break
        spans.append((start, end))
        start = end
    return spans


def legacy_checkpoint(object_pickle: Callable[[bytes], bytes]) -> bytes:
    """A valid legacy checkpoint whose object pickle is replaced by ``object_pickle(original)``."""
    data = _torch_bytes(_valid_state(), _use_new_zipfile_serialization=False)
    start, end = legacy_pickles(data)[3]
    return data[:start] + object_pickle(data[start:end]) + data[end:]


# name -> builder of the file bytes for one payload body
CONTAINERS: dict[str, Callable[[bytes], bytes]] = {
    "raw pickle": raw_pickle,
    "raw pickle, 1000 dicts deep": nested_pickle,
    "torch zip": lambda body: zip_checkpoint(lambda _: raw_pickle(body)),
    "torch zip, after tensors": lambda body: zip_checkpoint(lambda original: _after_tensors(original, body)),
    "legacy": lambda body: legacy_checkpoint(lambda _: raw_pickle(body)),
    "legacy, after tensors": lambda body: legacy_checkpoint(lambda original: _after_tensors(original, body)),
}
