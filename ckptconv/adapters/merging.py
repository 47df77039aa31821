"""``merge_lora()``: a PEFT LoRA adapter merged into its base, as a step of convert's pipeline.

The merge is a transform (:class:`MergeLora`): each base tensor an adapter changes becomes a lazy tensor whose
bytes are computed when the writer reaches it (the base tensor read, its delta computed and added, written),
so memory stays bounded by the largest base tensor and its adapter, as for ``convert``. Everything else of
``convert`` applies unchanged: the model folder's configs and tokenizer carried, sharding, ``--dtype`` (cast
after the merge: PEFT merges in the base's dtype), ``--to``, ``--verify``, the provenance (which records each
adapter, its sha256 and its scalings, in ``ckptconv.transforms``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptconv._paths import PathLike, as_path
from ckptconv._text import plural, short_repr
from ckptconv.adapters import arithmetic, weighting
from ckptconv.adapters.folder import Adapter, open_adapter
from ckptconv.adapters.plan import plan_merge
from ckptconv.conversion import ConversionReport, convert
from ckptconv.errors import TransformError
from ckptconv.options import ConversionOptions
from ckptconv.reading.model_folder import model_folder
from ckptconv.reading.model_folder import read_config as read_model_config
from ckptconv.reading.sources import computed_tensor
from ckptconv.transforms.keys import Cast, Pipeline, State, StepReport
from ckptconv.values.tensor import TensorRef

__all__ = ["MergeLora", "merge_lora"]


def _scales(adapter: Adapter) -> str:
    """The scalings the adapter's LoRAs merge with, for the provenance (one, or each with its count)."""
    config = adapter.config
    names = [*adapter.tensors.linear, *adapter.tensors.embedding]
    for module in adapter.tensors.parameters:  # rank_pattern/alpha_pattern match a parameter's key
        for owner, _, parameter in (name.rpartition(".") for name in config.target_parameters):
            if module == owner or module.endswith("." + owner):
                names.append(f"{module}.{parameter}")
    counts: dict[float, int] = {}
    for name in names:
        scaling = config.scaling(name)
        counts[scaling] = counts.get(scaling, 0) + 1
    if not counts:
        return "no LoRA: modules to save only"
    if len(counts) == 1:
        return f"scaling {next(iter(counts))!r}"
    return "scalings " + ", ".join(f"{scale!r} ({plural(n, 'module')})" for scale, n in counts.items())


@dataclass(frozen=True)
class MergeLora:
    """The key-preserving step that merges ``adapter`` into the state dict, as PEFT's ``merge_and_unload()``.

    Attributes:
        adapter: the adapter (:func:`open_adapter`).
        model_type: the base's ``config.json`` ``model_type`` (tells a square GPT-2 Conv1D weight from a Linear).
    """

    adapter: Adapter
    model_type: str = ""

    def apply(self, state: Mapping[str, TensorRef]) -> tuple[State, StepReport]:
        where = repr(self.adapter.folder)
        plans = plan_merge(state, self.adapter.tensors, self.adapter.config, model_type=self.model_type, where=where)
        result: State = {}
        for key, ref in state.items():
            plan = plans.get(key)
            if plan is None:
                result[key] = ref
                continue
            compute = functools.partial(arithmetic.compute, plan)
            result[key] = computed_tensor(key, compute, plan.inputs, plan.dtype, tuple(ref.shape))
        merged = sum(plan.kind not in ("replace", "bias") for plan in plans.values())
        replaced = sum(plan.kind == "replace" for plan in plans.values())
        note = f"merged LoRA {short_repr(self.adapter.name)} into {plural(merged, 'weight')}" + (
            f", replaced {plural(replaced, 'tensor')} with the adapter's (modules_to_save)" if replaced else ""
        )
        return result, StepReport(self.describe(), len(plans), len(state) - len(plans), notes=(note,))

    def describe(self) -> str:
        adapter, config = self.adapter, self.adapter.config
        kind = "DoRA" if config.use_dora else "rsLoRA" if config.use_rslora else "LoRA"
        return (
            f"merge {kind} {adapter.name!r} (sha256 {adapter.sha256}, r={config.r}, alpha={config.lora_alpha}, "
            f"{_scales(adapter)})"
        )


