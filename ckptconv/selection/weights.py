"""Select: find the model weights inside whatever a checkpoint holds.

A checkpoint is a state dict, or a training checkpoint that nests one beside
optimizer state, EMA copies and hyperparameters, or a whole pickled module.
:func:`select_weights` finds the weights with a documented search order:

1. The file itself, if it is a state dict (a mapping of names to tensors, which
   may nest mappings of tensors beside its own: ``head`` -> ``w`` is ``head.w``), or
   a single bare tensor (``torch.save(t)``), which is named ``"tensor"``.
2. A whole pickled ``nn.Module`` (``torch.save(model)``): its parameters and
   persistent buffers, named as ``model.state_dict()`` would name them.
3. Otherwise every state dict or module nested up to five levels deep,
   skipping optimizer, scheduler and RNG state, ranked by the key they sit
   under: ``state_dict``, ``model_state_dict``, ``model_state``, ``model``,
   ``module``, ``net``, ``network``, ``weights``, ``params`` (in that order;
   nested ones such as ``model`` → ``state_dict`` count under their top key).
   With none of those, a single candidate is taken and several are an error
   that lists them.
5. With no state dict anywhere, a mapping that holds tensors beside plain
   values (``{"fc.weight": ..., "epoch": 3}``) gives its tensors; the plain
   values are left out and counted (``skipped``). Only when none of those
   values holds a tensor, so that no weight is dropped, and only when one
   such mapping exists.
4. EMA / averaged copies (``state_dict_ema``, ``model_ema``, ``ema``,
   ``params_ema``, ``shadow``, SWA ...) are never preferred: they are picked
   only when they are the only weights, and the selection's ``note`` always
   names them so the caller can say which copy was used.

When the search picks the weights, the tensors it leaves out (outside the
chosen weights, not training state, not 0-dim counters) are counted in the
selection's ``note``, so a tensor is never dropped without a word.

An explicit ``select="state_dict_ema"`` (a dotted path; keys that contain dots
are matched whole) or ``select="ema"`` overrides the search. What it names is
taken whole, or searched as above with the tensors left out named; a mapping
with tensors of its own beside more it cannot take (a list of them) is refused.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Callable

from ckptconv._text import plural, short_repr
from ckptconv.errors import SelectionError, TrainingStateError
from ckptconv.runtime.collector import collector_paused
from ckptconv.selection.paths import _resolve
from ckptconv.selection.state_dicts import (
    PathPart,
    as_state_dict,
    as_tensor,
    branches,
    children,
    format_path,
    is_module,
    is_training_state,
    mapping_items,
    module_state_dict,
    path_children,
)
from ckptconv.selection.training_state import training_state
from ckptconv.values.standins import ForeignObject
from ckptconv.values.tensor import TensorRef

__all__ = [
    "BARE_TENSOR_KEY",
    "LIT_EMA_MARKER",
    "Selection",
    "lit_ema_weights",
    "select_weights",
]

PRIMARY_KEYS = (
    "state_dict",
    "model_state_dict",
    "model_state",
    "model",
    "module",
    "net",
    "network",
    "weights",
    "params",
)
# The key a file holding one bare tensor (``torch.save(t, "t.pt")``) is written under.
BARE_TENSOR_KEY = "tensor"
_EMA_TOKENS = frozenset({"ema", "shadow", "swa", "averaged", "avg"})
_MAX_DEPTH = 5


@dataclass(frozen=True)
class Selection:
    """The weights picked from a checkpoint.

    Attributes:
        weights: names to lazy tensors, in the checkpoint's order.
        path: where they were found, e.g. ``("state_dict",)``; ``()`` for the file itself.
        kind: ``"state_dict"``, ``"module"`` (a whole pickled ``nn.Module``) or ``"tensor"``
            (the file is one bare tensor, named :data:`BARE_TENSOR_KEY`).
        alternatives: other places that hold weights, e.g. ``("state_dict_ema (EMA)",)``.
        skipped: keys of non-tensor entries left out of ``weights``.
        note: one sentence for the user when the choice deserves a mention, else "".
    """

    weights: dict[str, TensorRef]
    path: tuple[PathPart, ...] = ()
    kind: str = "state_dict"
    alternatives: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    note: str = ""
    is_ema: bool = False

    @property
    def where(self) -> str:
        """The path as text (``"state_dict"``, ``"model.state_dict"``), ``""`` for the whole file."""
        return format_path(self.path)


@dataclass(frozen=True)
class _Candidate:
    path: tuple[PathPart, ...]
    weights: dict[str, TensorRef] = field(repr=False)
    skipped: tuple[str, ...]
    kind: str

    @property
    def is_ema(self) -> bool:
        return any(_is_ema_name(part) for part in self.path if isinstance(part, str))

    @property
    def label(self) -> str:
        text = format_path(self.path) or "(the whole file)"
        return f"{text} (EMA)" if self.is_ema else text


def _tokens(name: str) -> set[str]:
    return {token for token in re.split(r"[^a-z0-9]+", name.lower()) if token}


def _is_ema_name(name: str) -> bool:
    return bool(_tokens(name) & _EMA_TOKENS)


def _may_nest(key: str) -> bool:
    """Whether a state dict's nested mapping under ``key`` is part of it, flattened: not when the key
    names weights of their own (``state_dict``, ``model``, an EMA copy) or training state."""
    return key not in PRIMARY_KEYS and not _is_ema_name(key) and not is_training_state(key)


def _as_candidate(value: Any, path: tuple[PathPart, ...]) -> _Candidate | None:
    found = as_state_dict(value, _may_nest)
    if found is not None:
        return _Candidate(path, found[0], found[1], "state_dict")
    if is_module(value):
        weights, skipped = module_state_dict(value)
        if weights:
            return _Candidate(path, weights, skipped, "module")
    return None


def _candidates(
    root: Any,
    base: tuple[PathPart, ...],
    recognise: Callable[[Any, tuple[PathPart, ...]], _Candidate | None] = _as_candidate,
) -> list[_Candidate]:
    """Every node up to :data:`_MAX_DEPTH` levels under ``root`` that ``recognise`` takes for weights,
    breadth first, not looking inside training state or inside what it took."""
    found: list[_Candidate] = []
    seen: set[int] = set()
    level: list[tuple[tuple[PathPart, ...], Any]] = [(base, root)]
    for _depth in range(_MAX_DEPTH + 1):
        next_level: list[tuple[tuple[PathPart, ...], Any]] = []
        for path, value in level:
            if id(value) in seen:
                continue
            seen.add(id(value))
            candidate = recognise(value, path)
            if candidate is not None:
                found.append(candidate)
                continue
            for key, child in branches(value):
                if isinstance(key, str) and is_training_state(key):
                    continue
                next_level.append(((*path, key), child))
        level = next_level
    return found


def _holds_tensor(value: Any, limit: int = 10_000) -> bool:
    """True if a tensor (or a stand-in of one ckptconv cannot read) sits anywhere inside ``value``."""
    seen: set[int] = set()
    queue = [value]
    while queue and len(seen) < limit:
        node = queue.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if as_tensor(node) is not None or (isinstance(node, ForeignObject) and node.qualname in _UNSUPPORTED_TENSORS):
            return True
        queue.extend(child for _, child in islice(branches(node, any_key=True), limit))
    return len(seen) >= limit  # too large to tell: treat as holding one, so nothing is dropped unseen


def _as_loose_candidate(value: Any, path: tuple[PathPart, ...]) -> _Candidate | None:
    """A mapping of names to tensors beside plain values (``{"w": ..., "epoch": 3}``): its tensors,
    with the other keys skipped, provided none of those holds a tensor."""
    items = mapping_items(value)
    if not items or not all(isinstance(key, str) for key, _ in items):
        return None
    weights = {key: tensor for key, item in items if (tensor := as_tensor(item)) is not None}
    others = [(key, item) for key, item in items if key not in weights]
    if not weights or any(_holds_tensor(item) for _, item in others):
        return None
    return _Candidate(path, weights, tuple(key for key, _ in others), "state_dict")


def _left_out(root: Any, chosen: tuple[PathPart, ...], limit: int = 100_000) -> list[str]:
    """Paths of the tensors under ``root`` outside the weights at ``chosen``: not training state, not in
    another set of weights (the selection names those), and not 0-dim (step counters, best scores),
    which no one expects among the weights."""
    chosen_node: Any = root
    for part in chosen:
        chosen_node = dict(children(chosen_node)).get(part)
    found: list[str] = []
    seen: set[int] = {id(chosen_node)} if chosen else set()
    queue: list[tuple[tuple[PathPart, ...], Any]] = [((), root)]
    while queue and len(seen) < limit:
        path, value = queue.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        tensor = as_tensor(value)
        if tensor is not None:
            if tensor.shape:
                found.append(format_path(path))
            continue
        if path and _as_candidate(value, path) is not None:
            continue
        queue.extend(
            ((*path, key), child)
            for key, child in islice(branches(value), limit)
            if not (isinstance(key, str) and is_training_state(key))
        )
    return sorted(found)


def _primary_rank(candidate: _Candidate, base: int) -> int | None:
    if len(candidate.path) <= base:
        return None
    first = candidate.path[base]
    return PRIMARY_KEYS.index(first) if isinstance(first, str) and first in PRIMARY_KEYS else None


def _holds_shards(root: Any) -> bool:
    """True if the tree holds stand-ins of distributed tensor shards (DTensor, ShardedTensor)."""
    for _path, child in path_children(root):
        if isinstance(child, ForeignObject) and child.qualname.endswith(("DTensor", "ShardedTensor")):
            return True
    return False


# Tensors torch pickles through functions of their own, which ckptconv does not rebuild: they
# stay inert stand-ins, so a state dict holding one is no state dict of plain tensors.
_UNSUPPORTED_TENSORS = {
    "torch._utils._rebuild_sparse_tensor": "sparse",
    "torch._utils._rebuild_sparse_csr_tensor": "sparse",
    "torch._utils._rebuild_nested_tensor": "nested",
    "torch._utils._rebuild_wrapper_subclass": "tensor-subclass",
    "torch._utils._rebuild_mkldnn_tensor": "MKL-DNN",
    "torch._utils._rebuild_meta_tensor_no_storage": "meta-device",
}
_HINTS = {
    "sparse": "make them dense (tensor.to_dense())",
    "nested": "unbind them into ordinary tensors (tensor.unbind())",
    "meta-device": "materialise them (model.to_empty(device='cpu'), then load the real weights)",
}


def _unsupported_tensors(root: Any, base: tuple[PathPart, ...], limit: int = 100_000) -> dict[str, list[str]]:
    """Kinds of tensors ckptconv cannot read found under ``root``, with the paths of a few of each."""
    found: dict[str, list[str]] = {}
    seen: set[int] = set()
    queue: list[tuple[tuple[PathPart, ...], Any]] = [(base, root)]
    while queue and len(seen) < limit:
        path, value = queue.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, ForeignObject):
            kind = _UNSUPPORTED_TENSORS.get(value.qualname)
            if kind is not None:
                found.setdefault(kind, []).append(format_path(path))
                continue
        queue.extend(((*path, key), child) for key, child in islice(branches(value), limit))
    return found


def _packed_params(root: Any, depth: int = 3) -> list[str]:
    """The names of torch.ao quantized Linears' packed parameters (``fc._packed_params._packed_params``, a
    (weight, bias) tuple: ``torch.ao.nn.quantized.modules.linear.LinearPackedParams._save_to_state_dict``) in the
    mappings of the tree's first ``depth`` levels."""
    found: list[str] = []
    level: list[tuple[str, Any]] = [("", root)]
    for _ in range(depth):
        deeper: list[tuple[str, Any]] = []
        for prefix, value in level:
            for key, child in mapping_items(value) or ():
                name = f"{prefix}{key}"
                if isinstance(key, str) and key.endswith("_packed_params._packed_params") and isinstance(child, tuple):
                    found.append(name)
                elif mapping_items(child):
                    deeper.append((name + ".", child))
        level = deeper
    return found


