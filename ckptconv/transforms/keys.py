"""Transform: pure steps over a state dict's keys and dtypes.

Every step takes a mapping of names to lazy tensors and returns a new one
(the input is never mutated), together with a count of what it changed. No
tensor bytes are read here: a cast only marks tensors, and the bytes are
converted as they are written. Steps compose in a :class:`Pipeline`, which can
also describe itself for ``--dry-run`` output and for the provenance recorded in
written files.

Key rules, learned from real breakage in other projects:

* prefixes are whole dotted components: stripping ``module`` turns
  ``module.conv.weight`` into ``conv.weight`` but leaves ``modules.0.weight``
  and ``module_list.0`` alone (``k[7:]`` corrupts those, ray-project/ray#43594);
* keys without the prefix are left unchanged and counted;
* no step may map two keys to one name: that raises
  :class:`~ckptconv.errors.KeyCollisionError` naming both.
* casts touch floating-point tensors only; ``num_batches_tracked`` and
  ``position_ids`` keep their integer dtype.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Protocol

from ckptconv._text import short_repr
from ckptconv.dtypes import DType, parse_cast_target
from ckptconv.errors import KeyCollisionError, TransformError
from ckptconv.values.tensor import TensorRef

__all__ = [
    "AddPrefix",
    "Canonicalize",
    "Cast",
    "Drop",
    "Keep",
    "Pipeline",
    "Rename",
    "StepReport",
    "StripPrefix",
    "Transform",
    "canonical_keys",
    "canonicalize",
    "cast_step",
    "wrapper_note",
    "wrapper_on_every_key",
]

State = dict[str, TensorRef]


@dataclass(frozen=True)
class StepReport:
    """What one step did.

    Attributes:
        step: the step's description.
        changed: keys renamed or cast.
        unchanged: keys the step left as they were.
        details: step-specific counts, e.g. keys per wrapper removed by :class:`Canonicalize`.
        dropped: keys the step removed (:class:`Keep`, :class:`Drop`, the counters :class:`Canonicalize`
            sets aside).
        notes: sentences the user should hear about this step (a wrapper left on every key, what to pass).
    """

    step: str
    changed: int
    unchanged: int
    details: Mapping[str, int] = field(default_factory=dict)
    dropped: int = 0
    notes: tuple[str, ...] = ()


class Transform(Protocol):
    """A pure function from a state dict to a new state dict."""

    def apply(self, state: Mapping[str, TensorRef]) -> tuple[State, StepReport]: ...

    def describe(self) -> str: ...


def _rekey(state: Mapping[str, TensorRef], rename: Callable[[str], str | None], step: str) -> tuple[State, StepReport]:
    """Apply ``rename`` to every key; None drops the key. Refuses to merge two keys."""
    result: State = {}
    origin: dict[str, str] = {}
    changed = dropped = 0
    for key, tensor in state.items():
        new_key = rename(key)
        if new_key is None:
            dropped += 1
            continue
        if new_key in result:
            raise KeyCollisionError(
                f"{step} maps both {origin[new_key]!r} and {key!r} to {new_key!r}; "
                "drop one of them first (--drop) or choose another rule",
                keys=(origin[new_key], key),
                new_key=new_key,
            )
        result[new_key] = tensor
        origin[new_key] = key
        changed += new_key != key
    return result, StepReport(step, changed, len(state) - changed - dropped, dropped=dropped)


def _components(prefix: str) -> str:
    """``"module"`` and ``"module."`` both mean the component ``module.``."""
    prefix = prefix.strip()
    if not prefix or prefix.strip(".") == "":
        raise TransformError("a prefix must name at least one component, e.g. 'module'")
    return prefix.rstrip(".") + "."


@dataclass(frozen=True)
class StripPrefix:
    """Remove a leading prefix made of whole components (``module`` → ``conv.weight``).

    With ``under_wrappers`` (``ckptconv strip-module``), the prefix is removed also where it follows wrappers that
    are never a model's own names (``_orig_mod.``, ``_forward_module.``): ``_orig_mod.module.fc.weight`` becomes
    ``_orig_mod.fc.weight``, and a note points to ``--canonical`` for the wrapper left.
    """

    prefix: str
    under_wrappers: bool = field(default=False, kw_only=True)

    @property
    def component(self) -> str:
        """The prefix as whole components, with its trailing dot (``"module."``)."""
        return _components(self.prefix)

    def _strip(self, key: str) -> str:
        prefix = self.component
        if key.startswith(prefix):
            return key[len(prefix) :]
        if not self.under_wrappers:
            return key
        start = 0
        while (end := key.find(".", start)) != -1 and key[start:end] in _UNAMBIGUOUS_LEADING:
            start = end + 1
            if key.startswith(prefix, start) and len(key) > start + len(prefix):
                return key[:start] + key[start + len(prefix) :]
        return key

    def apply(self, state: Mapping[str, TensorRef]) -> tuple[State, StepReport]:
        result, report = _rekey(state, self._strip, self.describe())
        left = next((w for w in LEADING_WRAPPERS if result and all(k.startswith(f"{w}.") for k in result)), None)
        if report.changed and left is not None:
            note = f"every key still starts with '{left}.' ({_WRAPPER_OF[left]}); pass --canonical to remove every "
            report = dataclasses.replace(report, notes=(note + "wrapper prefix",))
        return result, report

    def describe(self) -> str:
        return f"strip prefix {self.component!r}"


@dataclass(frozen=True)
class AddPrefix:
    """Put a prefix of whole components in front of every key (``conv.weight`` → ``module.conv.weight``)."""

    prefix: str

    @property
    def component(self) -> str:
        """The prefix as whole components, with its trailing dot (``"module."``)."""
        return _components(self.prefix)

    def apply(self, state: Mapping[str, TensorRef]) -> tuple[State, StepReport]:
        prefix = self.component
        return _rekey(state, lambda key: prefix + key, self.describe())

    def describe(self) -> str:
        return f"add prefix {self.component!r}"


# Wrapper attributes that PyTorch and friends put between a model and its parameters.
# Removed from the front of keys: DataParallel/DDP (`module`), torch.compile
# (`_orig_mod`), Lightning's strategy wrapper (`_forward_module`). `module` is also
# an ordinary attribute name, so it is removed only when every key starts with it.
LEADING_WRAPPERS = ("_orig_mod", "_forward_module", "module")
# Removed wherever they appear as whole components: FSDP1 (`_fsdp_wrapped_module`),
# activation checkpointing (`_checkpoint_wrapped_module`), FairScale/FSDP flat
# parameter wrappers (`_fpw_module`), and torch.compile applied to a submodule.
INTERIOR_WRAPPERS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_fpw_module", "_orig_mod"})
_UNAMBIGUOUS_LEADING = frozenset(LEADING_WRAPPERS) - {"module"}
_WRAPPER_OF = {
    "_orig_mod": "torch.compile",
    "_forward_module": "Lightning",
    "module": "DataParallel/DDP",
    "_fsdp_wrapped_module": "FSDP",
    "_checkpoint_wrapped_module": "activation checkpointing",
    "_fpw_module": "FairScale",
}
#: Prefixes users meet in front of every key, for hints when the one they asked to strip is absent: the wrappers,
#: and the names frameworks give the model (Lightning's ``model.``, ``backbone.``, ``net.``).
HINTED_PREFIXES = (
    *(f"{name}." for name in (*LEADING_WRAPPERS, "_fsdp_wrapped_module", "_checkpoint_wrapped_module")),
    *("model.", "backbone.", "net."),
)
#: How the note on a wrapper prefix every key has starts (:func:`wrapper_note`): batch finds its items' by it.
WRAPPER_NOTE = "every key starts with "
# The counters an averaging wrapper keeps beside its `module.`: torch's AveragedModel (SWA/EMA) and mmengine's
# EMA models. No model has them; with every other key under `module.`, they are set aside.
AVERAGING_COUNTERS = {"n_averaged": "AveragedModel (SWA/EMA)", "steps": "mmengine's EMA model"}


def averaging_counters(keys: Iterable[str]) -> list[str]:
    """The counters of an averaging wrapper among ``keys``: top-level names in :data:`AVERAGING_COUNTERS`,
    when every other key starts with ``module.``."""
    keys = list(keys)
    counters = [key for key in keys if key in AVERAGING_COUNTERS]
    rest = [key for key in keys if key not in AVERAGING_COUNTERS]
    return counters if counters and rest and all(key.startswith("module.") for key in rest) else []


def wrapper_on_every_key(keys: Iterable[str]) -> str | None:
    """The wrapper component (:data:`LEADING_WRAPPERS`, :data:`INTERIOR_WRAPPERS`) every key starts with, or None.

    A Lightning module's own ``model.`` is no wrapper (it is also a Hugging Face model's base), and is never named.
    """
    keys = list(keys)
    if not keys:
        return None
    for wrapper in (*LEADING_WRAPPERS, *sorted(INTERIOR_WRAPPERS - set(LEADING_WRAPPERS))):
        if all(key.startswith(f"{wrapper}.") for key in keys):
            return wrapper
    return None


def wrapper_note(keys: Iterable[str]) -> str:
    """The note on a wrapper prefix every key has, with the flags that remove it, or ``""``.

    Example:
        >>> wrapper_note(["module.conv.weight", "module.fc.bias"])
        "every key starts with 'module.' (DataParallel/DDP); pass --strip-prefix module or --canonical to remove it"
    """
    keys = list(keys)
    wrapper = wrapper_on_every_key(keys)
    if wrapper is None:
        return ""
    # Wrappers stacked under it (torch.compile over DataParallel, FSDP around checkpointing): one flag removes all.
    others = [f"'{name}.'" for name in canonical_keys(keys)[1] if name != wrapper]
    if others:
        return (
            f"{WRAPPER_NOTE}'{wrapper}.' ({_WRAPPER_OF[wrapper]}), with {', '.join(others)} inside; pass --canonical "
            "to remove every wrapper prefix"
        )
    return (
        f"{WRAPPER_NOTE}'{wrapper}.' ({_WRAPPER_OF[wrapper]}); pass --strip-prefix {wrapper} or --canonical to "
        "remove it"
    )


def canonical_keys(keys: Iterable[str]) -> tuple[dict[str, str], dict[str, int]]:
    """The canonical name of every key, and how many keys each wrapper was removed from.

    Wrappers are removed as whole components, stacked in any order
    (``_orig_mod.module.``, ``module._orig_mod.``, ...). A ``module``
    component is removed from the front only while *every* key starts with
    it, so a real submodule called ``module`` inside a model is kept, and
    ``modules.0`` or ``module_list`` are never cut.
    """
    original = list(keys)
    parts = [key.split(".") for key in original]
    removed: dict[str, int] = {}

    def count(name: str) -> None:
        removed[name] = removed.get(name, 0) + 1

    for index, components in enumerate(parts):
        kept = [c for c in components[:-1] if c not in INTERIOR_WRAPPERS] + components[-1:]
        for component in components[:-1]:
            if component in INTERIOR_WRAPPERS:
                count(component)
        parts[index] = kept
    while parts:
        changed = False
        for index, components in enumerate(parts):
            rest = components
            while len(rest) > 1 and rest[0] in _UNAMBIGUOUS_LEADING:
                count(rest[0])
                rest = rest[1:]
                changed = True
            parts[index] = rest
        if all(len(components) > 1 and components[0] == "module" for components in parts):
            for index, components in enumerate(parts):
                parts[index] = components[1:]
            removed["module"] = removed.get("module", 0) + len(parts)
            changed = True
        if not changed:
            break
    return {key: ".".join(components) for key, components in zip(original, parts)}, removed


def canonicalize(state: Mapping[str, TensorRef]) -> tuple[State, StepReport]:
    """``state`` with every wrapper component removed from its keys; see :func:`canonical_keys`.

    Raises:
        KeyCollisionError: two keys have the same canonical name.

    Example:
        >>> canonicalize(state)[0].keys()  # doctest: +SKIP
        dict_keys(['conv.weight', ...])   # from '_orig_mod.module.conv.weight', ...
    """
    return Canonicalize().apply(state)


@dataclass(frozen=True)
class Canonicalize:
    """Remove every known wrapper prefix (DataParallel, DDP, compile, FSDP, Lightning, ...)."""

    def apply(self, state: Mapping[str, TensorRef]) -> tuple[State, StepReport]:
        # An averaging wrapper's counter (0-dim where the values are tensors; fit passes names) is set aside.
        counters = [
            key for key in averaging_counters(state) if not isinstance(state[key], TensorRef) or state[key].shape == ()
        ]
        kept = {key: value for key, value in state.items() if key not in counters}
        mapping, removed = canonical_keys(kept)
        result, report = _rekey(kept, mapping.__getitem__, self.describe())
        notes = [
            f"set aside {key!r}, the counter {AVERAGING_COUNTERS[key]} keeps beside the weights; no model has it"
            for key in counters
        ]
        wrapped = sum(key.startswith("module.") for key in result)
        if "module" not in removed and wrapped:
            notes.append(
                f"'module.' starts {wrapped} of {len(result)} keys, so --canonical kept it (it removes 'module.' "
                f"only when every key has it); pass --strip-prefix module to remove it from those {wrapped}"
            )
        return result, StepReport(
            report.step, report.changed, report.unchanged, removed, dropped=len(counters), notes=tuple(notes)
        )

    def describe(self) -> str:
        return "remove wrapper prefixes (canonical names)"


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """``pattern`` compiled, or a TransformError saying why not: re's own errors, and the two it
    raises as other exceptions (a repetition count too large, nesting too deep for its parser)."""
    try:
        return re.compile(pattern)
    except (re.error, OverflowError, RecursionError) as error:
        reason = "it is nested too deeply" if isinstance(error, RecursionError) else str(error)
        raise TransformError(f"{short_repr(pattern)} is not a valid regular expression: {reason}") from None


@dataclass(frozen=True)
class Rename:
    """Rewrite keys with a regular expression, as ``re.sub(pattern, replacement, key)``."""

    pattern: str
    replacement: str

    def apply(self, state: Mapping[str, TensorRef]) -> tuple[State, StepReport]:
        regex = compile_pattern(self.pattern)
        try:
            return _rekey(state, lambda key: regex.sub(self.replacement, key), self.describe())
        except (re.error, IndexError) as error:
            raise TransformError(f"replacement {self.replacement!r} is invalid: {error}") from None

    def describe(self) -> str:
        return f"rename {self.pattern!r} -> {self.replacement!r}"


@dataclass(frozen=True)
class _KeyFilter:
    """Keys that match a regular expression (``re.search``), or any of several, are kept (:class:`Keep`)
    or dropped (:class:`Drop`)."""

    pattern: str | tuple[str, ...]
    _keeps_matches: ClassVar[bool]

    @property
    def patterns(self) -> tuple[str, ...]:
        """The regular expressions, one or more."""
        return (self.pattern,) if isinstance(self.pattern, str) else tuple(self.pattern)

    def apply(self, state: Mapping[str, TensorRef]) -> tuple[State, StepReport]:
        regexes = [compile_pattern(pattern) for pattern in self.patterns]
        keeps = self._keeps_matches
        return _rekey(
            state,
            lambda key: key if any(regex.search(key) for regex in regexes) == keeps else None,
            self.describe(),
        )

    def describe(self) -> str:
        return f"{'keep' if self._keeps_matches else 'drop'} keys matching {' or '.join(map(repr, self.patterns))}"


class Keep(_KeyFilter):
    """Keep only keys that match a regular expression (``re.search``), or any of a tuple of them."""

    _keeps_matches = True


class Drop(_KeyFilter):
    """Drop keys that match a regular expression (``re.search``), or any of a tuple of them."""

    _keeps_matches = False


@dataclass(frozen=True)
class Cast:
    """Convert floating-point tensors to ``dtype``; integer, bool and complex tensors keep theirs.

    Args:
        dtype: the target, a :class:`~ckptconv.dtypes.DType` or a name such as ``"bf16"``.
        keep: regular expressions; matching keys keep their dtype (e.g. norms).
        allow_overflow: let finite values that exceed the target's range become
            inf; by default writing such a tensor fails with
            :class:`~ckptconv.errors.CastOverflowError`.
    """

    dtype: DType | str
    keep: tuple[str, ...] = ()
    allow_overflow: bool = False

    @property
    def target(self) -> DType:
        return self.dtype if isinstance(self.dtype, DType) else parse_cast_target(self.dtype)

    def apply(self, state: Mapping[str, TensorRef]) -> tuple[State, StepReport]:
        target = self.target
        keep = [compile_pattern(pattern) for pattern in self.keep]
        result: State = {}
        changed = 0
        for key, tensor in state.items():
            if tensor.dtype.is_floating_point and not any(regex.search(key) for regex in keep):
                cast = tensor.cast(target, allow_overflow=self.allow_overflow)
                changed += cast.out_dtype != tensor.out_dtype
                result[key] = cast
            else:
                result[key] = tensor
        return result, StepReport(self.describe(), changed, len(state) - changed)

    def describe(self) -> str:
        text = f"cast floating-point tensors to {self.target.name}"
        if self.keep:
            text += " except keys matching " + ", ".join(repr(p) for p in self.keep)
        return text


@dataclass(frozen=True)
class Pipeline:
    """Steps applied in order, with a report per step."""

    steps: tuple[Transform, ...] = field(default_factory=tuple)

    @classmethod
    def of(cls, steps: Iterable[Transform]) -> Pipeline:
        return cls(tuple(steps))

    def apply(self, state: Mapping[str, TensorRef]) -> tuple[State, list[StepReport]]:
        """Run every step; returns the new state and one report per step."""
        current: State = dict(state)
        reports = []
        for step in self.steps:
            current, report = step.apply(current)
            reports.append(report)
        return current, reports

    def describe(self) -> list[str]:
        """One line per step, in order."""
        return [step.describe() for step in self.steps]

    def __bool__(self) -> bool:
        return bool(self.steps)


def cast_step(pipeline: Pipeline) -> Cast | None:
    """The pipeline's ``--dtype`` step (its target and keep rules), or None when it casts nothing."""
    return next((step for step in pipeline.steps if isinstance(step, Cast)), None)
