"""Every error ckptconv raises on purpose.

One base class, one subclass per stage of the data flow, and a leaf only where
a caller would handle it differently::

    CkptconvError
    ├── LoadError                       the input could not be read
    │   ├── UnsupportedFormatError      not a checkpoint we can read (TorchScript, HTML, empty, ...)
    │   │   └── UnsupportedQuantizationError  quantized with a scheme ckptconv cannot dequantize exactly
    │   ├── MalformedCheckpointError    a checkpoint, but broken (truncated, inconsistent)
    │   │   └── InvalidConfigError (ValueError)  its config.json (or a --like base's) fails the config schema
    │   └── UnsafeCheckpointError       the file reaches for code-running callables
    ├── SelectionError (KeyError)       the weights inside a checkpoint could not be picked
    │   └── TrainingStateError          the file holds training state (optimizer, RNG ...), not weights
    ├── TransformError (ValueError)     a key or dtype transform cannot be applied
    │   ├── KeyCollisionError           two keys would end up with one name
    │   ├── CastOverflowError           a cast would turn finite values into inf
    │   └── FitError                    no key transform makes a checkpoint fit its reference
    ├── WriteError (OSError)            the output could not be written
    │   ├── OutputExistsError (FileExistsError)
    │   └── DestinationError (ValueError)   the destination contradicts the options (a usage error)
    ├── VerifyError                     the output does not match its source
    ├── DeviceError (ValueError)        a device ckptconv cannot load onto ("best", "cuda" without a GPU)
    └── MissingDependencyError (ImportError)  an optional extra is not installed (torch: ckptconv[torch])

``str(error)`` is one sentence that says what failed and what to do next; the
details ride on attributes (``path``, ``key``, ``globals`` ...), so the CLI can
print the message alone and library callers can inspect the rest.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CastOverflowError",
    "CkptconvError",
    "DestinationError",
    "DeviceError",
    "FitError",
    "InvalidConfigError",
    "KeyCollisionError",
    "LoadError",
    "MalformedCheckpointError",
    "MissingDependencyError",
    "OutputExistsError",
    "SelectionError",
    "TrainingStateError",
    "TransformError",
    "UnsafeCheckpointError",
    "UnsupportedFormatError",
    "UnsupportedQuantizationError",
    "VerifyError",
    "WriteError",
]


class CkptconvError(Exception):
    """Base class of every error ckptconv raises deliberately."""

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.path = os.fspath(path) if path is not None else None

    def __str__(self) -> str:
        return self.message


class LoadError(CkptconvError):
    """The input could not be read as a checkpoint."""


class UnsupportedFormatError(LoadError):
    """The input is not in a format ckptconv can read (and says which one it is)."""


class UnsupportedQuantizationError(UnsupportedFormatError):
    """The checkpoint is quantized with a scheme ckptconv cannot dequantize exactly (or declares none for its scales).

    ``scheme`` names the scheme; ``key`` the tensor that gave it away, when a tensor did.
    """

    def __init__(self, message: str, *, scheme: str, key: str | None = None) -> None:
        super().__init__(message)
        self.scheme = scheme
        self.key = key


class MalformedCheckpointError(LoadError):
    """The input looks like a checkpoint but is truncated or internally inconsistent."""


class InvalidConfigError(MalformedCheckpointError, ValueError):
    """A model's ``config.json`` is not JSON, or a field ckptconv reads has the wrong type, is out of range or
    disagrees with the tensors present. ``field`` names the field, when one is to blame; ``inspect`` describes
    such a config as invalid rather than failing."""

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None, field: str | None = None) -> None:
        super().__init__(message, path=path)
        self.field = field


class UnsafeCheckpointError(LoadError):
    """The input names callables that exist to run code (``os.system``, ``builtins.eval`` ...).

    ckptconv never calls anything named in a checkpoint, so refusing is a warning
    rather than the safety boundary: a file that reaches for these was made to
    attack whoever opens it.
    """

    def __init__(
        self, message: str, *, path: str | os.PathLike[str] | None = None, globals: Sequence[str] = ()
    ) -> None:
        super().__init__(message, path=path)
        self.globals = tuple(globals)


class SelectionError(CkptconvError, KeyError):
    """The model weights inside a checkpoint could not be picked unambiguously.

    ``reason`` is the message without its advice (``hint``), for callers such as
    ``inspect`` whose output already is what the advice points to.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        candidates: Sequence[str] = (),
        hint: str = "",
    ) -> None:
        super().__init__(f"{message}; {hint}" if hint else message, path=path)
        self.candidates = tuple(candidates)
        self.reason = message

    # KeyError's own __str__ would wrap the message in quotes.
    __str__ = CkptconvError.__str__


class TrainingStateError(SelectionError):
    """The file holds training state (an optimizer's, a scheduler's, RNG state, trainer arguments), not weights:
    a batch counts it as skipped, not failed. ``what`` names the state (``"optimizer state (Adam moments)"``)."""

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None, what: str = "") -> None:
        super().__init__(message, path=path)
        self.what = what


class TransformError(CkptconvError, ValueError):
    """A key or dtype transform cannot be applied to this state dict."""


class KeyCollisionError(TransformError):
    """A transform would give two different tensors the same key."""

    def __init__(self, message: str, *, keys: Sequence[str] = (), new_key: str = "") -> None:
        super().__init__(message)
        self.keys = tuple(keys)
        self.new_key = new_key


class CastOverflowError(TransformError):
    """Casting would turn finite values into infinities (e.g. 70000.0 to fp16)."""

    def __init__(self, message: str, *, key: str = "", count: int = 0) -> None:
        super().__init__(message)
        self.key = key
        self.count = count


class FitError(TransformError):
    """No key transform makes the checkpoint match the reference model; ``report`` says why."""

    def __init__(self, message: str, *, report: Any = None) -> None:
        super().__init__(message)
        self.report = report


class WriteError(CkptconvError, OSError):
    """The output could not be written; nothing was left behind."""

    __str__ = CkptconvError.__str__


class OutputExistsError(WriteError, FileExistsError):
    """The destination exists and ``overwrite`` was not given."""

    __str__ = CkptconvError.__str__


class DestinationError(WriteError, ValueError):
    """The destination contradicts the options: a suffix of another format, a file name for a folder.

    A usage error: nothing was read or written, and the message says what to write instead
    (the CLI exits 2).
    """

    __str__ = CkptconvError.__str__


class VerifyError(CkptconvError):
    """The output does not hold what its source and transforms promise."""


class DeviceError(CkptconvError, ValueError):
    """A device that tensors cannot be loaded onto: a spelling ckptconv does not take (``"best"``), or a GPU
    this process does not have. The message lists the spellings it takes."""


class MissingDependencyError(CkptconvError, ImportError):
    """An optional dependency is not installed: torch, for torch tensors (``load``, GPU loads, ``--like
    module:factory``, ``--verify=torch``, ``--trust``); ``extra`` names the extra that installs it."""

    def __init__(self, message: str, *, extra: str) -> None:
        super().__init__(message)
        self.extra = extra


def interruption(error: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM that ``error`` was raised while handling, if any.

    An error raised while an interruption unwinds the work (a reader thread's read of a file the
    unwinding closed: EBADF) is a consequence of the interruption, not a failure of its own.
    """
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None