def _choose(candidates: list[_Candidate], base: tuple[PathPart, ...], source: str, root: Any = None) -> Selection:
    if not candidates:
        where = f" under {format_path(base)!r}" if base else ""
        unsupported = _unsupported_tensors(root, base) if root is not None else {}
        if unsupported:
            kinds = sorted(unsupported)
            examples = ", ".join(repr(path) for kind in kinds for path in sorted(unsupported[kind])[:2])
            hints = "; ".join(_HINTS[kind] for kind in kinds if kind in _HINTS) or "make them ordinary dense tensors"
            raise SelectionError(
                f"{source} holds {' and '.join(kinds)} tensors ({examples}), which ckptconv cannot convert; "
                f"{hints} with torch and save again"
            )
        if _holds_shards(root):
            raise SelectionError(
                f"{source} holds DTensor/ShardedTensor shards: one rank's part of an FSDP or tensor-parallel "
                "model, not whole weights; convert the DCP checkpoint folder, or save a full state dict "
                "(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))"
            )
        loose = _candidates(root, base, _as_loose_candidate) if root is not None else []
        if len(loose) == 1:
            (only,) = loose
            return Selection(only.weights, only.path, only.kind, (), only.skipped)
        if len(loose) > 1:
            _ambiguous(loose, source)
        packed = _packed_params(root)
        if packed:
            raise SelectionError(
                f"{source} holds a torch.ao quantized model's state dict: {plural(len(packed), 'packed Linear')} "
                f"({', '.join(repr(name) for name in packed[:2])}{', ...' if len(packed) > 2 else ''}), each a "
                "(weight, bias) pair torch.ao packs, not tensors under their own names; load it into its quantized "
                "model with torch, save each Linear's weight().dequantize() and bias() under the float model's "
                "names, and convert that"
            )
        raise SelectionError(
            f"{source} holds no state dict or model{where}", hint="run `ckptconv inspect` to see what it contains"
        )
    _refuse_twins(candidates, source)
    ordinary = [c for c in candidates if not c.is_ema]
    averaged = [c for c in candidates if c.is_ema]
    chosen: _Candidate | None = None
    if ordinary:
        ranked = [
            (rank, len(c.path), i, c)
            for i, c in enumerate(ordinary)
            if (rank := _primary_rank(c, len(base))) is not None
        ]
        if ranked:
            ranked.sort(key=lambda item: item[:3])
            best = ranked[0]
            ties = [item for item in ranked if item[:2] == best[:2]]
            if len(ties) == 1:
                chosen = best[3]
            else:
                _ambiguous([item[3] for item in ties], source)
        elif len(ordinary) == 1:
            chosen = ordinary[0]
        else:
            _ambiguous(candidates, source)
    elif len(averaged) == 1:
        chosen = averaged[0]
    else:
        _ambiguous(candidates, source)
    assert chosen is not None
    others = tuple(c.label for c in candidates if c is not chosen)
    note = ""
    if chosen.is_ema:
        note = f"using the EMA weights under {chosen.label[:-6]!r}: they are the only weights in the file"
    elif others:
        choices = ", ".join(repr(label) for label in others)
        where = format_path(chosen.path) or "the file"
        note = f"using the weights under {where!r}; also found {choices} (pass --select to use another)"
    return Selection(chosen.weights, chosen.path, chosen.kind, others, chosen.skipped, note, chosen.is_ema)


