"""Fault injection for the tests: a named point before every step that writes or removes a file of an output.

:func:`point` does nothing unless a test set :data:`hook` (a callable given the step's name, which may raise
``OSError(ENOSPC)``, pause, or record the steps), so the writers cost one comparison per step otherwise. The tests
enumerate every step of a model-folder write and fail each one in turn, as SQLite's do (``tests/test_transaction.py``).
"""

from __future__ import annotations

from typing import Callable

__all__ = ["hook", "point"]

#: Called with each step's name before the step runs; None outside the tests.
hook: Callable[[str], None] | None = None


def point(step: str) -> None:
    """The step ``step`` is about to write or remove something: the test's hook, if any, runs first."""
    if hook is not None:
        hook(step)
