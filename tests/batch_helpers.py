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


class FolderRace:
    """Replays, whatever the workers' timing, the race of a failing item's cleanup against a sibling about
    to write into the same output folder. The batch's four items ``l.pt``, ``m/a.pt``, ``m/b.pt``, ``n.pt``
    go two by two to two workers (each is sent its running job and the next). ``m/b.pt`` (key ``f``) runs
    first on its worker, makes ``m``, waits until ``m/a.pt`` (key ``w``) is past making its folders, and
    fails; ``w`` then waits (``patience`` seconds at most) for ``m`` to disappear before it writes; ``l.pt``
    (key ``l``) holds its worker until ``f`` is running, so ``w`` starts after ``f`` made ``m``."""

    def __init__(self, markers: str, folder: str, patience: float = 3.0) -> None:
        self.markers, self.folder, self.patience = markers, folder, patience

    def _mark(self, name: str) -> None:
        with open(os.path.join(self.markers, name), "w"):
            pass

    def _seen(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.markers, name))

    @staticmethod
    def _wait(done: Any, seconds: float) -> None:
        import time

        deadline = time.monotonic() + seconds
        while not done() and time.monotonic() < deadline:
            time.sleep(0.01)

    def apply(self, state: Mapping[str, Any]) -> Any:
        if "f" in state:
            self._mark("f")
            self._wait(lambda: self._seen("w"), 30)
            raise RuntimeError("boom")
        if "w" in state:
            self._mark("w")
            self._wait(lambda: not os.path.isdir(self.folder), self.patience)
        if "l" in state:
            self._wait(lambda: self._seen("f"), 30)
        from ckptconv.transforms.keys import StepReport

        return dict(state), StepReport(self.describe(), changed=0, unchanged=len(state))

    def describe(self) -> str:
        return "race a sibling's cleanup"


class KillAfter:
    """A transform that SIGKILLs the process running it (the batch process itself, with one job) once the
    manifest ``manifest`` records ``done`` items, once (``markers/killed``): the run that follows goes through.
    Its description never changes, so a ``--resume`` with it finds the same options."""

    def __init__(self, markers: str, manifest: str, done: int) -> None:
        self.markers, self.manifest, self.done = markers, manifest, done

    def apply(self, state: Mapping[str, Any]) -> Any:
        killed = os.path.join(self.markers, "killed")
        if os.path.exists(self.manifest) and not os.path.exists(killed):
            with open(self.manifest, "rb") as file:
                recorded = file.read().count(b'"record":"item"')
            if recorded >= self.done:
                with open(killed, "w"):
                    pass
                os.kill(os.getpid(), signal.SIGKILL)
        from ckptconv.transforms.keys import StripPrefix

        return StripPrefix("no_key_has_this_prefix").apply(state)  # no change, and the report that says so

    def describe(self) -> str:
        return "kill after some items, once"