def _with_left_out(selection: Selection, root: Any, base: tuple[PathPart, ...]) -> Selection:
    """``selection`` with its note naming the tensors under ``root`` (at ``base``) it leaves out."""
    chosen = selection.path[len(base) :]
    if not chosen:
        return selection
    left_out = [format_path((*base, path)) if base else path for path in _left_out(root, chosen)]
    if not left_out:
        return selection
    examples = ", ".join(repr(path) for path in left_out[:3]) + (", ..." if len(left_out) > 3 else "")
    extra = (
        f"left out {plural(len(left_out), 'tensor')} outside {selection.where!r} ({examples}); "
        "pass --select to choose other weights"
    )
    return dataclasses.replace(selection, note=f"{selection.note}; {extra}" if selection.note else extra)


def _refuse_twins(candidates: list[_Candidate], source: str) -> None:
    """Refuse two sets of weights spelled alike (the key ``"a.b"`` and ``a`` -> ``b``): whichever the
    search took, ``--select`` could name neither, so the choice would be a silent guess."""
    seen: dict[str, _Candidate] = {}
    for candidate in candidates:
        twin = seen.setdefault(candidate.label, candidate)
        if twin is not candidate:
            ways = " and ".join(" -> ".join(repr(part) for part in c.path) for c in (twin, candidate))
            raise SelectionError(
                f"{source} holds two sets of weights both spelled {candidate.label!r} ({ways}); ckptconv "
                "cannot tell which is meant and --select cannot name either, so it refuses",
                candidates=[twin.label, candidate.label],
            )


