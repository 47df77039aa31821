"""What counts as weights in a checkpoint's object tree, and how the tree is walked.

A checkpoint's tree holds :class:`~ckptconv.values.tensor.TensorRef` for tensors and
stand-ins for foreign objects (:mod:`ckptconv.values.standins`). This module says which
nodes are tensors, which are state dicts (names to tensors) and which are pickled
``nn.Module`` objects (and what their ``state_dict()`` would be), which entry names
hold training state, and how to step one level down: the vocabulary
:mod:`ckptconv.selection.weights`, :mod:`ckptconv.checking.inspection` and :mod:`ckptconv.writing.provenance` share.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping
from itertools import compress
from typing import Any, Union

from ckptconv._text import short_repr
from ckptconv.errors import SelectionError
from ckptconv.values.standins import ForeignObject, NumpyArray
from ckptconv.values.tensor import TensorRef

__all__ = [
    "TRAINING_STATE_NAMES",
    "PathPart",
    "as_state_dict",
    "as_tensor",
    "branches",
    "children",
    "format_path",
    "is_module",
    "is_training_state",
    "mapping_items",
    "module_state_dict",
    "part_text",
    "path_children",
]

# Entries of a training checkpoint that hold training state, never the model's weights: the
# weights search does not look inside them, and they are not kept as metadata (metadata.py).
TRAINING_STATE_NAMES = frozenset(
    {
        "optimizer",
        "optimizers",
        "optim",
        "optimizer_states",
        "optimizer_state_dict",
        "scheduler",
        "schedulers",
        "lr_scheduler",
        "lr_schedulers",
        "scaler",
        "grad_scaler",
        "amp",
        "rng",
        "rng_state",
        "rng_states",
        "numpy_rng",
        "torch_rng",
        "cuda_rng",
        "random_state",
        "loops",
    }
)
_MAX_MODULE_DEPTH = 256

PathPart = Union[str, int]


def part_text(part: Any) -> str:
    """A key as text; an integer of more digits than Python turns into text shows its size instead."""
    try:
        return str(part)
    except ValueError:  # sys.get_int_max_str_digits()
        return f"<int of {abs(part).bit_length()} bits>"


def format_path(path: tuple[PathPart, ...]) -> str:
    return ".".join(part_text(part) for part in path)


def as_tensor(value: Any) -> TensorRef | None:
    """``value`` as a lazy tensor if it is one (a tensor or a numeric numpy array)."""
    if isinstance(value, TensorRef):
        return value
    if isinstance(value, NumpyArray):
        return value.tensor
    return None


def mapping_items(value: Any) -> list[tuple[Any, Any]] | None:
    if isinstance(value, Mapping):
        return list(value.items())
    if isinstance(value, ForeignObject) and value.items and not value.list_items:
        return list(value.items.items())  # a dict subclass from foreign code (EasyDict, ...)
    return None


def as_state_dict(
    value: Any, may_nest: Callable[[str], bool] = lambda key: True
) -> tuple[dict[str, TensorRef], tuple[str, ...]] | None:
    """``(weights, skipped keys)`` if ``value`` is a state dict, else None.

    A state dict maps string keys to tensors. ``None`` values and ``*_extra_state`` entries
    (module extra state) are tolerated and skipped. A state dict that holds tensors of its own
    may also nest mappings of them, as ``{"w": ..., "head": {"w": ...}}``: they are
    flattened with dots (``head.w``), as ``torch.distributed.checkpoint`` flattens a state dict;
    taking only the nested ones would drop the others. A mapping that holds only mappings is not
    flattened: ``{"G": ..., "D": ...}`` are two sets of weights, one to pick; nor is one whose
    nested mapping's key ``may_nest`` refuses (the selection's ``state_dict``, ``ema``: a loss
    scale beside ``state_dict`` is no part of the weights).

    Raises:
        SelectionError: flattened, two tensors get one name (the key ``"head.w"`` beside ``head`` -> ``w``).
    """
    items = mapping_items(value)
    if not items or not any(as_tensor(item) is not None for _, item in items):
        return None
    weights: dict[str, TensorRef] = {}
    skipped: list[str] = []
    if not _flatten(items, "", weights, skipped, 0, may_nest):
        return None
    return weights, tuple(skipped)


_MAX_NESTING = 16


def _flatten(
    items: list[tuple[Any, Any]],
    prefix: str,
    weights: dict[str, TensorRef],
    skipped: list[str],
    depth: int,
    may_nest: Callable[[str], bool],
) -> bool:
    """Add ``items``' tensors to ``weights`` under ``prefix``; False when something in them is not weights."""
    if depth > _MAX_NESTING:
        return False
    for key, item in items:
        if not isinstance(key, str):
            return False
        # The key itself at the top: a copy of every name (f"{''}{key}" makes one) is 75 bytes a tensor (issue #31).
        name = key if not prefix and type(key) is str else f"{prefix}{key}"
        tensor = as_tensor(item)
        if tensor is not None:
            if name in weights:
                raise SelectionError(
                    f"two tensors are both named {short_repr(name)} once nested names are joined with dots; "
                    "ckptconv cannot tell them apart, so it refuses (pick the nested weights with --select)"
                )
            weights[name] = tensor
            continue
        if item is None or name.endswith("_extra_state"):
            skipped.append(name)
            continue
        nested = mapping_items(item)  # (a list of tensors stays no state dict: see the tests' mixed.pt)
        if not nested or not may_nest(key) or not _flatten(nested, f"{name}.", weights, skipped, depth + 1, may_nest):
            return False
    return True