def _model_type(base: str) -> str:
    folder = model_folder(base)
    config = read_model_config(folder) if folder is not None else None
    value = config.get("model_type") if config is not None else None
    return value if isinstance(value, str) else ""


def _check_sequence(adapters: Sequence[Adapter]) -> None:
    """Several adapters merge one after another, as PEFT merges its active adapters, where that is a sequence of
    independent additions: not DoRA (PEFT unmerges and merges the others again around each DoRA adapter), not
    tensors an adapter replaces (PEFT loads every adapter's before it merges any)."""
    for adapter in adapters:
        held = [*adapter.tensors.saved, *adapter.tensors.base_layers]
        if adapter.config.use_dora or held:
            what = "is DoRA" if adapter.config.use_dora else f"replaces {short_repr(held[0])}"
            raise TransformError(
                f"{adapter.folder!r} {what}; ckptconv merges such an adapter alone: merge one adapter at a time"
            )


def _with_merge(pipeline: Pipeline, steps: Sequence[Any]) -> Pipeline:
    """The merge steps after the key steps, before the cast: PEFT merges in the base's dtype."""
    existing = list(pipeline.steps)
    at = next((i for i, step in enumerate(existing) if isinstance(step, Cast)), len(existing))
    return Pipeline.of([*existing[:at], *steps, *existing[at:]])


def merge_lora(
    base: PathLike,
    adapter: PathLike | Sequence[PathLike],
    destination: PathLike | None,
    *,
    options: ConversionOptions | None = None,
    weights: Sequence[float] | None = None,
    dry_run: bool = False,
    progress: Any = False,
    **changes: Any,
) -> ConversionReport:
    """Merge a PEFT LoRA adapter into its base model, bit for bit as PEFT's ``merge_and_unload()`` on the CPU.

    The result equals ``PeftModel.from_pretrained(AutoModel.from_pretrained(base, dtype=<the base's dtype>),
    adapter).merge_and_unload()``'s state dict, tensor for tensor and bit for bit, with the same torch build
    (see :mod:`ckptconv.adapters.arithmetic`); it streams, one base tensor at a time. Settings PEFT merges that
    ckptconv does not reproduce exactly are refused in one line.

    Args:
        base: the base model: a model folder (sharded or not, safetensors or ``.bin``) or a checkpoint file.
        adapter: a PEFT adapter folder, or several, merged in order (each into the result of the one before).
        destination: the output (a folder gets a model folder, configs carried), as for :func:`ckptconv.convert`.
        options: how to convert (``--dtype`` applies after the merge); defaults when None.
        weights: one weight per adapter: the adapters are combined as PEFT's
            ``add_weighted_adapter(adapters, weights, name, combination_type="cat")`` combines them, and that
            adapter is merged (see :mod:`ckptconv.adapters.weighting`); None merges them in turn, unweighted.
        dry_run: plan everything, write nothing.
        progress: as for :func:`ckptconv.convert`.
        **changes: fields of :class:`~ckptconv.options.ConversionOptions`.

    Returns:
        The :class:`~ckptconv.conversion.ConversionReport`; a step per adapter says what was merged.

    Raises:
        TransformError: the adapter cannot be merged exactly (named), or torch is missing.
        LoadError, WriteError, VerifyError: as for :func:`ckptconv.convert`.

    Example:
        >>> ckptconv.merge_lora("llama/", "my_adapter/", "merged/", dtype="bf16")  # doctest: +SKIP
    """
    arithmetic.require_torch()
    base = as_path(base)
    options = (options or ConversionOptions()).with_changes("merge_lora", **changes)
    paths = [adapter] if isinstance(adapter, (str, bytes, os.PathLike)) else list(adapter)
    if not paths:
        raise TypeError("merge_lora() needs at least one adapter")
    model_type = _model_type(base)
    steps: list[Any] = [MergeLora(open_adapter(path), model_type) for path in paths]
    if weights is not None:
        adapters, weighted = tuple(step.adapter for step in steps), tuple(float(w) for w in weights)
        weighting.check(adapters, weighted)
        steps = [weighting.MergeWeighted(adapters, weighted, model_type)]
    elif len(steps) > 1:
        _check_sequence([step.adapter for step in steps])
    options = dataclasses.replace(options, transforms=_with_merge(options.transforms, steps))
    return convert(base, destination, options=options, dry_run=dry_run, progress=progress)
