"""Run a family's table over a checkpoint's names: Megatron-Core weights to a Hugging Face model's, and back.

:func:`to_hugging_face` runs a family's table; :func:`to_megatron` runs the same table backwards (every
operation's :meth:`~ckptconv.architectures.operations.Operation.inverse`, last rule first) and then stacks the
layers as Megatron-Core's ``torch_dist`` backend saves them (:func:`torch_dist_names`).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from ckptconv._text import shown
from ckptconv.architectures import families
from ckptconv.architectures.operations import Operation, Stack, compile_pattern
from ckptconv.errors import TransformError
from ckptconv.reading.model_config import parse_model_config
from ckptconv.values.tensor import TensorRef

__all__ = ["expert_layout", "run_table", "to_hugging_face", "to_megatron", "torch_dist_names"]


def bounded_list(names: list[str], limit: int = 4) -> str:
    """The first ``limit`` names, quoted, and how many more."""
    text = ", ".join(shown(name) for name in names[:limit])
    return text + (f" and {len(names) - limit} more" if len(names) > limit else "")


def run_table(
    rules: Iterable[Operation],
    weights: Mapping[str, TensorRef],
    config: Mapping[str, Any],
    *,
    strict: bool,
    what: str = "Megatron",
) -> dict[str, TensorRef]:
    """Each name through the first rule one of whose sources matches it; names of one rule with the same fields
    (but the gathered one) go to it together. ``strict``: a name no rule matches is refused; else it passes."""
    rules = tuple(rules)
    compiled = [[compile_pattern(source) for source in rule.sources] for rule in rules]
    groups: dict[tuple[int, tuple[tuple[str, str], ...]], dict[tuple[int, int | None], TensorRef]] = {}
    out: dict[str, TensorRef] = {}
    unknown: list[str] = []
    for name, ref in weights.items():
        for index, patterns in enumerate(compiled):
            hit = next(((source, m) for source, p in enumerate(patterns) if (m := p.match(name))), None)
            if hit is None:
                continue
            fields = hit[1].groupdict()
            gathered = rules[index].gathers
            at = int(fields.pop(gathered)) if gathered else None
            group = groups.setdefault((index, tuple(sorted(fields.items()))), {})
            if (hit[0], at) in group:  # experts.01 and experts.1
                raise TransformError(f"{name!r} and another name are both {gathered} {at}; rename one")
            group[(hit[0], at)] = ref
            break
        else:
            if strict:
                unknown.append(name)
            else:
                out[name] = ref
    if unknown:
        raise TransformError(
            f"no rule maps {len(unknown)} {what} name(s) to a {config.get('model_type')} model: {bounded_list(unknown)}"
        )
    for (index, key), pieces in sorted(groups.items(), key=lambda item: item[0][0]):
        for target, ref in rules[index].map(dict(key), pieces, config):
            if target in out:
                raise TransformError(f"two {what} tensors would both become {target!r}")
            out[target] = ref
    return out


def expert_layout(reference_names: Collection[str] | None, config: Mapping[str, Any]) -> str:
    """``"fused"`` (transformers 5's ``experts.gate_up_proj``) or ``"per_expert"`` (the Hub's ``experts.N.*``).

    From the reference's names where given; else per expert, the layout Hub checkpoints hold and
    every transformers version (5 merges them on load) reads.
    """
    if reference_names is not None:
        if any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in reference_names):
            return "fused"
        return "per_expert"
    return "per_expert"


def _checked(config: Mapping[str, Any], weights: Mapping[str, TensorRef]) -> dict[str, Any]:
    """The config's checked fields (:mod:`ckptconv.reading.model_config`): those the tables need present, every
    size and count bounded by the tensors before a table is sized by them."""
    parsed = parse_model_config(config)
    family = families.FAMILIES.get(str(parsed.model_type))
    if family is not None:
        parsed.require("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")
        if family[0] == "moe":
            parsed.require("num_local_experts" if parsed.num_experts is None else "model_type")
        if family[0] == "moe" and parsed.model_type != "mixtral":
            parsed.require("moe_intermediate_size")
    parsed.check_against(ref.shape for ref in weights.values())
    return parsed.fields()


def to_hugging_face(
    weights: Mapping[str, TensorRef],
    config: Mapping[str, Any],
    *,
    experts: str | None = None,
    reference_names: Collection[str] | None = None,
) -> dict[str, TensorRef]:
    """Megatron-Core weights (``decoder.layers.N.…``) under the names and sizes of ``config``'s HF model.

    Args:
        weights: a Megatron-Core model's tensors, as ``ckptconv.open(folder).select().weights``
            gives them (``torch_dist`` folders, or a ``state_dict()`` of the local or TE spec).
        config: the Hugging Face ``config.json`` as a dict; its ``model_type`` picks the table
            (:data:`ckptconv.architectures.families.FAMILIES`), its sizes check every tensor, its
            ``vocab_size`` strips Megatron's vocabulary padding, its ``tie_word_embeddings`` says
            whether ``lm_head.weight`` is written.
        experts: ``"fused"`` or ``"per_expert"`` for a mixture of experts; None: from
            ``reference_names`` (see :func:`expert_layout`).
        reference_names: the names of the model being matched (a reference folder's keys), if any.

    Returns:
        The tensors by Hugging Face name, lazy: renames and row blocks are the same bytes, the QKV
        split and the stacked experts are computed when a writer reads them.

    Raises:
        InvalidConfigError: in one line, for a field the table needs that is missing, of the wrong type, out of
            range, or larger than the tensors present could hold.
        TransformError: in one line, for an unknown ``model_type``, a name no rule maps, a size that
            disagrees with the config, or a name the config's model has that the checkpoint lacks.
    """
    config = _checked(config, weights)
    model_type = config.get("model_type")
    if model_type not in families.FAMILIES:
        raise TransformError(
            f"no Megatron-Core table for model_type {model_type!r}; known: {', '.join(sorted(families.FAMILIES))}"
        )
    layout = experts or expert_layout(reference_names, config)
    if layout not in families.EXPERT_LAYOUTS:
        raise TransformError(f"experts must be one of {', '.join(families.EXPERT_LAYOUTS)}, not {layout!r}")
    tied = bool(config.get("tie_word_embeddings", False))
    canonical = run_table(families.MEGATRON_SPELLINGS, weights, config, strict=False)
    if tied and "output_layer.weight" in canonical:
        raise TransformError(
            "the config ties the output layer to the embedding (tie_word_embeddings), but the checkpoint has an "
            "output_layer.weight of its own; give the config tie_word_embeddings: false"
        )
    if not tied and "output_layer.weight" not in canonical and "embedding.word_embeddings.weight" in canonical:
        canonical["output_layer.weight"] = canonical["embedding.word_embeddings.weight"]  # shared in Megatron
    mapped = run_table(families.table(str(model_type), layout), canonical, config, strict=True)
    want = families.expected(config, layout, tied)
    missing = [name for name in want if name not in mapped]
    extra = [name for name in mapped if name not in want]
    if missing or extra:
        parts = ([f"lacks {bounded_list(missing)}"] if missing else []) + (
            [f"has no place for {bounded_list(extra)}"] if extra else []
        )
        raise TransformError(f"the checkpoint does not make the config's {model_type} model: it {'; it '.join(parts)}")
    wrong = [f"{n} {list(mapped[n].shape)} (config: {list(s)})" for n, s in want.items() if mapped[n].shape != s]
    if wrong:
        raise TransformError(f"sizes disagree with the config: {bounded_list(wrong)}")
    return {name: mapped[name] for name in want}


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def torch_dist_names(weights: Mapping[str, TensorRef]) -> dict[str, TensorRef]:
    """Megatron-Core's names one per layer (``decoder.layers.{L}.…``, what :func:`to_megatron` gives) as its
    ``torch_dist`` backend saves them: each layer's weight of one kind stacked along a new dim 0
    (``decoder.layers.…`` ``[L, …]``), the inverse of the split :mod:`ckptconv.reading.formats.megatron` makes.
    Other names pass as they are.

    Raises:
        TransformError: a layer that lacks a weight another layer has (Megatron stacks them all).
    """
    kinds = sorted({m[2] for name in weights if (m := _LAYER.match(name))})
    layers = [Stack(("decoder.layers.{L}." + kind,), "decoder.layers." + kind, "L") for kind in kinds]
    return run_table(layers, weights, {}, strict=False)


def to_megatron(
    weights: Mapping[str, TensorRef],
    config: Mapping[str, Any],
    *,
    padded_vocab_size: int | None = None,
) -> dict[str, TensorRef]:
    """A Hugging Face model's weights under Megatron-Core's names, as ckptconv reads a ``torch_dist`` folder that
    ``dist_checkpointing.save`` wrote for a ``GPTModel``: one name per layer (:func:`torch_dist_names` stacks them
    as the folder holds them), a layer's experts stacked (``….mlp.experts.experts.linear_fc1.weight`` ``[E, …]``).

    The family's table (:data:`families.FAMILIES`, picked by ``config["model_type"]``) run backwards: each rule's
    inverse, so the QKV rows are merged per query group, gate and up joined into ``linear_fc1``, the experts
    stacked, bit for bit what :func:`to_hugging_face` splits; then :data:`families.TORCH_DIST_EXPERTS` backwards.
    Layer norms take the names ``dist_checkpointing`` saves under (``self_attention.linear_qkv.layer_norm_weight``,
    ``mlp.linear_fc1.layer_norm_weight``) with either layer spec. A config that ties the embedding
    (``tie_word_embeddings``) gives no ``output_layer.weight``, as Megatron's
    ``share_embeddings_and_output_weights`` saves none.

    Args:
        weights: the model's tensors by Hugging Face name, experts in either layout.
        config: its ``config.json`` as a dict.
        padded_vocab_size: the rows Megatron's embedding and output layer have (its vocabulary padded to a
            multiple of ``make_vocab_size_divisible_by`` times the tensor-parallel size); the rows past
            ``vocab_size`` are zeros (a Hugging Face model has none to give; Megatron cuts their logits off).
            None: ``vocab_size`` rows, no padding.

    Raises:
        InvalidConfigError: see :func:`to_hugging_face`.
        TransformError: in one line, for an unknown ``model_type``, a name no rule maps, a tensor the config's model
            has that the weights lack (or the other way), a size that disagrees with the config, or a
            ``padded_vocab_size`` below ``vocab_size``.
    """
    config = _checked(config, weights)
    model_type = config.get("model_type")
    if model_type not in families.FAMILIES:
        raise TransformError(
            f"no Megatron-Core table for model_type {model_type!r}; known: {', '.join(sorted(families.FAMILIES))}"
        )
    layout = expert_layout(list(weights), config)
    tied = bool(config.get("tie_word_embeddings", False))
    want = families.expected(config, layout, tied)
    missing = [name for name in want if name not in weights]
    extra = [name for name in weights if name not in want]
    if missing or extra:
        parts = ([f"lack {bounded_list(missing)}"] if missing else []) + (
            [f"hold {bounded_list(extra)}, which it has no place for"] if extra else []
        )
        raise TransformError(f"the weights do not make the config's {model_type} model: they {'; they '.join(parts)}")
    wrong = [f"{n} {list(weights[n].shape)} (config: {list(s)})" for n, s in want.items() if weights[n].shape != s]
    if wrong:
        raise TransformError(f"sizes disagree with the config: {bounded_list(wrong)}")
    vocab = int(config["vocab_size"])
    if padded_vocab_size is not None and padded_vocab_size < vocab:
        raise TransformError(f"padded_vocab_size {padded_vocab_size} is below the config's vocab_size {vocab}")
    sized = dict(config, padded_vocab_size=padded_vocab_size or vocab)
    backwards = [rule.inverse() for rule in reversed(families.table(str(model_type), layout))]
    mapped = run_table(backwards, weights, sized, strict=True, what="Hugging Face")
    return run_table([op.inverse() for op in families.TORCH_DIST_EXPERTS], mapped, sized, strict=False)
