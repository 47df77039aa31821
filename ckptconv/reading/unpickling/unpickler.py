"""A pickle machine that never runs code from the file.

``pickle`` is a small stack language whose GLOBAL opcode names any importable
callable and whose REDUCE opcode calls it: that is how a checkpoint can run
``os.system``. This module interprets every opcode of protocols 0-5 itself and
gives GLOBAL three possible meanings, none of which imports anything:

* **known and harmless** (``collections.OrderedDict``, torch's tensor rebuild
  functions, numpy's array reconstructor, ...): resolved to ckptconv's own
  re-implementation, which builds plain data or a lazy :class:`TensorRef`;
* **made to run code** (``os.system``, ``builtins.eval``, ``subprocess``,
  ``importlib``, ``pickle.loads``, ...): the file is refused with
  :class:`UnsafeCheckpointError` naming the global;
* **anything else** (a model class from code the user does not have,
  ``argparse.Namespace``, ``omegaconf.DictConfig``): an inert
  :class:`ForeignGlobal`. "Calling" it records the arguments in a
  :class:`ForeignObject`; BUILD, SETITEMS and APPENDS store their data in it.
  Nothing is ever called or imported.

The stand-ins are the safety boundary; the refusal list is a warning about
intent. torch's own ``weights_only`` unpickler refuses every unknown global
instead, which is why checkpoints holding an ``argparse.Namespace`` stopped
loading in torch 2.6 and people reached for ``weights_only=False``.

The policy (what is dangerous, known or foreign) is :mod:`ckptconv.reading.unpickling.pickle_policy`;
the re-implementations are :mod:`ckptconv.reading.unpickling.rebuild`; the stand-ins are
:mod:`ckptconv.values.standins`. This module is only the interpreter.

It is the one module over 600 lines, on purpose: the opcode loop is one function whose branches
share the stack, the memo and the limits' counters, as CPython's ``_pickle.c`` load loop does; cut
into pieces, each opcode would pay a call and the reader would have to follow state across them.
"""

from __future__ import annotations

import codecs
import struct
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from ckptconv._text import short_repr
from ckptconv.errors import MalformedCheckpointError, UnsafeCheckpointError, UnsupportedFormatError
from ckptconv.reading.unpickling import torch_parity
from ckptconv.reading.unpickling.pickle_policy import (
    GETATTR,
    TORCH_OWN_TYPES,
    attribute_lookup_refusal,
    normalise_global,
    unsafe_family,
)
from ckptconv.reading.unpickling.rebuild import (
    call,
    check_hashable,
    fill_numpy_array,
    instantiate,
    known_global,
    malformed,
)
from ckptconv.values.standins import ForeignGlobal, ForeignObject, NumpyArray, NumpyDType
from ckptconv.values.tensor import TensorRef

__all__ = ["DEFAULT_MAX_ITEMS", "PickleTruncatedError", "Unpickler", "UnsafeFinding", "recording_unsafe"]

# A pickle may make at most this many objects. Every opcode counts as one
# (most make at most one object of ~50-70 bytes), and so do every container
# item and memo entry; an empty set counts 4, a stand-in object 4, and a known
# callable such as builtins.set counts the items it is given and returns.
# Without the weights one byte of pickle could build 235 bytes of empty sets, or
# copy a memoised million-item list again and again. tests/test_limits.py
# measures at most 80 bytes and 2 us per unit, so 20 million bounds a pickle near
# 1.6 GB and 40 s (SECURITY.md records the figures); torch.save writes ~30 opcodes
# per tensor, which leaves room for 600,000 tensors.
DEFAULT_MAX_ITEMS = 20_000_000
# Bytes made by copying (bytearray(), _codecs.encode, numpy array data) may
# exceed the pickle's own size by at most this much.
_EXTRA_BYTES = 64 << 20
# Check the opcode count every this many opcodes (a local counter, cheap).
_OPCODE_BATCH = 1 << 16

# Expansion patterns (fickling's resource-exhaustion cases): CPython's pickler writes a container into
# itself once per cycle the object holds, never writes DUP, and leaves nothing on the stack at STOP. More
# than this many cycle-closing references, DUPs of containers or containers left behind is a pickle built
# to make a walker (or a naive loader) expand the same object again and again: unsafe, family EXPANSION.
_EXPANSION_LIMIT = 16
EXPANSION = "exhausts memory"
_PLAIN = frozenset({list, tuple, dict, set, frozenset, OrderedDict, Counter})
_CONTAINERS = (list, tuple, dict, set, frozenset)
# Objects whose reuse through the memo or DUP can multiply what a walker sees.
_SHAREABLE = frozenset({list, tuple, dict, set, frozenset, OrderedDict, Counter, ForeignObject})
# frame_end while no frame is open: never reached.
_NO_FRAME = sys.maxsize


