"""The tables: Megatron-Core names to Hugging Face names, one table per model family, as data.

Two passes. :data:`MEGATRON_SPELLINGS` first brings Megatron's several spellings of one model to
one form (the local layer spec's separate norms to Transformer Engine's fused names, which is
also how ``dist_checkpointing`` saves them; experts stacked by ``torch_dist`` or numbered by
Transformer Engine's grouped GEMM to ``local_experts.{E}``; the legacy layout's ``language_model.encoder.…``,
:data:`LEGACY_SPELLINGS`); names it does not match pass on.
Then the family's table maps every name, and :func:`expected` says which names and shapes the
config's model has, so that what a table produced is checked against the config, name by name.

=========================================================  =====================================================
Megatron-Core                                              Hugging Face (Llama, Mistral, Qwen2, Qwen3)
=========================================================  =====================================================
``embedding.word_embeddings.weight`` (padded)              ``model.embed_tokens.weight`` (``vocab_size`` rows)
``output_layer.weight`` (padded)                           ``lm_head.weight`` (none when the config ties them)
``decoder.final_layernorm.weight``                         ``model.norm.weight``
``….self_attention.linear_qkv.layer_norm_weight``          ``….input_layernorm.weight``
``….self_attention.linear_qkv.{weight,bias}``              ``….self_attn.{q,k,v}_proj.*`` (per query group)
``….self_attention.linear_proj.{weight,bias}``             ``….self_attn.o_proj.*``
``….self_attention.{q,k}_layernorm.weight``                ``….self_attn.{q,k}_norm.weight`` (Qwen3)
``….mlp.linear_fc1.layer_norm_weight``                     ``….post_attention_layernorm.weight``
``….mlp.linear_fc1.{weight,bias}``                         ``….mlp.{gate,up}_proj.*`` (first half gate)
``….mlp.linear_fc2.{weight,bias}``                         ``….mlp.down_proj.*``
``….mlp.router.weight``                                    ``….mlp.gate.weight`` (Mixtral per expert:
                                                           ``….block_sparse_moe.gate.weight``)
``….mlp.experts.local_experts.{E}.linear_fc1.weight``      fused (transformers 5): ``….mlp.experts.gate_up_proj``
                                                           ``[E, 2I, H]``; per expert: Mixtral ``w1`` (gate),
                                                           ``w3`` (up); Qwen3-MoE ``gate_proj``, ``up_proj``
``….mlp.experts.local_experts.{E}.linear_fc2.weight``      fused: ``….mlp.experts.down_proj`` ``[E, H, I]``;
                                                           per expert: Mixtral ``w2``; Qwen3-MoE ``down_proj``
=========================================================  =====================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptconv.architectures.operations import Chunk, Operation, Rename, Rows, SplitQKV, Stack, Unstack

__all__ = [
    "EXPERT_LAYOUTS",
    "FAMILIES",
    "LEGACY_SPELLINGS",
    "MEGATRON_SPELLINGS",
    "TORCH_DIST_EXPERTS",
    "expected",
    "table",
]

_M = "decoder.layers.{L}."
_H = "model.layers.{L}."
_EXPERT = _M + "mlp.experts.local_experts.{E}."

#: The experts of a layer as ``torch_dist`` saves them (stacked) to one per expert; run backwards by ``to_megatron``.
TORCH_DIST_EXPERTS: tuple[Operation, ...] = (
    Unstack(_M + "mlp.experts.experts.linear_fc1.weight", (_EXPERT + "linear_fc1.weight",)),
    Unstack(_M + "mlp.experts.experts.linear_fc2.weight", (_EXPERT + "linear_fc2.weight",)),
)

MEGATRON_SPELLINGS: tuple[Operation, ...] = (
    Rename(_M + "input_layernorm.weight", _M + "self_attention.linear_qkv.layer_norm_weight"),
    Rename(_M + "pre_mlp_layernorm.weight", _M + "mlp.linear_fc1.layer_norm_weight"),
    *TORCH_DIST_EXPERTS,
    Rename(_M + "mlp.experts.linear_fc1.weight{E}", _EXPERT + "linear_fc1.weight"),
    Rename(_M + "mlp.experts.linear_fc2.weight{E}", _EXPERT + "linear_fc2.weight"),
)


def _legacy(encoder: str) -> tuple[Operation, ...]:
    """Megatron-LM's names before Megatron-Core (the nested ``language_model`` layout, flattened by the legacy
    reader; ``checkpoint_version`` 2.0 and later, whose fused QKV rows are Megatron-Core's) to Megatron-Core's."""
    p = f"language_model.{encoder}.layers.{{L}}."
    pairs = (
        ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
        ("self_attention.query_key_value.weight", "self_attention.linear_qkv.weight"),
        ("self_attention.query_key_value.bias", "self_attention.linear_qkv.bias"),
        ("self_attention.dense.weight", "self_attention.linear_proj.weight"),
        ("self_attention.dense.bias", "self_attention.linear_proj.bias"),
        ("post_attention_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
        ("mlp.dense_h_to_4h.weight", "mlp.linear_fc1.weight"),
        ("mlp.dense_h_to_4h.bias", "mlp.linear_fc1.bias"),
        ("mlp.dense_4h_to_h.weight", "mlp.linear_fc2.weight"),
        ("mlp.dense_4h_to_h.bias", "mlp.linear_fc2.bias"),
    )
    ends = tuple(Rename(f"language_model.{encoder}.{n}.weight", "decoder.final_layernorm.weight") for n in _FINAL)
    return tuple(Rename(p + legacy, _M + core) for legacy, core in pairs) + ends


_FINAL = ("final_layernorm", "final_norm")
#: The legacy layout's names (``language_model.encoder.…``; ``transformer`` before that) to Megatron-Core's.
LEGACY_SPELLINGS: tuple[Operation, ...] = (
    Rename("language_model.embedding.word_embeddings.weight", "embedding.word_embeddings.weight"),
    Rename("language_model.output_layer.weight", "output_layer.weight"),
    *_legacy("encoder"),
    *_legacy("transformer"),
)
MEGATRON_SPELLINGS = MEGATRON_SPELLINGS + LEGACY_SPELLINGS

_ENDS: tuple[Operation, ...] = (
    Rows("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    Rows("output_layer.weight", "lm_head.weight"),
    Rename("decoder.final_layernorm.weight", "model.norm.weight"),
)

_ATTENTION: tuple[Operation, ...] = (
    Rename(_M + "self_attention.linear_qkv.layer_norm_weight", _H + "input_layernorm.weight"),
    SplitQKV(
        _M + "self_attention.linear_qkv.weight",
        (_H + "self_attn.q_proj.weight", _H + "self_attn.k_proj.weight", _H + "self_attn.v_proj.weight"),
    ),
    SplitQKV(
        _M + "self_attention.linear_qkv.bias",
        (_H + "self_attn.q_proj.bias", _H + "self_attn.k_proj.bias", _H + "self_attn.v_proj.bias"),
    ),
    Rename(_M + "self_attention.linear_proj.weight", _H + "self_attn.o_proj.weight"),
    Rename(_M + "self_attention.linear_proj.bias", _H + "self_attn.o_proj.bias"),
    Rename(_M + "self_attention.q_layernorm.weight", _H + "self_attn.q_norm.weight"),
    Rename(_M + "self_attention.k_layernorm.weight", _H + "self_attn.k_norm.weight"),
    Rename(_M + "mlp.linear_fc1.layer_norm_weight", _H + "post_attention_layernorm.weight"),
)

_DENSE_MLP: tuple[Operation, ...] = (
    Chunk(_M + "mlp.linear_fc1.weight", (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight")),
    Chunk(_M + "mlp.linear_fc1.bias", (_H + "mlp.gate_proj.bias", _H + "mlp.up_proj.bias")),
    Rename(_M + "mlp.linear_fc2.weight", _H + "mlp.down_proj.weight"),
    Rename(_M + "mlp.linear_fc2.bias", _H + "mlp.down_proj.bias"),
)

DENSE: tuple[Operation, ...] = _ENDS + _ATTENTION + _DENSE_MLP

#: transformers 5's fused experts (its ``conversion_mapping.py`` merges the per-expert ones into these)
_FUSED: tuple[Operation, ...] = (
    Rename(_M + "mlp.router.weight", _H + "mlp.gate.weight"),
    Stack((_EXPERT + "linear_fc1.weight",), _H + "mlp.experts.gate_up_proj"),
    Stack((_EXPERT + "linear_fc2.weight",), _H + "mlp.experts.down_proj"),
)

_MIXTRAL_PER_EXPERT: tuple[Operation, ...] = (
    Rename(_M + "mlp.router.weight", _H + "block_sparse_moe.gate.weight"),
    Chunk(
        _EXPERT + "linear_fc1.weight",
        (_H + "block_sparse_moe.experts.{E}.w1.weight", _H + "block_sparse_moe.experts.{E}.w3.weight"),
    ),
    Rename(_EXPERT + "linear_fc2.weight", _H + "block_sparse_moe.experts.{E}.w2.weight"),
)

_QWEN_PER_EXPERT: tuple[Operation, ...] = (
    Rename(_M + "mlp.router.weight", _H + "mlp.gate.weight"),
    Chunk(
        _EXPERT + "linear_fc1.weight", (_H + "mlp.experts.{E}.gate_proj.weight", _H + "mlp.experts.{E}.up_proj.weight")
    ),
    Rename(_EXPERT + "linear_fc2.weight", _H + "mlp.experts.{E}.down_proj.weight"),
)

EXPERT_LAYOUTS = ("fused", "per_expert")

#: model_type -> (family, the per-expert table or None for a dense family)
FAMILIES: Mapping[str, tuple[str, tuple[Operation, ...] | None]] = {
    "llama": ("dense", None),
    "mistral": ("dense", None),
    "qwen2": ("dense", None),
    "qwen3": ("dense", None),
    "mixtral": ("moe", _MIXTRAL_PER_EXPERT),
    "qwen3_moe": ("moe", _QWEN_PER_EXPERT),
}


def table(model_type: str, layout: str) -> tuple[Operation, ...]:
    """The rules for ``model_type`` (a key of :data:`FAMILIES`), experts in ``layout``."""
    family, per_expert = FAMILIES[model_type]
    if family == "dense" or per_expert is None:
        return DENSE
    return DENSE + (_FUSED if layout == "fused" else per_expert)


def _moe_layer(config: Mapping[str, Any], layer: int) -> bool:
    if config.get("model_type") == "mixtral":
        return True
    step = int(config.get("decoder_sparse_step") or 1)
    return layer not in (config.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def expected(config: Mapping[str, Any], layout: str, tied: bool) -> dict[str, tuple[int, ...]]:
    """Every name the config's Hugging Face model has, with its shape."""
    model_type = str(config["model_type"])
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    groups = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    vocab, inter = int(config["vocab_size"]), int(config["intermediate_size"])
    qkv_bias = model_type == "qwen2" or bool(config.get("attention_bias"))
    o_bias = model_type != "qwen2" and bool(config.get("attention_bias"))
    mlp_bias = bool(config.get("mlp_bias"))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    for layer in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        for name, rows in (("q", heads * head_dim), ("k", groups * head_dim), ("v", groups * head_dim)):
            shapes[p + f"self_attn.{name}_proj.weight"] = (rows, hidden)
            if qkv_bias:
                shapes[p + f"self_attn.{name}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        if o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (hidden,)
        if model_type in ("qwen3", "qwen3_moe"):
            shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
        if FAMILIES[model_type][0] == "moe" and _moe_layer(config, layer):
            _experts(shapes, config, p, layout, hidden)
            continue
        for name, shape in (
            ("gate_proj", (inter, hidden)),
            ("up_proj", (inter, hidden)),
            ("down_proj", (hidden, inter)),
        ):
            shapes[p + f"mlp.{name}.weight"] = shape
            if mlp_bias:
                shapes[p + f"mlp.{name}.bias"] = shape[:1]
    return shapes


def _experts(shapes: dict[str, tuple[int, ...]], config: Mapping[str, Any], p: str, layout: str, hidden: int) -> None:
    mixtral = config["model_type"] == "mixtral"
    count = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    inter = int(config["intermediate_size"] if mixtral else config["moe_intermediate_size"])
    if layout == "fused":
        shapes[p + "mlp.gate.weight"] = (count, hidden)
        shapes[p + "mlp.experts.gate_up_proj"] = (count, 2 * inter, hidden)
        shapes[p + "mlp.experts.down_proj"] = (count, hidden, inter)
        return
    block = p + ("block_sparse_moe." if mixtral else "mlp.")
    shapes[block + "gate.weight"] = (count, hidden)
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for e in range(count):
        shapes[block + f"experts.{e}.{names[0]}.weight"] = (inter, hidden)
        shapes[block + f"experts.{e}.{names[1]}.weight"] = (inter, hidden)
        shapes[block + f"experts.{e}.{names[2]}.weight"] = (hidden, inter)
