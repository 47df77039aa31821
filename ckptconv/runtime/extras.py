"""The optional extras this process has: torch, which ``pip install ckptconv`` leaves out.

Reading, converting, casting, scanning and inspecting never need torch (ckptconv reads the files
itself); torch tensors do: :func:`ckptconv.load`, GPU loads, ``--like module:factory`` (the user's
model), ``--verify=torch`` and ``--trust`` (torch's own readers). Each asks :func:`require_torch`
first, so a missing torch is one line that names the extra, never a ``ModuleNotFoundError`` from
deep inside.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ckptconv.errors import MissingDependencyError

__all__ = ["TORCH_EXTRA", "require_torch"]

TORCH_EXTRA = "pip install 'ckptconv[torch]'"


def require_torch(what: str) -> ModuleType:
    """torch, or a :class:`~ckptconv.errors.MissingDependencyError` saying that ``what`` needs it.

    Example:
        >>> require_torch("ckptconv.load()")  # doctest: +SKIP
        MissingDependencyError: ckptconv.load() needs torch: pip install 'ckptconv[torch]'
    """
    try:
        return importlib.import_module("torch")
    except ImportError:
        raise MissingDependencyError(f"{what} needs torch: {TORCH_EXTRA}", extra="torch") from None
