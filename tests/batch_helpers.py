"""Transforms that misbehave, for the batch tests' workers.

They live here, apart from the test module, because worker processes must
import them to unpickle a job: this module imports nothing heavy.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from typing import Any


class Explode:
    """A transform with a bug: workers must turn it into a failed result."""

    def apply(self, state: Mapping[str, Any]) -> Any:
        raise RuntimeError("boom")

    def describe(self) -> str:
        return "explode"


class KillWorker:
    """A transform that kills the process running it, as the OOM killer would."""

    def apply(self, state: Mapping[str, Any]) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)

    def describe(self) -> str:
        return "kill the worker"
