"""Paths into a checkpoint's tree: what ``--select PATH`` names (``state_dict``, ``model.ema``, ``0.weights``), resolved
one dotted part at a time, since keys may themselves hold dots."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ckptconv.errors import SelectionError
from ckptconv.selection.state_dicts import (
    PathPart,
    format_path,
    mapping_items,
    path_children,
)
from ckptconv.values.standins import ForeignObject


def _resolve(tree: Any, path_text: str, source: str) -> tuple[Any, tuple[PathPart, ...]]:
    """The value ``--select PATH`` names; a path that names two places (the key ``"a.b"`` and
    ``a`` -> ``b``, or the keys ``"0"`` and ``0``) is refused rather than guessed."""
    found = _resolutions(tree, tuple(path_text.split(".")) if path_text else (), {})
    if len(found) > 1 and found[0][0] is not found[1][0]:  # two names for one object are one place
        ways = " and ".join(" -> ".join(repr(part) for part in path) for _, path in found)
        raise SelectionError(
            f"--select {path_text!r} names two places in it: {ways}; ckptconv cannot tell which you mean, "
            f"so it refuses (run `ckptconv inspect` on {source} to see them)",
            candidates=[format_path(path) for _, path in found],
        )
    if found:
        return found[0]
    return _resolve_first(tree, path_text, source)  # raises, saying where the path stops


_Found = list[tuple[Any, tuple[PathPart, ...]]]


def _resolutions(node: Any, parts: tuple[str, ...], memo: dict[tuple[int, int], _Found]) -> _Found:
    """Up to two ways ``parts`` (the dotted path, split) lead from ``node`` to a value, with the
    path from ``node``; ``memo`` makes a file of keys like ``a``, ``a.a``, ``a.a.a`` cost no more
    than its nodes times the path's length."""
    if not parts:
        return [(node, ())]
    remembered = memo.get((id(node), len(parts)))
    if remembered is not None:
        return remembered
    memo[(id(node), len(parts))] = []  # a container that holds itself leads nowhere new
    found: _Found = []
    for key, child, length in _steps(node, parts):
        found += [(value, (key, *rest)) for value, rest in _resolutions(child, parts[length:], memo)]
        if len(found) > 1:
            break
    memo[(id(node), len(parts))] = found[:2]
    return found[:2]


def _index(text: str) -> int | None:
    """``text`` as an integer key or list index, or None (not digits, or digits ``int`` refuses: ``"²"``)."""
    if not text.isdigit():
        return None
    try:
        return int(text)
    except ValueError:  # a superscript digit, or more digits than Python converts
        return None


def _steps(node: Any, parts: Sequence[str]) -> list[tuple[PathPart, Any, int]]:
    """The ways the dotted path ``parts`` may go one step down from ``node``, longest key first:
    (the key or index, the value under it, how many parts it takes)."""
    items = mapping_items(node)
    if items is None and isinstance(node, ForeignObject):
        items = list(node.attributes().items())
    steps: list[tuple[PathPart, Any, int]] = []
    if items is not None:
        keys = dict(items)
        for length in range(len(parts), 0, -1):
            text = ".".join(parts[:length])
            if text in keys:
                steps.append((text, keys[text], length))
            number = _index(text)
            if number is not None and number in keys:
                steps.append((number, keys[number], length))
    elif isinstance(node, (list, tuple)):
        number = _index(parts[0])
        if number is not None and number < len(node):
            steps.append((number, node[number], 1))
    return steps


def _resolve_first(tree: Any, path_text: str, source: str) -> tuple[Any, tuple[PathPart, ...]]:
    node = tree
    parts = path_text.split(".") if path_text else []
    path: list[PathPart] = []
    while parts:
        steps = _steps(node, parts)
        if not steps:
            where = format_path(tuple(path))
            available = ", ".join(repr(str(k)) for k, _ in (path_children(node) or [])[:12])
            raise SelectionError(
                f"{source} has no {parts[0]!r}"
                + (f" under {where!r}" if where else "")
                + (f"; it has {available}" if available else ""),
                candidates=[str(k) for k, _ in path_children(node)],
            )
        key, node, length = steps[0]
        path.append(key)
        parts = parts[length:]
    return node, tuple(path)