def is_module(value: Any) -> bool:
    """True for a stand-in of a pickled ``nn.Module`` (it has ``_parameters`` and ``_modules``)."""
    if not isinstance(value, ForeignObject):
        return False
    attributes = value.attributes()
    return isinstance(attributes.get("_parameters"), Mapping) and isinstance(attributes.get("_modules"), Mapping)


def module_state_dict(module: ForeignObject) -> tuple[dict[str, TensorRef], tuple[str, ...]]:
    """What ``module.state_dict()`` would return, read from a pickled module's stand-in.

    Parameters, then persistent buffers, then each child's, depth first, exactly
    as ``nn.Module.state_dict`` orders them.
    """
    weights: dict[str, TensorRef] = {}
    skipped: list[str] = []
    visiting: set[int] = set()

    def visit(node: ForeignObject, prefix: str, depth: int) -> None:
        if depth > _MAX_MODULE_DEPTH or id(node) in visiting:
            raise SelectionError(f"module {prefix[:-1] or 'root'!r} is nested too deeply or contains itself")
        visiting.add(id(node))
        attributes = node.attributes()
        non_persistent = attributes.get("_non_persistent_buffers_set") or ()
        for group in ("_parameters", "_buffers"):
            entries = attributes.get(group)
            if not isinstance(entries, Mapping):
                continue
            for name, value in entries.items():
                if not isinstance(name, str) or value is None:
                    continue
                if (
                    group == "_buffers"
                    and isinstance(non_persistent, (set, frozenset, list))
                    and name in non_persistent
                ):
                    continue
                tensor = as_tensor(value)
                if tensor is None:
                    skipped.append(prefix + name)
                else:
                    weights[prefix + name] = tensor
        children = attributes.get("_modules")
        if isinstance(children, Mapping):
            for name, child in children.items():
                if isinstance(name, str) and is_module(child):
                    visit(child, f"{prefix}{name}.", depth + 1)
        visiting.discard(id(node))

    visit(module, "", 0)
    return weights, tuple(skipped)


def is_training_state(name: str) -> bool:
    """True for an entry name that holds training state (``optimizer``, ``lr_scheduler``, ``rng_state``...)."""
    lowered = name.lower()
    return lowered in TRAINING_STATE_NAMES or lowered.startswith(("optimizer", "optim_"))


def children(value: Any) -> list[tuple[Any, Any]]:
    """The entries one level inside ``value``: mapping items, sequence items, a stand-in's
    attributes, dict items and list items. The one walker every tree traversal uses."""
    if isinstance(value, Mapping):
        return list(value.items())
    if isinstance(value, (list, tuple)):
        return list(enumerate(value))
    if isinstance(value, ForeignObject):
        return [*value.attributes().items(), *value.items.items(), *enumerate(value.list_items)]
    return []


def path_children(value: Any) -> list[tuple[PathPart, Any]]:
    """:func:`children` whose keys can be written in a ``--select`` path."""
    return [(key, item) for key, item in children(value) if isinstance(key, (str, int))]


#: Values that hold nothing: no tensor, no weights, nothing a search for them descends into.
_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})


def branches(value: Any, *, any_key: bool = False) -> Iterator[tuple[Any, Any]]:
    """:func:`path_children` that may hold tensors, lazily: leaves (None, numbers, text) left out.

    A list of ten million small ints or Nones is 80 MB of pointers to a few shared objects; a path
    tuple and a pair for each element made every search through it take 25 times that (and the
    collector's walks over them, longer than linear). Searches go through this instead.
    ``any_key``: :func:`children` rather than :func:`path_children` (keys of any type).
    """
    if isinstance(value, (list, tuple)):
        # The test runs in C (map, compress): 30 ns an element rather than 180 in a generator.
        return compress(enumerate(value), map(operator.not_, map(_ATOMS.__contains__, map(type, value))))
    if isinstance(value, Mapping):
        return (
            (k, item)
            for k, item in value.items()
            if type(item) not in _ATOMS and (any_key or isinstance(k, (str, int)))
        )
    return ((k, item) for k, item in (children if any_key else path_children)(value) if type(item) not in _ATOMS)