@dataclass(frozen=True)
class UnsafeFinding:
    """A name from an unsafe family that a pickle reached for (recorded by :func:`recording_unsafe`).

    Attributes:
        name: the global, Python 3 spelling (``posix.system``).
        family: its unsafe family (``"runs processes"``; see :mod:`ckptconv.reading.unpickling.pickle_policy`).
        offset: the byte offset of the opcode that names it, within its pickle.
        where: the file (or ``file:member``) the pickle came from.
    """

    name: str
    family: str
    offset: int
    where: str

    def describe(self) -> str:
        """``names posix.system (runs processes) at pickle byte 24``."""
        if self.family == EXPANSION:
            return f"{self.name} ({self.family}) from pickle byte {self.offset}"  # not a name: a pattern
        return f"names {self.name} ({self.family}) at pickle byte {self.offset}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "family": self.family, "offset": self.offset, "where": self.where}


_RECORDER: ContextVar[list[UnsafeFinding] | None] = ContextVar("ckptconv_unsafe_recorder", default=None)


@contextmanager
def recording_unsafe(findings: list[UnsafeFinding] | None) -> Iterator[None]:
    """Within the block, pickles record unsafe names in ``findings`` instead of raising at the first.

    For ``ckptconv scan``, which must name everything a file reaches for. A
    recorded name still resolves to an inert stand-in, so nothing runs; the
    caller decides the verdict. ``None`` turns recording off (the default).
    """
    token = _RECORDER.set(findings)
    try:
        yield
    finally:
        _RECORDER.reset(token)


def _parts(node: Any) -> list[Any]:
    """What a container refers to, for the expansion count."""
    if isinstance(node, dict):
        return [*node.keys(), *node.values()]
    if isinstance(node, (list, tuple, set, frozenset)):
        return list(node)
    if isinstance(node, ForeignObject):
        return [node.args, node.kwargs, node.state, node.items, node.list_items]
    return []


class PickleTruncatedError(MalformedCheckpointError):
    """The pickle ran past the end of the bytes it was given."""


