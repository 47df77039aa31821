"""What ``torch.load(weights_only=True)`` refuses that ckptconv reads as plain data.

ckptconv's pickle machine re-implements more than torch's weights-only
unpickler accepts by default: numpy arrays and dtypes, ``collections.defaultdict``,
``frozenset``, ``slice``, copyreg's reconstructors, storage classes spelled through
``torch.storage``, and every opcode of protocols 0-5 (torch's reads 34 of protocol
2's). None of them runs anything, so ``convert`` reads such files as they are; but
``ckptconv scan`` promises that a ``safe`` file loads with
``torch.load(weights_only=True)``, so it records them (:func:`recording_torch_refusals`)
and calls the file ``torch-refuses`` instead.

The two tables are torch 2.13's ``torch._weights_only_unpickler``: the globals
ckptconv knows that ``_get_allowed_globals()`` leaves out, and the opcodes its
``Unpickler.load`` handles. ``tests/test_scan.py`` compares them with torch itself.
"""

from __future__ import annotations

import pickletools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

__all__ = ["TORCH_OPCODES", "record_global", "record_opcodes", "recording_torch_refusals", "refused_global"]

_NUMPY = [
    f"{core}.{name}"
    for core in ("numpy.core", "numpy._core")
    for name in ("multiarray._reconstruct", "multiarray.scalar", "numeric._frombuffer")
]

# Known to ckptconv (reading/unpickling/rebuild.py), refused by torch unless allowed with
# torch.serialization.add_safe_globals.
_REFUSED = frozenset(
    [
        *_NUMPY,
        "numpy.dtype",
        "numpy.ndarray",
        "collections.defaultdict",
        "builtins.frozenset",
        "builtins.bytes",
        "builtins.slice",
        "copyreg.__newobj__",
        "copyreg.__newobj_ex__",
        "copyreg._reconstructor",
        "torch._tensor._rebuild_from_type",
        "torch.UntypedStorage",
        # dtype aliases: torch pickles a dtype by its own name (torch.float32), never these
        *(f"torch.{alias}" for alias in ("cdouble", "cfloat", "chalf", "double", "float", "half", "int", "long")),
        "torch.short",
    ]
)
# Storage classes torch allows only as torch.<Name>Storage and torch.cuda.<Name>Storage (not quantized).
_REFUSED_STORAGE_MODULES = ("torch.storage", "torch.cuda.storage")
_ALLOWED_STORAGES = frozenset(["UntypedStorage", "TypedStorage"])

#: The opcodes torch's weights-only unpickler reads (``Unpickler.load`` in torch/_weights_only_unpickler.py).
TORCH_OPCODES = frozenset(
    [
        "APPEND",
        "APPENDS",
        "BINFLOAT",
        "BINGET",
        "BININT",
        "BININT1",
        "BININT2",
        "BINPERSID",
        "BINPUT",
        "BINUNICODE",
        "BUILD",
        "EMPTY_DICT",
        "EMPTY_LIST",
        "EMPTY_SET",
        "EMPTY_TUPLE",
        "GLOBAL",
        "LONG1",
        "LONG_BINGET",
        "LONG_BINPUT",
        "MARK",
        "NEWFALSE",
        "NEWOBJ",
        "NEWTRUE",
        "NONE",
        "PROTO",
        "REDUCE",
        "SETITEM",
        "SETITEMS",
        "SHORT_BINSTRING",
        "STOP",
        "TUPLE",
        "TUPLE1",
        "TUPLE2",
        "TUPLE3",
    ]
)

_RECORDER: ContextVar[set[str] | None] = ContextVar("ckptconv_torch_refusals", default=None)


def refused_global(full: str) -> bool:
    """True for a global ckptconv re-implements that torch's weights-only unpickler refuses by default."""
    if full in _REFUSED:
        return True
    module, _, name = full.rpartition(".")
    if not name.endswith("Storage") or name in _ALLOWED_STORAGES:
        return False
    # torch allows torch.<Name>Storage, torch.cuda.<Name>Storage (but quantized ones), and two of torch.storage's
    return module in _REFUSED_STORAGE_MODULES or (module == "torch.cuda" and name.startswith("Q"))


@contextmanager
def recording_torch_refusals(found: set[str]) -> Iterator[None]:
    """Within the block, pickles add to ``found`` what torch's weights-only unpickler would refuse in them:
    ``"numpy.dtype"`` for a global, ``"opcode FRAME"`` for an opcode."""
    token = _RECORDER.set(found)
    try:
        yield
    finally:
        _RECORDER.reset(token)


def record_global(full: str) -> None:
    """Note a known global (normalised spelling) resolved while recording."""
    found = _RECORDER.get()
    if found is not None and refused_global(full):
        found.add(full)


def record_opcodes(data: bytes, start: int, end: int) -> None:
    """Note the opcodes of the pickle ``data[start:end]`` that torch does not read (only while recording)."""
    found = _RECORDER.get()
    if found is None:
        return
    try:
        names = {opcode.name for opcode, _arg, _pos in pickletools.genops(data[start:end])}
    except Exception:
        found.add("opcode that pickletools cannot name")
        return
    found.update(f"opcode {name}" for name in names - TORCH_OPCODES)