def _ambiguous(candidates: list[_Candidate], source: str) -> None:
    labels = [c.label for c in candidates]
    raise SelectionError(
        f"{source} holds several sets of weights ({', '.join(repr(label) for label in labels)}); "
        "pick one with --select",
        candidates=labels,
    )


# Stable Diffusion's LitEma (ldm/modules/ema.py) keeps one buffer per model
# parameter, named after the parameter with its dots removed, plus these two.
LIT_EMA_MARKER = "model_ema.num_updates"
_LIT_EMA_PREFIX = "model_ema."


def lit_ema_weights(weights: dict[str, TensorRef], source: str = "the checkpoint") -> dict[str, TensorRef]:
    """The model's weights with every parameter replaced by its LitEma copy.

    ``model.diffusion_model.out.0.weight`` takes the value of
    ``model_ema.diffusion_modelout0weight``; keys without an EMA copy (buffers,
    the autoencoder, the text encoder) keep their own values, and the
    ``model_ema.*`` entries themselves are left out.

    Raises:
        SelectionError: two model keys squash to the same EMA name.
    """
    ema = {key[len(_LIT_EMA_PREFIX) :]: ref for key, ref in weights.items() if key.startswith(_LIT_EMA_PREFIX)}
    result: dict[str, TensorRef] = {}
    claimed: dict[str, str] = {}
    for key, ref in weights.items():
        if key.startswith(_LIT_EMA_PREFIX):
            continue
        squashed = key[len("model.") :].replace(".", "") if key.startswith("model.") else None
        if squashed is not None and squashed in ema:
            if squashed in claimed:
                raise SelectionError(
                    f"{source}: {claimed[squashed]!r} and {key!r} both match the EMA entry "
                    f"'model_ema.{squashed}'; select the weights without --select ema"
                )
            claimed[squashed] = key
            result[key] = ema[squashed]
        else:
            result[key] = ref
    if not claimed:
        raise SelectionError(f"{source}: its model_ema.* entries match none of the model's keys")
    return result


