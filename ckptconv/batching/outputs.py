"""Output names: where each discovered item's output goes, mirroring the input tree.

This is the other half of planning :func:`ckptconv.batch` (no tensor is read, no torch is
imported): :func:`ckptconv.reading.discovery.discover` finds the items, :func:`plan_outputs`
names their outputs.

Output names: the item's relative path, minus its checkpoint suffix, plus the
suffix of the output format (``a/b/model.pth`` -> ``a/b/model.safetensors``,
``hf/model.safetensors.index.json`` -> ``hf/model.safetensors``,
``run/dcp/`` -> ``run/dcp.safetensors``). A model folder (``hf/``: weights beside a ``config.json``) gives a
model folder of the same name (``hf/``: ``model.safetensors`` or shards and their index, its configs and
tokenizer carried), as ``ckptconv convert hf out/hf/`` writes it. When two items would get the same
output (``x.pt`` and ``x.pth``), *all* of them keep their full name instead
(``x.pt.safetensors``, ``x.pth.safetensors``), so the rule never depends on
which one is seen first; items that still collide are not converted and say so.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from ckptconv.reading.discovery import MODEL, SHARDED, Item
from ckptconv.suffixes import CHECKPOINT_SUFFIXES, INDEX_SUFFIX, SAFETENSORS_SUFFIX, TAR_SUFFIX

__all__ = ["Planned", "folds_case", "output_name", "plan_outputs"]

_STRIPPED_SUFFIXES = (*CHECKPOINT_SUFFIXES, TAR_SUFFIX)
_OUTPUT_SUFFIX = {"safetensors": SAFETENSORS_SUFFIX, "pt": ".pt"}


@dataclass(frozen=True)
class Planned:
    """An item and where its output goes.

    Attributes:
        item: the input.
        output: the output path relative to the output folder (``/``-separated).
        problem: why it cannot be converted (an output name collision), else ``""``.
    """

    item: Item
    output: str
    problem: str = ""


def output_name(item: Item, format: str, *, full: bool = False) -> str:
    """The output's path relative to the output folder (see the module docstring); a model folder's ends in ``/``.

    Args:
        item: the input.
        format: ``"safetensors"`` or ``"pt"``.
        full: keep the item's whole name and add the suffix (the collision rule).
    """
    base = item.name
    if item.kind == MODEL:
        return base + "/"  # a model folder out, its files named as transformers names them
    if item.kind == SHARDED and base.endswith(INDEX_SUFFIX):
        base = base[: -len(INDEX_SUFFIX)]
    if not full:
        lowered = base.lower()
        for suffix in _STRIPPED_SUFFIXES:
            if lowered.endswith(suffix) and len(base) > len(suffix) and base[-len(suffix) - 1] != "/":
                base = base[: -len(suffix)]
                break
    return base + _OUTPUT_SUFFIX[format]


def folds_case(path: str) -> bool:
    """Whether the file system that holds ``path`` (or would: its nearest existing folder) takes names
    that differ only in case for one file (macOS and Windows by default).

    Asked of the nearest existing folder whose name has letters: its name in the other case must
    lead to the same folder. With no such folder, the platform's default is assumed.
    """
    current = os.path.abspath(path)
    while True:
        name = os.path.basename(current)
        parent = os.path.dirname(current)
        if os.path.isdir(current) and name.swapcase() != name:
            other = os.path.join(parent, name.swapcase())
            try:
                return os.path.samefile(current, other)
            except OSError:
                return False
        if parent == current:
            return sys.platform in ("darwin", "win32")
        current = parent


def plan_outputs(items: Sequence[Item], format: str, *, fold_case: bool = False) -> list[Planned]:
    """Give every item its output path, resolving collisions deterministically.

    Args:
        items: from :func:`discover`.
        format: ``"safetensors"`` or ``"pt"``.
        fold_case: names that differ only in case are one file where the outputs go
            (:func:`folds_case`), so they collide too.

    Returns:
        One :class:`Planned` per item, in the same order.

    Example:
        >>> [p.output for p in plan_outputs(discover("zoo"), "safetensors")]  # doctest: +SKIP
        ['a/x.pt.safetensors', 'a/x.pth.safetensors', 'b/model.safetensors']
    """

    def same(name: str) -> str:
        return name.casefold() if fold_case else name

    names = [output_name(item, format) for item in items]
    by_name: dict[str, list[int]] = defaultdict(list)
    for index, name in enumerate(names):
        by_name[same(name)].append(index)
    for indices in by_name.values():
        if len(indices) > 1:
            for index in indices:
                names[index] = output_name(items[index], format, full=True)
    final: dict[str, list[int]] = defaultdict(list)
    for index, name in enumerate(names):
        final[same(name)].append(index)
    planned = []
    for index, (item, name) in enumerate(zip(items, names)):
        problem = ""
        clash = [items[other].name for other in final[same(name)] if other != index]
        if clash:
            where = (
                " (names that differ only in case are one file in the output folder)"
                if any(names[other] != name for other in final[same(name)])
                else ""
            )
            problem = (
                f"{item.name!r} and {', '.join(repr(c) for c in clash)} would all be written to {name!r}{where}; "
                "rename one of them, or leave it out with --glob"
            )
        planned.append(Planned(item, name, problem))
    return planned
