"""Weighted adapters: PEFT's ``add_weighted_adapter(adapters, weights, name, combination_type="cat")``, merged.

PEFT combines adapters into a new one: for each module, ``lora_A`` is the concatenation of each adapter's ``A``
times its weight and scaling, ``lora_B`` that of their ``B``, copied into an adapter of rank ``sum(r)`` (and
``lora_alpha`` the same) created in the base's dtype; ``merge_and_unload(adapter_names=[name])`` then merges it
(:mod:`ckptconv.adapters.arithmetic` lists the ops). ``"cat"`` is the exact combination; the others (``svd``,
``linear``, ``ties`` ...) approximate, and are not offered. Adapters with DoRA, rank or alpha patterns, a bias,
modules to save, base layers, convolutions or parameter targets are refused, as PEFT's combination does not
carry them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from ckptconv._text import plural, short_repr
from ckptconv.adapters import arithmetic
from ckptconv.adapters.folder import Adapter
from ckptconv.adapters.plan import TensorPlan, plan_merge
from ckptconv.errors import TransformError
from ckptconv.reading.sources import computed_tensor
from ckptconv.transforms.keys import State, StepReport
from ckptconv.values.tensor import TensorRef

__all__ = ["MergeWeighted"]


def check(adapters: tuple[Adapter, ...], weights: tuple[float, ...]) -> None:
    """Refuse what PEFT's ``cat`` combination does not carry exactly."""
    if len(weights) != len(adapters):
        raise TransformError(f"{plural(len(weights), 'weight')} for {plural(len(adapters), 'adapter')}; give one each")
    if not all(math.isfinite(weight) for weight in weights):
        raise TransformError(f"the weights {list(weights)!r} are not all finite numbers")
    for adapter in adapters:
        config, tensors = adapter.config, adapter.tensors
        held = [*tensors.saved, *tensors.base_layers]
        why = (
            "is DoRA"
            if config.use_dora
            else "has rank or alpha patterns"
            if config.rank_pattern or config.alpha_pattern
            else "has a lora_B bias"
            if config.lora_bias
            else f"replaces {short_repr(held[0])}"
            if held
            else "targets parameters"
            if tensors.parameters
            else ""
        )
        if why:
            raise TransformError(
                f"{adapter.folder!r} {why}; ckptconv weights adapters as PEFT's add_weighted_adapter "
                "combination_type='cat' does, which such an adapter does not go through exactly"
            )


@dataclass(frozen=True)
class MergeWeighted:
    """The step that merges ``adapters`` combined with ``weights`` as PEFT's ``cat`` combination, then merged."""

    adapters: tuple[Adapter, ...]
    weights: tuple[float, ...]
    model_type: str = ""

    def apply(self, state: Mapping[str, TensorRef]) -> tuple[State, StepReport]:
        each = [
            plan_merge(state, a.tensors, a.config, model_type=self.model_type, where=repr(a.folder))
            for a in self.adapters
        ]
        rank = sum(adapter.config.r for adapter in self.adapters)
        first = self.adapters[0].config  # the combined adapter's config is the first's, r and alpha replaced
        scaling = rank / math.sqrt(rank) if first.use_rslora else rank / rank
        plans: dict[str, TensorPlan] = {}
        for key in dict.fromkeys(key for plans_i in each for key in plans_i):
            found = [(str(i), plans_i[key]) for i, plans_i in enumerate(each) if key in plans_i]
            kinds = {plan.kind for _, plan in found}
            if kinds - {"linear", "embedding"} or len(kinds) > 1:
                raise TransformError(f"{short_repr(key)}: ckptconv weights only linear and embedding LoRAs")
            inputs = {"weight": found[0][1].inputs["weight"]}
            for i, plan in found:
                inputs[f"A{i}"], inputs[f"B{i}"] = plan.inputs["A"], plan.inputs["B"]
            parts = tuple((i, self.weights[int(i)], plan.scaling) for i, plan in found)
            template = found[0][1]
            plans[key] = TensorPlan(
                f"cat-{template.kind}",
                inputs,
                template.dtype,
                scaling,
                template.fan_in_fan_out,
                template.module,
                parts=parts,
                rank=rank,
            )
        result: State = {}
        for key, ref in state.items():
            merged = plans.get(key)
            if merged is None:
                result[key] = ref
            else:
                compute = functools.partial(arithmetic.compute, merged)
                result[key] = computed_tensor(key, compute, merged.inputs, merged.dtype, tuple(ref.shape))
        names = ", ".join(short_repr(adapter.name) for adapter in self.adapters)
        note = f"merged LoRAs {names} weighted as PEFT's 'cat' combination into {plural(len(plans), 'weight')}"
        return result, StepReport(self.describe(), len(plans), len(state) - len(plans), notes=(note,))

    def describe(self) -> str:
        parts = ", ".join(
            f"{adapter.name!r} x {weight!r} (sha256 {adapter.sha256}, r={adapter.config.r}, "
            f"alpha={adapter.config.lora_alpha})"
            for adapter, weight in zip(self.adapters, self.weights)
        )
        return f"merge LoRAs weighted (add_weighted_adapter 'cat'): {parts}"
