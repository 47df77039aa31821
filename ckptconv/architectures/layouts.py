"""Hugging Face mixture-of-experts layouts: per expert (the Hub's, and what transformers 5 saves by default) and
fused (transformers 5's experts in memory, and ``save_pretrained(save_original_format=False)``'s).

One table per family, per expert to fused, read the way transformers 5.25's ``conversion_mapping.py`` writes
its rules (``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)``); the way back is the same table inverted:

==============  ==========================================================  ======================================
family          per expert                                                  fused
==============  ==========================================================  ======================================
Mixtral         ``….block_sparse_moe.experts.{E}.{w1,w3}.weight`` [I, H]    ``….mlp.experts.gate_up_proj`` [E,2I,H]
                ``….block_sparse_moe.experts.{E}.w2.weight`` [H, I]         ``….mlp.experts.down_proj`` [E, H, I]
                ``….block_sparse_moe.gate.weight``                          ``….mlp.gate.weight``
Qwen2-MoE,      ``….mlp.experts.{E}.{gate,up}_proj.weight``                 ``….mlp.experts.gate_up_proj``
Qwen3-MoE,      ``….mlp.experts.{E}.down_proj.weight``                      ``….mlp.experts.down_proj``
OLMoE,
DeepSeek-V2/V3
gpt-oss         (none: transformers holds and saves it fused only)          ``….mlp.experts.gate_up_proj`` …
==============  ==========================================================  ======================================

Shared experts, routers and dense layers are not experts and pass as they are. fp8 blocks move with their
scales (``experts.{E}.gate_proj.weight_scale_inv`` ... into ``experts.gate_up_proj_scale_inv`` [E, 2I/128, H/128],
as transformers' quantizer copies each rule for them); experts quantized any other way are refused.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

from ckptconv.architectures.mapping import bounded_list, run_table
from ckptconv.architectures.operations import Operation, Rename, Stack
from ckptconv.errors import TransformError
from ckptconv.values.tensor import TensorRef

__all__ = ["FUSED_ONLY", "PER_EXPERT_TO_FUSED", "change_layout", "layout_of", "table"]


_L = "model.layers.{L}."


def _gated(block: str, gate: str, up: str, down: str) -> tuple[Operation, ...]:
    experts, fused = _L + block + "experts.{E}.", _L + "mlp.experts."
    return (
        Stack((experts + gate + ".weight", experts + up + ".weight"), fused + "gate_up_proj"),
        Stack((experts + down + ".weight",), fused + "down_proj"),
        # fp8 blocks: transformers' quantizer copies each converter for the scales (base.update_weight_conversions)
        Stack(
            (experts + gate + ".weight_scale_inv", experts + up + ".weight_scale_inv"), fused + "gate_up_proj_scale_inv"
        ),
        Stack((experts + down + ".weight_scale_inv",), fused + "down_proj_scale_inv"),
    )


_QWEN = _gated("mlp.", "gate_proj", "up_proj", "down_proj")

#: model_type -> the rules from per expert to fused (the inverse of each rule gives the way back)
PER_EXPERT_TO_FUSED: Mapping[str, tuple[Operation, ...]] = {
    "mixtral": (
        Rename(_L + "block_sparse_moe.gate.weight", _L + "mlp.gate.weight"),
        *_gated("block_sparse_moe.", "w1", "w3", "w2"),
    ),
    "qwen2_moe": _QWEN,
    "qwen3_moe": _QWEN,
    "olmoe": _QWEN,
    "deepseek_v2": _QWEN,
    "deepseek_v3": _QWEN,
}
#: families whose experts transformers holds and saves fused only
FUSED_ONLY = frozenset({"gpt_oss"})

_FUSED = re.compile(r"(^|\.)experts\.(gate_up_proj|down_proj)")
_PER_EXPERT = re.compile(r"(^|\.)experts\.\d+\.")


def layout_of(names: Collection[str]) -> str | None:
    """``"fused"``, ``"per-expert"``, ``"mixed"`` (both), or None for names with no routed experts."""
    fused = any(_FUSED.search(name) for name in names)
    per_expert = any(_PER_EXPERT.search(name) for name in names)
    return "mixed" if fused and per_expert else "fused" if fused else "per-expert" if per_expert else None


def table(model_type: str, layout: str) -> tuple[Operation, ...]:
    """The rules that bring ``model_type``'s experts from the other layout into ``layout``."""
    rules = PER_EXPERT_TO_FUSED[model_type]
    return rules if layout == "fused" else tuple(rule.inverse() for rule in rules)


def change_layout(
    weights: Mapping[str, TensorRef], config: Mapping[str, Any], layout: str
) -> tuple[dict[str, TensorRef], str | None]:
    """``weights`` with their experts in ``layout`` (``"fused"`` or ``"per-expert"``), and a note on the move
    (None when they are in it already or have no experts).

    Raises:
        TransformError: in one line: a family without a table, a layout the family does not have, a source
            holding both layouts or lacking one expert's tensor, quantized experts.
    """
    if layout not in ("fused", "per-expert"):
        raise TransformError(f"layout must be 'fused' or 'per-expert', not {layout!r}")
    current = layout_of(weights)
    model_type = str(config.get("model_type"))
    if current is None or current == layout:
        return dict(weights), None
    if current == "mixed":
        raise TransformError("the source holds experts both fused and per expert; give it one layout")
    if model_type in FUSED_ONLY:
        raise TransformError(f"{model_type} has no per-expert layout in transformers; its experts stay fused")
    if model_type not in PER_EXPERT_TO_FUSED:
        raise TransformError(
            f"no expert-layout table for model_type {model_type!r}; known: {', '.join(sorted(PER_EXPERT_TO_FUSED))}"
        )
    moved = run_table(table(model_type, layout), weights, config, strict=False, what="expert")
    stranded = [name for name in moved if (_PER_EXPERT if current == "per-expert" else _FUSED).search(name)]
    if stranded:
        raise TransformError(
            f"cannot move {bounded_list(stranded)} to the {layout} layout (quantized experts' scales, or a tensor "
            "transformers has no place for); dequantize first (--dtype bf16) or keep the layout"
        )
    return moved, f"experts {'fused' if layout == 'fused' else 'one per expert'} as transformers writes them"