# The sizes in a Megatron-LM argument namespace that split every rank's weights.
_MEGATRON_SPLITS = (
    ("tensor_model_parallel_size", "tensor parallel"),
    ("pipeline_model_parallel_size", "pipeline parallel"),
    ("expert_model_parallel_size", "expert parallel"),
)


def _refuse_model_parallel_rank(tree: Any, source: str) -> None:
    """Refuse one rank's file of a legacy Megatron-LM run split across ranks (``mp_rank_01/model_optim_rng.pt``):
    its weights are that rank's slices, not the model's, and converting them as the model would be wrong."""
    items = mapping_items(tree)
    if not items:
        return
    entries = dict(items)
    if "checkpoint_version" in entries and "language_model" in dict(mapping_items(entries.get("model")) or ()):
        raise SelectionError(  # a search would pick one of its nested dicts (the encoder) and leave the rest
            f"{source} is a Megatron-LM file in the nested legacy layout (model.language_model.embedding, "
            ".encoder, .output_layer); convert the run's folder (the iter_N folder, or the one holding "
            "latest_checkpointed_iteration.txt), which reads every tensor of it under its full name"
        )
    args = entries.get("args")
    if "checkpoint_version" not in entries or not isinstance(args, ForeignObject):
        return
    attributes = args.attributes()
    splits = [
        f"{words} {size}" for name, words in _MEGATRON_SPLITS if type(size := attributes.get(name)) is int and size > 1
    ]
    if splits:
        raise SelectionError(
            f"{source} is one rank's file of a Megatron-LM run split by {' and '.join(splits)}: its weights are "
            "that rank's slices, not the model's; convert the run's folder (the iter_N folder, or the one holding "
            "latest_checkpointed_iteration.txt) to merge the ranks, or pass --select model to take this rank's "
            "slices as they are"
        )


