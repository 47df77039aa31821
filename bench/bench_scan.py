"""Compare ``ckptconv scan`` with picklescan, modelscan and fickling on one labelled corpus.

The corpus is ``tests/scan_corpus.py`` (our own generators for every attack
class the three scanners' public test suites cover, labelled as those suites
label them) plus every real checkpoint under ``fixtures/`` (``fixtures/gpu``
included) as benign controls. Each scanner that is installed runs on every
file, side by side, in this process; none of them unpickles anything.

What counts as *flagged*:

* ckptconv scan: verdict ``unsafe``; ``refused`` counts the other refusals
  (``damaged``, ``not-a-checkpoint``, ``unreadable``), which ``convert`` and
  ``open`` also refuse; ``foreign`` is reported apart (harmless to ckptconv,
  imported by ``torch.load(weights_only=False)``).
* ckptconv convert/inspect: ``ckptconv.open`` (what every other command calls first) raises
  ``UnsafeCheckpointError`` (flagged) or another ``LoadError`` (refused).
* picklescan: ``scan_file_path(...).infected_files > 0``; a ``scan_err`` is an error.
* modelscan: ``ModelScan().scan(path)`` reports at least one issue; errors as it lists them.
* fickling: ``fickling.is_likely_safe(path)`` is False; an exception is an error.

Run (the scanners are optional, for the comparison only)::

    pip install picklescan modelscan fickling
    PYTHONPATH=$PWD python bench/bench_scan.py [--markdown bench/results/scan.md]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.scan_corpus import build_corpus

_FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures")
_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".ckpt", ".safetensors", ".tar")


def _ckptconv(path: str) -> str:
    import ckptconv

    verdict = ckptconv.scan(path).verdict
    if verdict == "unsafe":
        return "flagged"
    if verdict in ("damaged", "not-a-checkpoint", "unreadable"):
        return "refused"
    return "foreign" if verdict == "foreign" else "clean"


def _ckptconv_open(path: str) -> str:
    """What ``convert``/``inspect`` do: ``ckptconv.open`` refuses, or reads the file."""
    import ckptconv

    try:
        checkpoint = ckptconv.open(path)
    except ckptconv.UnsafeCheckpointError:
        return "flagged"
    except ckptconv.LoadError:
        return "refused"
    return "foreign" if checkpoint.foreign_globals else "clean"


def _picklescan(path: str) -> str:
    from picklescan.scanner import scan_file_path

    result = scan_file_path(path)
    if result.infected_files:
        return "flagged"
    return "error" if result.scan_err else "clean"


def _modelscan(path: str) -> str:
    from modelscan.modelscan import ModelScan

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        result = ModelScan().scan(path)
    if result.get("issues"):
        return "flagged"
    return "error" if result.get("errors") else "clean"


def _fickling(path: str) -> str:
    import fickling

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return "clean" if fickling.is_likely_safe(path) else "flagged"


def _available(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


SCANNERS: dict[str, tuple[str, Callable[[str], str]]] = {
    "ckptconv scan": ("ckptconv", _ckptconv),
    "ckptconv convert/inspect (open)": ("ckptconv", _ckptconv_open),
    "picklescan": ("picklescan", _picklescan),
    "modelscan": ("modelscan", _modelscan),
    "fickling": ("fickling", _fickling),
}


def _fixture_files() -> list[str]:
    found = []
    for folder, _subfolders, names in os.walk(_FIXTURES):
        for name in sorted(names):
            if name.endswith(_SUFFIXES):
                found.append(os.path.join(folder, name))
    return sorted(found)


def run(markdown: str | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        corpus = build_corpus(os.path.join(folder, "corpus"))
        files = [(sample.label, sample.source, sample.name, path) for sample, path in corpus]
        files += [("benign", "fixtures", os.path.relpath(path, _FIXTURES), path) for path in _fixture_files()]
        totals = Counter(label for label, *_ in files)
        rows = []
        misses: dict[str, list[str]] = {}
        false_alarms: dict[str, list[str]] = {}
        for title, (module, function) in SCANNERS.items():
            if not _available(module):
                print(f"{title}: not installed, skipped", file=sys.stderr)
                continue
            outcome: Counter[tuple[str, str]] = Counter()
            started = time.perf_counter()
            for label, _source, name, path in files:
                try:
                    result = function(path)
                except Exception as error:  # a scanner that crashes on a file: an error for that file
                    result = "error"
                    print(f"{title}: {name}: {type(error).__name__}: {error}"[:200], file=sys.stderr)
                outcome[label, result] += 1
                if label == "malicious" and result not in ("flagged", "refused"):
                    misses.setdefault(title, []).append(name)
                if label == "benign" and result == "flagged":
                    false_alarms.setdefault(title, []).append(name)
            elapsed = time.perf_counter() - started
            rows.append((title, outcome, elapsed))
    lines = [
        f"Corpus: {totals['malicious']} malicious, {totals['benign']} benign "
        f"({sum(1 for f in files if f[1] == 'fixtures')} of them real checkpoints from fixtures/), "
        f"{totals['broken']} broken.",
        "",
        "| scanner | malicious flagged | malicious refused otherwise | malicious missed | benign flagged | "
        "benign foreign | broken flagged or refused | errors | seconds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for title, outcome, elapsed in rows:
        mal = totals["malicious"]
        flagged = outcome["malicious", "flagged"]
        refused = outcome["malicious", "refused"]
        lines.append(
            f"| {title} | {flagged} / {mal} | {refused} | {mal - flagged - refused} | "
            f"{outcome['benign', 'flagged']} / {totals['benign']} | {outcome['benign', 'foreign']} | "
            f"{outcome['broken', 'flagged'] + outcome['broken', 'refused']} / {totals['broken']} | "
            f"{sum(count for (_label, result), count in outcome.items() if result == 'error')} | {elapsed:.1f} |"
        )
    text = "\n".join(lines)
    print(text)
    for title, names in misses.items():
        print(f"\n{title} missed: {', '.join(names)}")
    for title, names in false_alarms.items():
        print(f"\n{title} flagged benign: {', '.join(names)}")
    if markdown:
        with open(markdown, "w") as file:
            file.write(text + "\n")
            for title, names in misses.items():
                file.write(f"\n{title} missed ({len(names)}): {', '.join(names)}\n")
            for title, names in false_alarms.items():
                file.write(f"\n{title} flagged benign ({len(names)}): {', '.join(names)}\n")
    return {"totals": totals, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args()
    run(args.markdown)


if __name__ == "__main__":
    main()
