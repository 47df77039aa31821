"""Fit: find the key transform that makes a checkpoint match the model you have.

A checkpoint trained under DataParallel, torch.compile, FSDP or Lightning
names its weights differently from the plain model that should load them, and
the reverse. :func:`fit` tries the candidate plans (wrapper removal, a common
leading prefix stripped, the reference's own wrapper names restored) and keeps
the one that matches the reference exactly, keys and shapes. When none does,
nothing is applied and the report says what is missing, unexpected or of the
wrong shape, so a half-fitting file is never written.

:func:`load_into` does the whole thing for an ``nn.Module``: open, select, fit,
``load_state_dict(strict=True)``. A reference given as ``"package.module:factory"``
is the only place ckptconv imports user code, and only because the user named it.
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptconv._paths import PathLike, as_path
from ckptconv.dtypes import DType
from ckptconv.errors import CkptconvError, FitError, KeyCollisionError, LoadError, UnsupportedFormatError
from ckptconv.reading import read_policy
from ckptconv.reading.model_folder import resolve_model
from ckptconv.suffixes import INDEX_SUFFIXES
from ckptconv.transforms.keys import AddPrefix, Canonicalize, StripPrefix, Transform, canonical_keys
from ckptconv.transforms.ties import HEAD, input_embedding, same_data, shared_keys
from ckptconv.values.tensor import TensorRef

if TYPE_CHECKING:
    import torch

__all__ = ["FitReport", "LikeFolder", "Reference", "cast_like", "fit", "like_folder", "load_into", "reference_from"]


# How many mismatched keys a report lists in full.
_SHOWN = 20


@dataclass(frozen=True)
class Reference:
    """The key names (and shapes, where known) a checkpoint should end up with.

    Attributes:
        keys: the names, in the reference's order.
        shapes: shapes by name, where the reference knows them (a key list does not).
        description: where the reference came from, for messages.
        tied: each name the reference fills from another's data (``lm_head.weight`` ->
            ``model.embed_tokens.weight``): a model's tensors that share storage (both ways), or the head of a
            model folder whose config says ``tie_word_embeddings: true`` (from the embeddings only: a model that
            ties takes its head from its embeddings, never the reverse). :func:`fit` leaves out a checkpoint's copy of
            such a name when it is the other's data (the same storage, or a bit-identical copy), and does not
            call it missing when the checkpoint stores only the other.
    """

    keys: tuple[str, ...]
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    description: str = "the reference"
    tied: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FitReport:
    """How a checkpoint's keys were fitted to a reference.

    Attributes:
        ok: True when the fitted keys equal the reference's and every known shape matches.
        plan: the steps applied, in order (empty when the keys already matched).
        matched: keys present on both sides after the plan.
        missing: reference keys the checkpoint does not provide.
        unexpected: checkpoint keys the reference does not have.
        shape_mismatches: ``(key, checkpoint shape, reference shape)``.
        reference: what the checkpoint was fitted to.
        dropped: checkpoint keys left out: a tied copy of data another key holds, where the reference ties them
            (:attr:`Reference.tied`).
        tied: reference keys the checkpoint does not store, which the reference ties to a key it does.
        notes: what the user should hear of both.
    """

    ok: bool
    plan: tuple[str, ...]
    matched: int
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    shape_mismatches: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()
    reference: str = "the reference"
    dropped: tuple[str, ...] = ()
    tied: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def summary(self) -> str:
        """One sentence: the plan that fits, or why nothing does."""
        plan = "; ".join(self.plan) if self.plan else "no change"
        if self.ok:
            return f"all {self.matched} keys fit {self.reference} ({plan})"
        problems = []
        if self.missing:
            problems.append(f"{len(self.missing)} missing (e.g. {self.missing[0]!r})")
        if self.unexpected:
            problems.append(f"{len(self.unexpected)} unexpected (e.g. {self.unexpected[0]!r})")
        if self.shape_mismatches:
            key, got, want = self.shape_mismatches[0]
            problems.append(
                f"{len(self.shape_mismatches)} of the wrong shape (e.g. {key!r}: {list(got)} instead of {list(want)})"
            )
        return (
            f"no key transform makes the checkpoint fit {self.reference}: best plan ({plan}) matches "
            f"{self.matched} keys, with {', '.join(problems)}"
        )

    def details(self) -> list[str]:
        """Every mismatch, one per line (the first few of each kind)."""
        lines = [f"plan: {step}" for step in self.plan]
        for title, keys in (("missing", self.missing), ("unexpected", self.unexpected)):
            for key in keys[:_SHOWN]:
                lines.append(f"{title}: {key}")
            if len(keys) > _SHOWN:
                lines.append(f"{title}: ... and {len(keys) - _SHOWN} more")
        for key, got, want in self.shape_mismatches[:_SHOWN]:
            lines.append(f"shape: {key}: checkpoint {list(got)}, reference {list(want)}")
        return lines


def _shape(value: Any) -> tuple[int, ...] | None:
    shape = getattr(value, "shape", None)
    return tuple(int(s) for s in shape) if shape is not None else None


def reference_from(reference: Any) -> Reference:
    """A :class:`Reference` from whatever the caller has.

    Accepts a :class:`Reference`, an ``nn.Module`` (its ``state_dict()``), a state
    dict, an iterable of key names, a path to a checkpoint (any format ckptconv
    reads) or to a text file with one key per line, or ``"package.module:factory"``,
    which imports that module and calls ``factory()`` to build the model; literal
    arguments may follow, ``"timm:create_model(model_name='resnet18', num_classes=10)"``
    (read with :func:`ast.literal_eval`, never evaluated).

    Raises:
        LoadError: the path cannot be read as a checkpoint or a key list, or the
            factory cannot be imported or called.
    """
    if isinstance(reference, Reference):
        return reference
    if hasattr(reference, "state_dict") and callable(reference.state_dict):
        state = reference.state_dict()
        return Reference(
            tuple(state),
            {k: s for k, v in state.items() if (s := _shape(v)) is not None},
            f"the {type(reference).__name__} model",
            shared_keys(state),
        )
    if isinstance(reference, Mapping):
        return Reference(
            tuple(reference),
            {k: s for k, v in reference.items() if (s := _shape(v)) is not None},
            "the reference state dict",
            shared_keys(reference),
        )
    if isinstance(reference, (str, bytes, os.PathLike)):
        text = as_path(reference)
        if os.path.exists(text):
            return _reference_from_file(text)
        if ":" in text and os.path.sep not in text.split(":", 1)[0]:
            return _reference_from_factory(text)
        raise LoadError(
            f"reference {text!r} is neither a file nor a 'package.module:factory'; check the path", path=text
        )
    if isinstance(reference, Iterable):
        keys = tuple(reference)
        if all(isinstance(key, str) for key in keys):
            return Reference(keys, {}, "the reference keys")
    raise TypeError(f"cannot use a {type(reference).__name__} as a reference")


def _reference_from_file(path: str) -> Reference:
    from ckptconv.loading import open as open_checkpoint

    if not os.path.isdir(path):
        read_policy.check_file(path)  # a FIFO or a device would hang or never end
    try:
        weights = open_checkpoint(path).select().weights
    except UnsupportedFormatError:
        keys = _key_list(path)
        if keys is None:
            raise
        return Reference(keys, {}, f"the key list {path!r}")
    tied = shared_keys(weights)
    model = resolve_model(path, strict=False)
    config = model.config if model is not None and not model.adapter else None
    embedding = input_embedding(weights)
    if config is not None and config.get("tie_word_embeddings") is True and embedding:
        tied[HEAD] = embedding  # the model takes its head from the embeddings (save_pretrained stores no head)
    shapes = {k: ref.shape for k, ref in weights.items()}
    return Reference(tuple(weights), shapes, f"the checkpoint {path!r}", tied)


def _key_list(path: str) -> tuple[str, ...] | None:
    """Keys from a text file, one per line ('#' comments and blank lines ignored), or None."""
    try:
        text = read_policy.read_limited(path, what="key list").decode("utf-8")
    except (UnicodeDecodeError, CkptconvError):
        return None
    lines = [line.strip() for line in text.splitlines()]
    keys = tuple(line.split()[0] for line in lines if line and not line.startswith("#"))
    return keys if keys and all(key.isprintable() for key in keys) else None


def _import_from_current_folder(module_name: str) -> Any:
    """Import a module as ``python -m`` would find it: the current folder first, then ``sys.path``.

    The ``ckptconv`` console script's ``sys.path`` starts with its own bin folder,
    not the current one, so ``--like mymodels:build_model`` could not find
    ``./mymodels.py`` there while ``python -m ckptconv`` could.
    """
    folder = os.getcwd()
    sys.path.insert(0, folder)
    try:
        importlib.invalidate_caches()
        return importlib.import_module(module_name)
    finally:
        sys.path.remove(folder)  # the first occurrence: the one inserted above


def factory_call(spec: str) -> tuple[str, tuple[str, ...], tuple[Any, ...], dict[str, Any]]:
    """``"pkg.mod:factory(key=value, ...)"`` taken apart: the module, the attribute path, and the arguments.

    The arguments must be literals (numbers, strings, bytes, True/False/None, and tuples, lists, sets and
    dicts of them): each is read with :func:`ast.literal_eval`, so nothing in them is evaluated.

    Raises:
        LoadError: the text after ``:`` is not a dotted name, optionally called with literal arguments.

    Example:
        >>> factory_call("timm:create_model(model_name='resnet18', num_classes=10)")
        ('timm', ('create_model',), (), {'model_name': 'resnet18', 'num_classes': 10})
    """
    module_name, _, call = spec.partition(":")
    usage = "write 'package.module:factory' or 'package.module:factory(key=value, ...)' with literal values"
    try:
        tree = ast.parse(call.strip(), mode="eval").body
    except SyntaxError:
        raise LoadError(f"--like {spec!r}: {call!r} is not a factory's name or call; {usage}") from None
    node = tree.func if isinstance(tree, ast.Call) else tree
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.insert(0, node.attr)
        node = node.value
    if not module_name.strip():
        raise LoadError(f"--like {spec!r}: no module is named before ':'; {usage}")
    if not isinstance(node, ast.Name):
        raise LoadError(f"--like {spec!r}: {call!r} is not a factory's name or call; {usage}")
    names.insert(0, node.id)
    if not isinstance(tree, ast.Call):
        return module_name, tuple(names), (), {}
    keywords = tree.keywords
    if any(isinstance(arg, ast.Starred) for arg in tree.args) or any(kw.arg is None for kw in keywords):
        raise LoadError(f"--like {spec!r}: * and ** arguments are not taken; {usage}")
    try:
        args = tuple(ast.literal_eval(arg) for arg in tree.args)
        kwargs = {str(kw.arg): ast.literal_eval(kw.value) for kw in keywords}
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        bad = next(ast.unparse(value) for value in (*tree.args, *(kw.value for kw in keywords)) if not _literal(value))
        raise LoadError(f"--like {spec!r}: {bad[:80]!r} is not a literal value (nothing was run); {usage}") from None
    return module_name, tuple(names), args, kwargs


def _literal(node: ast.expr) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def _reference_from_factory(spec: str) -> Reference:
    from ckptconv.runtime.extras import require_torch

    module_name, attributes, args, kwargs = factory_call(spec)  # refused before anything is imported
    require_torch(f"--like {spec} (a model built by your code)")
    try:
        factory = _import_from_current_folder(module_name)
        for part in attributes:
            factory = getattr(factory, part)
        model = factory(*args, **kwargs) if callable(factory) else factory
    except Exception as error:  # the user's own code can raise anything
        where = f" (looked in the current folder {os.getcwd()!r} first)" if isinstance(error, ImportError) else ""
        raise LoadError(
            f"could not build the reference from {spec!r}: {type(error).__name__}: {error}{where}"
        ) from error
    reference = reference_from(model)
    return Reference(reference.keys, reference.shapes, f"the model from {spec!r}")


def _leading_prefixes(keys: Sequence[str], *, everyone: bool) -> list[str]:
    """Dotted prefixes (1-3 components) shared by every key, or by at least a tenth of them."""
    counts: Counter[str] = Counter()
    for key in keys:
        parts = key.split(".")
        for depth in range(1, min(len(parts), 4)):
            counts[".".join(parts[:depth])] += 1
    needed = len(keys) if everyone else max(1, len(keys) // 10)
    return [prefix for prefix, count in counts.most_common(40) if count >= needed]


@dataclass(frozen=True)
class _Plan:
    steps: tuple[Transform, ...]
    mapping: dict[str, str]  # checkpoint key -> fitted key


def _apply_plan(keys: Sequence[str], steps: Sequence[Transform]) -> dict[str, str] | None:
    """Where each key ends up under ``steps`` (the transforms themselves, run on the names
    alone), or None if two keys would collide."""
    names: dict[str, Any] = {key: key for key in keys}  # new name -> original name
    try:
        for step in steps:
            names, _ = step.apply(names)
    except KeyCollisionError:
        return None
    return {original: name for name, original in names.items()}


def _candidate_plans(keys: Sequence[str], target: set[str]) -> list[_Plan]:
    plans = []
    for base in ((), (Canonicalize(),)):
        base_keys = _apply_plan(keys, base)
        if base_keys is None:
            continue
        current = list(base_keys.values())
        strips: list[str | None] = [None, *_leading_prefixes(current, everyone=False)]
        adds: list[str | None] = [None, *_leading_prefixes(sorted(target), everyone=True)]
        for strip in strips:
            for add in adds:
                steps: tuple[Transform, ...] = base
                if strip:
                    steps += (StripPrefix(strip),)
                if add:
                    steps += (AddPrefix(add),)
                mapping = _apply_plan(keys, steps)
                if mapping is not None:
                    plans.append(_Plan(steps, mapping))
    return plans


def _describe_restore(canonical: Iterable[str], from_canonical: Mapping[str, str]) -> str:
    prefixes = {
        from_canonical[c][: -len(c)] if from_canonical[c].endswith(c) else None
        for c in canonical
        if c in from_canonical
    }
    if len(prefixes) == 1 and None not in prefixes:
        return f"add prefix {prefixes.pop()!r}"
    return "use the reference's wrapper names (FSDP / checkpointing components)"


def fit(state: Mapping[str, Any], reference: Any, *, partial: bool = False) -> tuple[dict[str, Any], FitReport]:
    """Rename ``state``'s keys so they match ``reference``, if some plan makes them match exactly.

    The plans tried: the keys as they are; wrappers removed (see
    :func:`~ckptconv.transforms.keys.canonicalize`); a leading prefix stripped (Lightning's
    ``model.``, ``backbone.``, ...); and the reference's own wrappers (``module.``,
    ``_orig_mod.``, FSDP components) put back. The plan that matches the most
    keys wins, the shortest on a tie.

    Tied names (:attr:`Reference.tied`): a checkpoint key the reference does not have but ties to one it
    has (``lm_head.weight``, for a base folder with ``tie_word_embeddings: true``) is left out when it is that
    key's data (the same storage, or a bit-identical copy), and a reference key the checkpoint does not store
    is not missing when the checkpoint stores the key it is tied to; the report's notes say which.

    Args:
        state: names to tensors (lazy or torch); only names and shapes are used.
        reference: anything :func:`reference_from` accepts.
        partial: apply the best plan even when it does not fit exactly.

    Returns:
        The renamed state (``state`` unchanged when nothing fits, unless
        ``partial``) and a :class:`FitReport`.

    Example:
        >>> fitted, report = ckptconv.fit(ckptconv.open("dp.pkl").select().weights, model)  # doctest: +SKIP
        >>> report.plan                                                                     # doctest: +SKIP
        ('remove wrapper prefixes (canonical names)',)
    """
    if not isinstance(state, Mapping):
        raise TypeError(
            f"fit takes a mapping of names to tensors, not a {type(state).__name__}; for a file give "
            "ckptconv.open(path).select().weights"
        )
    target_reference = reference_from(reference)
    target_keys = list(target_reference.keys)
    # Compare in canonical form, then give every key the reference's own name, so
    # references with interior wrappers (FSDP) are matched too.
    to_canonical, _ = canonical_keys(target_keys)
    if len(set(to_canonical.values())) != len(to_canonical):
        to_canonical = {key: key for key in target_keys}
    from_canonical = {canonical: key for key, canonical in to_canonical.items()}
    target = set(from_canonical)
    keys = list(state)

    best: tuple[tuple[int, int], _Plan] | None = None
    for plan in _candidate_plans(keys, target):
        matched = sum(1 for fitted in plan.mapping.values() if fitted in target)
        score = (matched, -len(plan.steps))
        if best is None or score > best[0]:
            best = (score, plan)
    assert best is not None  # the empty plan always exists
    plan = best[1]
    restores_wrappers = any(from_canonical[c] != c for c in plan.mapping.values() if c in from_canonical)
    final = {key: from_canonical.get(fitted, fitted) for key, fitted in plan.mapping.items()}
    fitted_keys = set(final.values())

    reference_keys = set(target_keys)
    dropped, notes = _tied_copies(state, final, target_reference)
    tied = tuple(key for key in target_keys if key not in fitted_keys and target_reference.tied.get(key) in fitted_keys)
    notes += [
        f"the checkpoint does not store {key!r}, which {target_reference.description} ties to "
        f"{target_reference.tied[key]!r}: not missing"
        for key in tied
    ]
    missing = tuple(key for key in target_keys if key not in fitted_keys and key not in tied)
    unexpected = tuple(final[key] for key in keys if final[key] not in reference_keys and key not in dropped)
    mismatches = []
    for key in keys:
        want = target_reference.shapes.get(final[key])
        got = _shape(state[key])
        if want is not None and got is not None and tuple(want) != got:
            mismatches.append((final[key], got, tuple(want)))
    steps = [step.describe() for step in plan.steps]
    if restores_wrappers:
        steps.append(_describe_restore(plan.mapping.values(), from_canonical))
    ok = not (missing or unexpected or mismatches)
    report = FitReport(
        ok=ok,
        plan=tuple(steps),
        matched=len(fitted_keys & reference_keys),
        missing=missing,
        unexpected=unexpected,
        shape_mismatches=tuple(mismatches),
        reference=target_reference.description,
        dropped=tuple(dropped),
        tied=tied,
        notes=tuple(notes),
    )
    if not ok and not partial:
        return dict(state), report
    return {final[key]: value for key, value in state.items() if key not in dropped}, report


def _tied_copies(
    state: Mapping[str, Any], final: Mapping[str, str], reference: Reference
) -> tuple[list[str], list[str]]:
    """The checkpoint keys that are a tied copy the reference does not store (``lm_head.weight`` sharing storage
    with, or equal bit for bit to, the embeddings of a base that ties them), and a note for each."""
    dropped: list[str] = []
    notes: list[str] = []
    present = set(reference.keys)
    fitted = {name: key for key, name in final.items()}
    for key, name in final.items():
        partner = fitted.get(reference.tied.get(name, ""))
        if name in present or partner is None:
            continue
        how = same_data(state[key], state[partner])
        if how:
            dropped.append(key)
            shown = f"{key!r}" + (f" ({name!r})" if name != key else "")
            notes.append(
                f"left out {shown}: it {how} {partner!r}, and {reference.description} ties them (it stores only "
                f"{reference.tied[name]!r})"
            )
    return dropped, notes


def load_into(
    model: torch.nn.Module,
    path: PathLike,
    *,
    strict: bool = True,
    select: str | None = None,
    trust: bool = False,
    device: Any = None,
) -> FitReport:
    """Load a checkpoint into ``model`` (plain, DataParallel or DDP), fitting its keys first.

    Args:
        model: the module to fill; its parameters stay on their devices.
        path: any checkpoint :func:`ckptconv.open` reads.
        strict: require an exact fit (as ``load_state_dict(strict=True)`` does);
            with False the keys that fit are loaded and the rest reported.
        select: where the weights are in a training checkpoint.
        trust: see :func:`ckptconv.open`. Dangerous.
        device: where tensors are staged before ``load_state_dict`` copies them
            into the model: the CPU when None; ``"model"``: each tensor straight
            onto the device of the parameter or buffer it fills (host memory
            stays bounded); ``"auto"``: as in :func:`ckptconv.load`, the visible
            GPU with the most free memory, else the CPU; or one device for all.

    Returns:
        The :class:`FitReport`.

    Raises:
        FitError: ``strict`` and the checkpoint does not fit ``model``.
        DeviceError: ``device`` is not a spelling it takes, or a GPU this process does not have.

    Example:
        >>> ckptconv.load_into(model, "dp_model.pkl")  # doctest: +SKIP
    """
    from ckptconv.gpu.devices import pick_device
    from ckptconv.gpu.torch_tensors import to_torch
    from ckptconv.loading import open as open_checkpoint

    target = pick_device(device, model=True)  # a wrong device is said before the file is read
    weights = open_checkpoint(path, trust=trust).select(select).weights
    fitted, report = fit(weights, model, partial=not strict)
    if not report.ok:
        if strict:
            raise FitError(report.summary(), report=report)
        keys = set(model.state_dict())
        fitted = {key: value for key, value in fitted.items() if key in keys}
    if target == "model":
        targets = {key: str(value.device) for key, value in model.state_dict().items()}
        staged = to_torch(fitted, device=targets)
    else:
        staged = to_torch(fitted, device=target)
    # Keys the model ties to another that the checkpoint holds (its head, to the embeddings) get their data from it.
    result = model.load_state_dict(staged, strict=strict and not report.tied)
    if strict and report.tied and (set(result.missing_keys) - set(report.tied) or result.unexpected_keys):
        raise FitError(f"{report.summary()}, but the model also wants {sorted(result.missing_keys)}", report=report)
    return report


@dataclass(frozen=True)
class LikeFolder:
    """A model folder given as the reference (``--like base_model/``): the output takes after it.

    Attributes:
        folder: the model folder, whose non-weight files the output carries.
        dtypes: each reference key's dtype, which the fitted tensors are cast to unless ``--dtype`` is given.
        files: the reference's weight files (index and shards), which are not carried.
        max_shard_size: the reference's largest shard in bytes when it is sharded (the output is sharded
            alike), else None.
    """

    folder: str
    dtypes: Mapping[str, DType]
    files: tuple[str, ...]
    max_shard_size: int | None
    config: Mapping[str, Any] = field(default_factory=dict)  # its config.json


def like_folder(reference: Any) -> LikeFolder | None:
    """``reference`` as a :class:`LikeFolder` when it names a model folder (a folder, or its index, beside a
    ``config.json``); None for any other reference.

    Raises:
        LoadError: the folder's weights cannot be read.
    """
    if not isinstance(reference, (str, os.PathLike)):
        return None
    path = as_path(reference)
    model = resolve_model(path) if os.path.exists(path) else None
    if model is None or model.config is None or model.adapter:
        return None  # a file, a training framework's folder, a folder without config.json: keys to fit, no more
    folder, config = model.folder, model.config
    from ckptconv.loading import open as open_checkpoint

    checkpoint = open_checkpoint(path)
    dtypes = {key: ref.out_dtype for key, ref in checkpoint.select().weights.items()}
    files = checkpoint.files or (checkpoint.path,)
    shards = [name for name in files if not name.endswith(INDEX_SUFFIXES)]
    largest = max(os.path.getsize(name) for name in shards) if len(shards) > 1 else None
    return LikeFolder(folder, dtypes, tuple(files), largest, config)


def cast_like(state: Mapping[str, TensorRef], like: LikeFolder) -> dict[str, TensorRef]:
    """Each floating-point tensor cast to the dtype its key has in the reference (integers and bools keep theirs)."""
    result: dict[str, TensorRef] = {}
    for key, ref in state.items():
        target = like.dtypes.get(key)
        fits = target is not None and target.kind == "float" and ref.dtype.is_floating_point
        result[key] = ref.cast(target) if fits and target is not None and ref.out_dtype != target else ref
    return result