def select_weights(tree: Any, select: str | None = None, *, source: str = "the checkpoint") -> Selection:
    """Find the model weights in a loaded checkpoint's object tree.

    Args:
        tree: the object a checkpoint file holds (see :class:`ckptconv.Checkpoint`).
        select: a dotted path to the weights (``"state_dict_ema"``, ``"model.state_dict"``),
            ``"ema"`` for the EMA copy, or None to search (see the module docstring).
        source: how to name the checkpoint in messages.

    Raises:
        SelectionError: nothing holds weights, the choice is ambiguous, or
            ``select`` names nothing.
    """
    with collector_paused():  # a search builds and walks an object per container: see ckptconv.runtime
        return _select_weights(tree, select, source)


def _select_weights(tree: Any, select: str | None, source: str) -> Selection:
    if select == "ema":
        root = _as_candidate(tree, ())
        candidates = [root] if root is not None else _candidates(tree, ())
        averaged = [c for c in candidates if c.is_ema]
        if len(averaged) == 1:
            chosen = averaged[0]
            return Selection(chosen.weights, chosen.path, chosen.kind, (), chosen.skipped, "", True)
        if len(averaged) > 1:
            _ambiguous(averaged, source)
        for candidate in candidates:
            if LIT_EMA_MARKER in candidate.weights:
                weights = lit_ema_weights(candidate.weights, source)
                note = "mapped the LitEma weights (model_ema.*) back onto the model's key names"
                return Selection(weights, candidate.path, candidate.kind, (), candidate.skipped, note, True)
        raise SelectionError(f"{source} holds no EMA weights")
    if select is not None and select not in ("", "."):
        node, path = _resolve(tree, select, source)
        found = _as_candidate(node, path)
        if found is not None:
            return Selection(found.weights, path, found.kind, (), found.skipped, "", found.is_ema)
        items = mapping_items(node) or []
        own = [key for key, item in items if as_tensor(item) is not None]
        elsewhere = [key for key, item in items if as_tensor(item) is None and _holds_tensor(item)]
        if own and elsewhere:
            # Tensors of its own, and more inside something that is no state dict (a list): taking either
            # part would drop the other.
            raise SelectionError(
                f"--select {select!r} names a mapping that holds tensors ({short_repr(own[0])}, ...) beside "
                f"more inside {short_repr(elsewhere[0])}, which is not a mapping of tensors; ckptconv takes "
                f"all of it or nothing (run `ckptconv inspect` on {source} to see it)"
            )
        # What --select named holds weights further down: those outside the ones taken are named too.
        return _with_left_out(_choose(_candidates(node, path), path, source, node), node, path)
    state = training_state(tree)
    if state is not None:
        raise TrainingStateError(
            f"{source} holds {state}, not model weights; convert the model file beside it", what=state
        )
    _refuse_model_parallel_rank(tree, source)
    whole = _as_candidate(tree, ())
    bare = as_tensor(tree)
    if bare is not None:
        # torch.save(tensor): no state dict, one tensor. It needs a name to be written.
        note = (
            f"the file holds a single tensor, not a state dict; it is written under the key {BARE_TENSOR_KEY!r} "
            f"(choose another with --rename '^{BARE_TENSOR_KEY}$=NAME')"
        )
        return Selection({BARE_TENSOR_KEY: bare}, (), "tensor", note=note)
    if whole is not None:
        selection = Selection(whole.weights, (), whole.kind, (), whole.skipped)
    else:
        selection = _choose(_candidates(tree, ()), (), source, tree)
    selection = _with_left_out(selection, tree, ())
    if LIT_EMA_MARKER in selection.weights and not selection.note:
        selection = dataclasses.replace(
            selection,
            note="these weights also hold LitEma copies (model_ema.*); --select ema maps them onto the model's names",
        )
    return selection