class Unpickler:
    """Interprets one pickle from ``data`` starting at ``start``.

    Args:
        data: the bytes holding the pickle (it may be followed by other data).
        start: offset of the pickle's first opcode.
        persistent_load: resolves persistent ids (torch's storage references);
            when None, a persistent id is an error.
        source: the file name, for messages.
        max_items: the object budget (see ``DEFAULT_MAX_ITEMS``): refuse pickles that build more.

    After :meth:`load`, ``end`` is the offset just past the STOP opcode and
    ``foreign_globals`` counts the stand-ins created per global.
    """

    def __init__(
        self,
        data: bytes,
        *,
        start: int = 0,
        persistent_load: Callable[[Any], Any] | None = None,
        source: str = "",
        max_items: int = DEFAULT_MAX_ITEMS,
    ) -> None:
        self.data = bytes(data)
        self.start = start
        self.pos = start
        self.end = start
        self.persistent_load = persistent_load
        self.source = source
        self.max_items = max_items
        self.items_built = 0
        self.max_bytes = len(self.data) + _EXTRA_BYTES
        self.bytes_built = 0
        self.foreign_globals: Counter[str] = Counter()
        self._globals_cache: dict[tuple[str, str], Any] = {}
        # builtins.getattr is allowed only as getattr(stand-in class, plain name) (see
        # pickle_policy.attribute_lookup_refusal): every time the pickle puts it on the stack
        # must be matched by one such call, or it went somewhere else and the file is unsafe.
        self._getattr = ForeignGlobal(*GETATTR)
        self._getattr_pushed = 0
        self._getattr_called = 0
        self._getattr_offset = -1

    # -- reading primitives ----------------------------------------------------------

    def _truncated(self) -> MalformedCheckpointError:
        return PickleTruncatedError(
            f"{self.source or 'the pickle'} is truncated: its pickle ends at byte {len(self.data)} "
            "before the STOP opcode; the file is incomplete or damaged",
            path=self.source or None,
        )

    def _differential(self, what: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(
            f"{self.source or 'the pickle'} is built to be read two ways: {what}, so CPython's unpickler "
            "(and torch.load) would read other opcodes than a scanner does; refusing it (nothing was executed)",
            path=self.source or None,
        )

    def _check_expansion(self, root: Any) -> int:
        """Refuse a result whose shared references expand past the object budget; count its cycles.

        The memo and DUP let a pickle reuse an object: ``[x, x]`` twice nested
        forty times is ~90 bytes that any loader which copies, prints or walks
        the result as a tree (``copy.deepcopy``, ``json``, a naive converter)
        expands to 2**40 objects. Counted once per object, with each object's
        expanded size computed once, so the check costs one pass over the DAG.

        Returns the references that close a cycle (a list appended to itself):
        :meth:`_check_expansion_pattern` judges them.
        """
        budget = self.max_items
        sizes: dict[int, int] = {}
        on_path: set[int] = set()  # the node being walked and its ancestors
        cycles = 0
        pending: list[tuple[Any, bool, Any]] = [(root, False, None)]
        while pending:
            node, children_done, parent = pending.pop()
            if children_done:
                on_path.discard(id(node))
                total = 1 + sum(sizes.get(id(child), 1) for child in _parts(node))
                if total > budget:
                    raise MalformedCheckpointError(
                        f"{self.source or 'the pickle'} expands to more than {budget:,} objects through shared "
                        "references (memo/DUP); a loader that copies or walks it would exhaust memory; "
                        "refusing what looks like a hostile file",
                        path=self.source or None,
                    )
                sizes[id(node)] = total
                continue
            if id(node) in sizes:
                # A reference back to an ancestor closes a cycle. Counted where it puts a plain container
                # into itself, or a stand-in object into its own items (a model's parent pointer is neither).
                if id(node) in on_path and (
                    type(node) in _PLAIN or any(part is parent for part in _parts(node)) or parent is node
                ):
                    cycles += 1
                continue
            sizes[id(node)] = 1  # provisional: a cycle back to this node counts once
            on_path.add(id(node))
            pending.append((node, True, parent))
            pending.extend((child, False, node) for child in _parts(node) if type(child) in _SHAREABLE)
        return cycles

    def _check_expansion_pattern(self, cycles: int, dups: int, left: int, offset: int) -> None:
        """Name a pickle built to expand one container again and again (see ``_EXPANSION_LIMIT``)."""
        for count, what in (
            (cycles, "puts containers into themselves"),
            (dups, "duplicates containers with DUP"),
            (left, "leaves shared containers on the stack at STOP"),
        ):
            if count > _EXPANSION_LIMIT:
                self._unsafe(
                    f"memo/DUP expansion: {what} {count:,} times",
                    EXPANSION,
                    offset,
                    f"{what} {count:,} times through the memo/DUP, an expansion pattern ({EXPANSION}) starting",
                )
                return

    def check_end(self) -> None:
        """Refuse bytes after the pickle's STOP opcode (call after :meth:`load`).

        ``torch.load`` and ``pickle.load`` read one pickle and ignore the rest;
        other loaders (and scanners) read on. A file that holds more than its
        pickle can be read two ways. While :func:`recording_unsafe` is active the
        rest is read as further pickles first, so that what it hides is named.
        """
        rest = len(self.data) - self.end
        if rest <= 0:
            return
        if _RECORDER.get() is not None:
            position = self.end
            while position < len(self.data):
                follower = Unpickler(self.data, start=position, source=self.source, max_items=self.max_items)
                try:
                    follower.load()
                except (MalformedCheckpointError, UnsupportedFormatError, UnsafeCheckpointError):
                    break
                position = follower.end
        raise MalformedCheckpointError(
            f"{self.source or 'the pickle'} holds {rest:,} bytes after its pickle's STOP opcode (another pickle, "
            "or damage); torch reads only the first pickle and other loaders read on, so refusing a file that "
            "can be read two ways",
            path=self.source or None,
        )

    def _read(self, n: int) -> bytes:
        pos = self.pos
        end = pos + n
        if n < 0 or end > len(self.data):
            raise self._truncated()
        self.pos = end
        return self.data[pos:end]

    def _readline(self) -> bytes:
        data = self.data
        pos = self.pos
        newline = data.find(b"\n", pos)
        if newline < 0:
            raise self._truncated()
        self.pos = newline + 1
        return bytes(data[pos:newline])

    def _count(self, n: int) -> None:
        self.items_built += n
        if self.items_built > self.max_items:
            raise MalformedCheckpointError(
                f"{self.source or 'the pickle'} builds more than {self.max_items:,} objects; "
                "refusing to exhaust memory on what looks like a hostile file",
                path=self.source or None,
            )

    def _count_bytes(self, n: int) -> None:
        self.bytes_built += n
        if self.bytes_built > self.max_bytes:
            raise MalformedCheckpointError(
                f"{self.source or 'the pickle'} builds more than {self.max_bytes:,} bytes of data from "
                f"{len(self.data):,} bytes of pickle; refusing to exhaust memory on what looks like a hostile file",
                path=self.source or None,
            )

    # -- globals ---------------------------------------------------------------------

    def _global(self, module: str, name: str, offset: int) -> Any:
        key = (module, name)
        cached = self._globals_cache.get(key)
        if cached is not None:
            if cached is self._getattr:
                self._getattr_pushed += 1
            return cached
        if normalise_global(module, name) == GETATTR:
            self._globals_cache[key] = self._getattr
            self._getattr_pushed += 1
            if self._getattr_offset < 0:
                self._getattr_offset = offset
            return self._getattr
        family = unsafe_family(module, name)  # as written: Python 2 spellings count as CPython renames them
        module, name = normalise_global(module, name)
        full = f"{module}.{name}"
        if family is not None:
            self._unsafe(full, family, offset, f"calls {full} ({family})")
            standin = ForeignGlobal(module, name)  # inert, and not listed among the foreign ones
            self._globals_cache[key] = standin
            return standin
        value: Any = known_global(module, name)
        if value is None:
            value = ForeignGlobal(module, name)
            if full not in TORCH_OWN_TYPES:
                self.foreign_globals[full] += 0  # listed even if never instantiated
        else:
            torch_parity.record_global(full)  # for `scan`: data to ckptconv, which torch may refuse
        self._globals_cache[key] = value
        return value

    def _unsafe(self, name: str, family: str, offset: int, what: str) -> None:
        """Refuse the pickle for reaching for ``name``, or record it while scanning."""
        findings = _RECORDER.get()
        if findings is None:
            raise UnsafeCheckpointError(
                f"{self.source or 'the pickle'} {what} at pickle byte {offset}; refusing "
                "a checkpoint built to attack whoever opens it (nothing was executed)",
                path=self.source or None,
                globals=[name],
            )
        findings.append(UnsafeFinding(name, family, offset, self.source))

    def _attribute_lookup(self, args: tuple[Any, ...], offset: int) -> Any:
        """``getattr(target, name)`` from the pickle: a stand-in for ``target``'s nested name, or unsafe.

        Nothing is looked up: the result is the inert stand-in ``module.Class.name``.
        """
        self._getattr_called += 1
        target = args[0] if len(args) == 2 else None
        reason: str | None = f"it is called on {short_repr(target)}, not on a class stand-in"
        if isinstance(target, ForeignGlobal) and target is not self._getattr:
            reason = attribute_lookup_refusal(target.module, target.name, args[1])
        if reason is not None or not isinstance(target, ForeignGlobal):
            self._unsafe(
                "builtins.getattr", "reaches into the interpreter", offset, f"calls builtins.getattr ({reason})"
            )
            return ForeignGlobal(*GETATTR)
        full = f"{target.qualname}.{args[1]}"
        self.foreign_globals[full] += 0  # listed like any foreign global
        return ForeignGlobal(target.module, f"{target.name}.{args[1]}")

    # -- the loop --------------------------------------------------------------------

    def load(self) -> Any:
        """Run the pickle to its STOP opcode and return the object it builds.

        Raises:
            MalformedCheckpointError: truncated or inconsistent pickle.
            UnsafeCheckpointError: the pickle names a code-running global.
            UnsupportedFormatError: the pickle uses features torch never writes
                (extension registry, out-of-band buffers).
        """
        stack: list[Any] = []
        metastack: list[list[Any]] = []
        memo: dict[int, Any] = {}
        data = self.data
        size = len(data)
        read = self._read
        unpack_from = struct.unpack_from

        def pop_mark() -> list[Any]:
            nonlocal stack
            if not metastack:
                raise malformed("pickle pops a MARK that was never set")
            items = stack
            stack = metastack.pop()
            return items

        def top() -> Any:
            if not stack:
                raise malformed("pickle stack underflow")
            return stack[-1]

        def pop() -> Any:
            if not stack:
                raise malformed("pickle stack underflow")
            return stack.pop()

        opcodes = memo_counted = 0
        next_check = _OPCODE_BATCH
        frame_end = _NO_FRAME
        op_start = self.pos
        shared = False  # a container was pushed again by a memo read or DUP
        dups = 0  # DUPs of containers (CPython's pickler writes none)
        shared_at = -1  # the first opcode that pushed a container again
        while True:
            if self.pos >= frame_end:
                if self.pos > frame_end:
                    raise self._differential(
                        f"the opcode at byte {op_start} runs past the end of the frame at byte {frame_end}"
                    )
                frame_end = _NO_FRAME
            op_start = self.pos
            if op_start >= size:
                raise self._truncated()
            op = data[op_start]
            self.pos += 1
            opcodes += 1
            if opcodes >= next_check:  # every opcode and memo entry counts as one object
                self._count(_OPCODE_BATCH + len(memo) - memo_counted)
                memo_counted = len(memo)
                next_check += _OPCODE_BATCH

            # ---- the most frequent opcodes in torch pickles first (measured on torch.save files: an elif
            # chain tests them in order, and a torch pickle runs some 25 opcodes per tensor)
            if op == 0x71:  # BINPUT
                if self.pos >= size:
                    raise self._truncated()
                memo[data[self.pos]] = top()
                self.pos += 1
            elif op == 0x72:  # LONG_BINPUT
                memo[unpack_from("<I", read(4))[0]] = top()
            elif op == 0x68:  # BINGET
                if self.pos >= size:
                    raise self._truncated()
                value = self._memo_get(memo, data[self.pos])
                if type(value) in _SHAREABLE:
                    shared = True
                    shared_at = op_start if shared_at < 0 else shared_at
                elif value is self._getattr:
                    self._getattr_pushed += 1
                stack.append(value)
                self.pos += 1
            elif op == 0x4B:  # BININT1
                if self.pos >= size:
                    raise self._truncated()
                stack.append(data[self.pos])
                self.pos += 1
            elif op == 0x28:  # MARK
                metastack.append(stack)
                stack = []
            elif op == 0x58:  # BINUNICODE
                n = unpack_from("<I", read(4))[0]
                stack.append(self._decode_utf8(read(n)))
            elif op == 0x74:  # TUPLE
                items = pop_mark()
                self._count(len(items))
                stack.append(tuple(items))
            elif op == 0x86:  # TUPLE2
                b = pop()
                a = pop()
                stack.append((a, b))
            elif op == 0x52:  # REDUCE
                args = pop()
                function = pop()
                if not isinstance(args, tuple):
                    raise malformed("REDUCE arguments are not a tuple")
                if function is self._getattr:
                    stack.append(self._attribute_lookup(args, op_start))
                else:
                    stack.append(self._called(function, args))
            elif op == 0x29:  # EMPTY_TUPLE
                stack.append(())
            elif op == 0x89:  # NEWFALSE
                stack.append(False)
            elif op == 0x4D:  # BININT2
                stack.append(unpack_from("<H", read(2))[0])
            elif op == 0x51:  # BINPERSID
                stack.append(self._persistent(pop()))
            elif op == 0x6A:  # LONG_BINGET
                value = self._memo_get(memo, unpack_from("<I", read(4))[0])
                if type(value) in _SHAREABLE:
                    shared = True
                    shared_at = op_start if shared_at < 0 else shared_at
                self._getattr_pushed += value is self._getattr
                stack.append(value)
            elif op == 0x85:  # TUPLE1
                stack.append((pop(),))
            elif op == 0x7D:  # EMPTY_DICT
                stack.append({})
            elif op == 0x75:  # SETITEMS
                items = pop_mark()
                self._count(len(items))
                self._set_items(top(), items)
            elif op == 0x47:  # BINFLOAT
                stack.append(unpack_from(">d", read(8))[0])
            elif op == 0x4E:  # NONE
                stack.append(None)
            elif op == 0x73:  # SETITEM
                value = pop()
                key = pop()
                self._count(1)
                self._set_items(top(), [key, value])
            elif op == 0x87:  # TUPLE3
                c = pop()
                b = pop()
                a = pop()
                stack.append((a, b, c))
            elif op == 0x8C:  # SHORT_BINUNICODE
                stack.append(self._decode_utf8(read(read(1)[0])))

            # ---- constants and scalars
            elif op == 0x80:  # PROTO
                proto = read(1)[0]
                if proto > 5:
                    raise UnsupportedFormatError(
                        f"{self.source or 'the pickle'} uses pickle protocol {proto}, newer than any "
                        "Python writes today; upgrade ckptconv",
                        path=self.source or None,
                    )
            elif op == 0x95:  # FRAME
                # CPython's readers honour frames and differ when a file lies about them: the
                # C unpickler drops the rest of a frame when a text line runs past its end,
                # the Python one refuses. Read only files where every reader agrees.
                length = unpack_from("<Q", read(8))[0]
                if frame_end != _NO_FRAME:
                    raise self._differential(
                        f"a FRAME opcode at byte {op_start} starts inside the frame that ends at byte {frame_end}"
                    )
                if length > size - self.pos:
                    raise PickleTruncatedError(
                        f"{self.source or 'the pickle'} is truncated: its FRAME at byte {op_start} holds "
                        f"{length:,} bytes but only {size - self.pos:,} follow; the file is incomplete or damaged",
                        path=self.source or None,
                    )
                frame_end = self.pos + length
            elif op == 0x2E:  # STOP
                self.end = self.pos
                torch_parity.record_opcodes(data, self.start, self.end)
                if not stack:
                    raise malformed("pickle stops with an empty stack")
                if self._getattr_pushed != self._getattr_called:
                    self._unsafe(
                        "builtins.getattr",
                        "reaches into the interpreter",
                        self._getattr_offset,
                        "uses builtins.getattr other than to name a class's attribute",
                    )
                if shared:
                    cycles = self._check_expansion(stack[-1])
                    left = sum(type(value) in _SHAREABLE for frame in (*metastack, stack[:-1]) for value in frame)
                    self._check_expansion_pattern(cycles, dups, left, shared_at)
                return stack[-1]
            elif op == 0x88:  # NEWTRUE
                stack.append(True)
            elif op == 0x4A:  # BININT
                stack.append(unpack_from("<i", read(4))[0])
            elif op == 0x8A:  # LONG1
                n = read(1)[0]
                stack.append(int.from_bytes(read(n), "little", signed=True))
            elif op == 0x8B:  # LONG4
                n = unpack_from("<i", read(4))[0]
                if n < 0:
                    raise malformed("LONG4 has a negative length")
                stack.append(int.from_bytes(read(n), "little", signed=True))
            elif op == 0x49:  # INT (text)
                line = self._readline()
                if line == b"01":
                    stack.append(True)
                elif line == b"00":
                    stack.append(False)
                else:
                    stack.append(self._parse_int(line))
            elif op == 0x4C:  # LONG (text)
                line = self._readline()
                stack.append(self._parse_int(line[:-1] if line.endswith(b"L") else line))
            elif op == 0x46:  # FLOAT (text)
                try:
                    stack.append(float(self._readline()))
                except ValueError as error:
                    raise malformed("FLOAT opcode holds no number") from error

            # ---- strings and bytes
            elif op == 0x8D:  # BINUNICODE8
                n = unpack_from("<Q", read(8))[0]
                stack.append(self._decode_utf8(read(n)))
            elif op == 0x56:  # UNICODE (text, raw-unicode-escape)
                try:
                    stack.append(str(self._readline(), "raw-unicode-escape"))
                except UnicodeDecodeError as error:
                    raise malformed("UNICODE opcode holds undecodable text") from error
            elif op == 0x55:  # SHORT_BINSTRING (Python 2 str)
                stack.append(self._decode_py2_string(read(read(1)[0])))
            elif op == 0x54:  # BINSTRING
                n = unpack_from("<i", read(4))[0]
                if n < 0:
                    raise malformed("BINSTRING has a negative length")
                stack.append(self._decode_py2_string(read(n)))
            elif op == 0x53:  # STRING (text, quoted)
                stack.append(self._decode_py2_string(self._parse_quoted(self._readline())))
            elif op == 0x43:  # SHORT_BINBYTES
                stack.append(read(read(1)[0]))
            elif op == 0x42:  # BINBYTES
                stack.append(read(unpack_from("<I", read(4))[0]))
            elif op == 0x8E:  # BINBYTES8
                stack.append(read(unpack_from("<Q", read(8))[0]))
            elif op == 0x96:  # BYTEARRAY8
                stack.append(bytearray(read(unpack_from("<Q", read(8))[0])))

            # ---- containers
            elif op == 0x5D:  # EMPTY_LIST
                stack.append([])
            elif op == 0x8F:  # EMPTY_SET
                self._count(3)  # an empty set is ~4 times the size of other objects
                stack.append(set())
            elif op == 0x6C:  # LIST
                items = pop_mark()
                self._count(len(items))
                stack.append(items)
            elif op == 0x64:  # DICT
                items = pop_mark()
                self._count(len(items))
                mapping: dict[Any, Any] = {}
                self._set_items(mapping, items)
                stack.append(mapping)
            elif op == 0x91:  # FROZENSET
                items = pop_mark()
                self._count(len(items))
                stack.append(frozenset(self._hashable_all(items)))
            elif op == 0x61:  # APPEND
                item = pop()
                self._count(1)
                self._extend(top(), [item])
            elif op == 0x65:  # APPENDS
                items = pop_mark()
                self._count(len(items))
                self._extend(top(), items)
            elif op == 0x90:  # ADDITEMS
                items = pop_mark()
                self._count(len(items))
                target = top()
                if not isinstance(target, set):
                    raise malformed("ADDITEMS targets something that is not a set")
                target.update(self._hashable_all(items))

            # ---- stack and memo
            elif op == 0x30:  # POP
                if stack:
                    stack.pop()
                else:
                    pop_mark()
            elif op == 0x31:  # POP_MARK
                pop_mark()
            elif op == 0x32:  # DUP
                value = top()
                if type(value) in _SHAREABLE:
                    shared = True
                    shared_at = op_start if shared_at < 0 else shared_at
                    dups += 1
                self._getattr_pushed += value is self._getattr
                stack.append(value)
            elif op == 0x94:  # MEMOIZE
                memo[len(memo)] = top()
            elif op == 0x70:  # PUT (text)
                memo[self._parse_int(self._readline())] = top()
            elif op == 0x67:  # GET (text)
                value = self._memo_get(memo, self._parse_int(self._readline()))
                if type(value) in _SHAREABLE:
                    shared = True
                    shared_at = op_start if shared_at < 0 else shared_at
                self._getattr_pushed += value is self._getattr
                stack.append(value)

            # ---- globals, calls and object building: where pickles normally run code
            elif op == 0x63:  # GLOBAL
                module = self._decode_utf8(self._readline())
                name = self._decode_utf8(self._readline())
                stack.append(self._global(module, name, op_start))
            elif op == 0x93:  # STACK_GLOBAL
                name = pop()
                module = pop()
                if not isinstance(module, str) or not isinstance(name, str):
                    raise malformed("STACK_GLOBAL names are not strings")
                stack.append(self._global(module, name, op_start))
            elif op == 0x81:  # NEWOBJ
                args = pop()
                cls = pop()
                if not isinstance(args, tuple):
                    raise malformed("NEWOBJ arguments are not a tuple")
                stack.append(self._new(cls, args, None))
            elif op == 0x92:  # NEWOBJ_EX
                kwargs = pop()
                args = pop()
                cls = pop()
                if not isinstance(args, tuple) or not isinstance(kwargs, dict):
                    raise malformed("NEWOBJ_EX arguments are not a tuple and a dict")
                stack.append(self._new(cls, args, kwargs))
            elif op == 0x69:  # INST (protocol 0)
                module = self._decode_utf8(self._readline())
                name = self._decode_utf8(self._readline())
                args = tuple(pop_mark())
                stack.append(self._new(self._global(module, name, op_start), args, None))
            elif op == 0x6F:  # OBJ (protocol 1)
                items = pop_mark()
                if not items:
                    raise malformed("OBJ has no class")
                stack.append(self._new(items[0], tuple(items[1:]), None))
            elif op == 0x62:  # BUILD
                state = pop()
                self._build(top(), state)
            elif op == 0x50:  # PERSID (text)
                stack.append(self._persistent(self._decode_utf8(self._readline())))

            # ---- features torch never writes
            elif op in (0x82, 0x83, 0x84):  # EXT1 / EXT2 / EXT4
                raise UnsupportedFormatError(
                    f"{self.source or 'the pickle'} uses the copyreg extension registry, which "
                    "torch.save never writes and which would resolve globals behind ckptconv's back; "
                    "refusing it",
                    path=self.source or None,
                )
            elif op in (0x97, 0x98):  # NEXT_BUFFER / READONLY_BUFFER
                raise UnsupportedFormatError(
                    f"{self.source or 'the pickle'} expects out-of-band buffers (pickle protocol 5), "
                    "which a file cannot carry; it is not a checkpoint",
                    path=self.source or None,
                )
            else:
                raise malformed(f"unknown pickle opcode 0x{op:02x} at byte {self.pos - 1}")

    # -- helpers ---------------------------------------------------------------------

    @staticmethod
    def _parse_int(line: bytes) -> int:
        try:
            return int(line)
        except ValueError as error:
            raise malformed("an integer opcode holds no integer") from error

    @staticmethod
    def _parse_quoted(line: bytes) -> bytes:
        if len(line) >= 2 and line[0] == line[-1] and line[:1] in (b'"', b"'"):
            try:
                return codecs.escape_decode(line[1:-1])[0]
            except ValueError as error:
                raise malformed("STRING opcode holds a bad escape") from error
        raise malformed("STRING opcode is not quoted")

    @staticmethod
    def _decode_utf8(raw: bytes) -> str:
        try:
            return raw.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as error:
            raise malformed("a pickle string is not valid UTF-8") from error

    @staticmethod
    def _decode_py2_string(raw: bytes) -> Any:
        # torch.load decodes Python 2 str as UTF-8; keep undecodable ones as bytes.
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw

    @staticmethod
    def _memo_get(memo: dict[int, Any], index: int) -> Any:
        try:
            return memo[index]
        except KeyError:
            raise malformed(f"pickle reads memo slot {index}, which was never written") from None

    @staticmethod
    def _hashable_all(items: list[Any]) -> list[Any]:
        check_hashable(items)
        return items

    def _set_items(self, target: Any, items: list[Any]) -> None:
        if len(items) % 2:
            raise malformed("SETITEMS has an odd number of items")
        if isinstance(target, ForeignObject):
            target = target.items
        if not isinstance(target, dict):
            raise malformed(f"SETITEMS targets {type(target).__name__}, not a dict")
        keys = items[0::2]
        self._hashable_all(keys)
        for key, value in zip(keys, items[1::2]):
            target[key] = value

    @staticmethod
    def _extend(target: Any, items: list[Any]) -> None:
        if isinstance(target, list):
            target.extend(items)
        elif isinstance(target, ForeignObject):
            target.list_items.extend(items)
        elif isinstance(target, set):
            target.update(Unpickler._hashable_all(items))
        else:
            raise malformed(f"APPENDS targets {type(target).__name__}, not a list")

    def _record_foreign(self, value: Any) -> Any:
        if isinstance(value, ForeignObject):
            self.foreign_globals[value.qualname] += 1
        return value

    def _called(self, function: Any, args: tuple[Any, ...]) -> Any:
        self._count_arguments(args)
        return self._charged(self._record_foreign(call(function, args)))

    def _new(self, cls: Any, args: tuple[Any, ...], kwargs: dict[Any, Any] | None) -> Any:
        self._count_arguments(args)
        return self._charged(self._record_foreign(instantiate(cls, args, kwargs)))

    def _count_arguments(self, args: tuple[Any, ...]) -> None:
        # A known callable walks its container arguments (set(items), OrderedDict(pairs)):
        # a memoised million-item list passed again and again must cost each time.
        self._count(sum(len(arg) for arg in args if isinstance(arg, _CONTAINERS)))

    def _charged(self, result: Any) -> Any:
        """Count what a call built: its items, or the bytes it copied."""
        if isinstance(result, _CONTAINERS):
            self._count(len(result))
        elif isinstance(result, (bytes, bytearray)):
            self._count_bytes(len(result))
        elif isinstance(result, ForeignObject):
            self._count(3 + len(result.items) + len(result.list_items))
        elif isinstance(result, NumpyArray) and result.tensor is not None:
            self._count_bytes(result.tensor.storage.nbytes)
        return result

    def _build(self, target: Any, state: Any) -> None:
        if isinstance(target, ForeignObject):
            if target.state is None:
                target.state = state
            elif isinstance(target.state, dict) and isinstance(state, dict):
                target.state.update(state)
            else:
                target.state = state
        elif isinstance(target, NumpyArray):
            fill_numpy_array(target, state)
            if target.tensor is not None:
                self._count_bytes(target.tensor.storage.nbytes)
        elif isinstance(target, NumpyDType):
            # (version, byteorder, subdescr, names, fields, elsize, alignment, flags)
            if isinstance(state, tuple) and len(state) >= 2 and isinstance(state[1], str):
                target.byteorder = state[1]
            if isinstance(state, tuple) and len(state) >= 4 and (state[2] is not None or state[3] is not None):
                target.descr = "V"  # structured dtype: keep opaque
        elif isinstance(target, OrderedDict):
            # torch's state_dict() carries `_metadata` (module versions) as an attribute.
            attrs = state[0] if isinstance(state, tuple) and len(state) == 2 else state
            if isinstance(attrs, dict) and all(isinstance(k, str) for k in attrs):
                # An attribute named like a method (`items`, `keys`) would hide it from
                # every later reader of this mapping.
                shadowing = sorted(k for k in attrs if hasattr(type(target), k) or k.startswith("__"))
                if shadowing:
                    raise malformed(f"OrderedDict state sets {shadowing[0][:64]!r}, which is one of its methods")
                target.__dict__.update(attrs)
            elif attrs is not None:
                raise malformed("OrderedDict state is not a dict of attributes")
        elif isinstance(target, TensorRef):
            # Attributes of tensor subclasses: nothing a state dict needs.
            return
        elif isinstance(target, (dict, list, set)):
            if state:
                raise malformed(f"BUILD sets attributes on a {type(target).__name__}")
        else:
            raise malformed(f"BUILD targets {type(target).__name__}")

    def _persistent(self, pid: Any) -> Any:
        if self.persistent_load is None:
            raise malformed("a plain pickle refers to external storage (persistent id)")
        return self.persistent_load(pid)
