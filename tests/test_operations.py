"""Every operation of ``architectures/`` undoes its inverse, and every rule table round-trips, bit for bit.

The tensors are made by torch and read back with ``TensorRef.torch()``; the comparison is ``torch.equal`` on the
raw bytes, for every dtype ckptconv maps (a float8 or bfloat16 weight moves as its bytes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptconv
from ckptconv.architectures import families, layouts
from ckptconv.architectures.mapping import run_table, to_hugging_face
from ckptconv.architectures.operations import (
    Chunk,
    Concatenate,
    MergeQKV,
    Operation,
    PadRows,
    Permute,
    Rename,
    Rows,
    SplitQKV,
    Stack,
    Unstack,
)
from ckptconv.gpu.torch_tensors import from_torch

torch = pytest.importorskip("torch")

RUNS = Path(__file__).resolve().parent.parent / "fixtures" / "runs"
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8]


def _random(shape: tuple[int, ...], dtype: Any, seed: int) -> Any:
    generator = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    count = 1
    for n in shape:
        count *= n
    raw = torch.randint(0, 256, (count * size,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def _bytes(tensor: Any) -> Any:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert sorted(a) == sorted(b)
    for name, ref in a.items():
        x, y = ref.torch(), b[name].torch()
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(_bytes(x), _bytes(y)), name


def _round_trip(rules: tuple[Operation, ...], state: dict[str, Any], config: dict[str, Any]) -> None:
    """``state`` through the rules and back through their inverses is ``state``, and the rules moved something."""
    refs = {name: from_torch(tensor) for name, tensor in state.items()}
    there = run_table(rules, refs, config, strict=True, what="test")
    assert set(there) != set(refs)
    back = run_table(tuple(rule.inverse() for rule in rules), there, config, strict=True, what="test")
    _same(back, refs)


CONFIG = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 3, "hidden_size": 5, "vocab_size": 6}


@settings(max_examples=25, deadline=None)
@given(dtype=st.sampled_from(DTYPES), width=st.integers(1, 4), experts=st.integers(1, 4), seed=st.integers(0, 99))
def test_every_operation_undone_by_its_inverse(dtype: Any, width: int, experts: int, seed: int) -> None:
    cases: list[tuple[Operation, dict[str, tuple[int, ...]]]] = [
        (Rename("a.{L}", "b.{L}"), {"a.0": (2, width), "a.3": (width,)}),
        (Chunk("fc1.{L}", ("gate.{L}", "up.{L}")), {"fc1.0": (4, width), "fc1.1": (6,)}),
        (Concatenate(("g", "u", "x"), "gux"), {"g": (2, width), "u": (2, width), "x": (2, width)}),
        (SplitQKV("qkv", ("q", "k", "v")), {"qkv": (24, width)}),
        (MergeQKV(("q", "k", "v"), "qkv"), {"q": (12, width), "k": (6, width), "v": (6, width)}),
        (Unstack("stack.{L}", ("one.{L}.{E}",)), {"stack.0": (experts, 2, width)}),
        (Unstack("fused", ("gate.{E}", "up.{E}")), {"fused": (experts, 4, width)}),
        (Stack(("w.{E}",), "stacked"), {f"w.{e}": (3, width) for e in range(experts)}),
        (Stack(("g.{E}", "u.{E}"), "gu"), {f"{p}.{e}": (2, width) for e in range(experts) for p in "gu"}),
        (Permute("t", "p", (1, 0)), {"t": (3, width)}),
        (Permute("t", "p", (2, 0, 1)), {"t": (2, 3, width)}),
        (PadRows("e", "padded"), {"e": (6, width)}),
        (Rows("padded", "e"), {"padded": (6, width)}),
    ]
    for number, (op, shapes) in enumerate(cases):
        state = {name: _random(shape, dtype, seed + number) for name, shape in shapes.items()}
        if isinstance(op, PadRows | Rows):  # no padding to lose: rows are the identity both ways
            refs = {name: from_torch(t) for name, t in state.items()}
            _same(run_table((op.inverse(),), run_table((op,), refs, CONFIG, strict=True), CONFIG, strict=True), refs)
            continue
        _round_trip((op,), state, CONFIG)
        assert op.inverse().inverse() == op


def test_padding_is_put_back_as_zeros_and_stripped_again() -> None:
    refs = {"e": from_torch(torch.arange(12.0).reshape(6, 2))}
    padded = run_table((PadRows("e", "p"),), refs, {**CONFIG, "padded_vocab_size": 8}, strict=True)
    assert torch.equal(padded["p"].torch(), torch.cat([torch.arange(12.0).reshape(6, 2), torch.zeros(2, 2)]))
    back = run_table((Rows("p", "e"),), padded, CONFIG, strict=True)
    _same(back, refs)


def test_a_split_qkv_merged_again_is_megatrons_own_tensor() -> None:
    qkv = torch.arange(24 * 5, dtype=torch.float32).reshape(24, 5)  # 2 groups of [q q k v] x head_dim 3
    split = run_table((SplitQKV("x", ("q", "k", "v")),), {"x": from_torch(qkv)}, CONFIG, strict=True)
    grouped = qkv.reshape(2, 4, 3, 5)
    assert torch.equal(split["k"].torch(), grouped[:, 2].reshape(6, 5))
    merged = run_table((MergeQKV(("q", "k", "v"), "x"),), split, CONFIG, strict=True)
    assert torch.equal(merged["x"].torch(), qkv)


def _megatron(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    folder = RUNS / name
    return json.loads((folder / "config.json").read_text()), ckptconv.open(folder).select().weights


@pytest.mark.parametrize(
    ("name", "layout"),
    [
        ("megatron_llama", "fused"),
        ("megatron_mixtral", "fused"),
        ("megatron_mixtral", "per_expert"),
        ("megatron_qwen3_moe", "fused"),
        ("megatron_qwen3_moe", "per_expert"),
    ],
)
def test_every_megatron_table_round_trips(name: str, layout: str) -> None:
    """Megatron -> Hugging Face -> Megatron gives Megatron's tensors (the padding rows as zeros), and Hugging
    Face -> Megatron -> Hugging Face gives the Hugging Face ones, bit for bit, through one table and its inverse."""
    config, weights = _megatron(name)
    canonical = run_table(families.MEGATRON_SPELLINGS, weights, config, strict=False)
    rules = families.table(config["model_type"], layout)
    hf = to_hugging_face(weights, config, experts=layout)
    padded = canonical["embedding.word_embeddings.weight"].shape[0]
    back = run_table(tuple(rule.inverse() for rule in rules), hf, {**config, "padded_vocab_size": padded}, strict=True)
    assert sorted(back) == sorted(canonical)
    vocab = config["vocab_size"]
    for key, ref in canonical.items():
        ours, theirs = back[key].torch(), ref.torch()
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert torch.equal(ours[:vocab], theirs[:vocab]) and not ours[vocab:].any(), key
        else:
            assert torch.equal(_bytes(ours), _bytes(theirs)), key
    again = run_table(rules, back, config, strict=True)
    _same({k: again[k] for k in hf}, hf)


@pytest.mark.parametrize("model_type", sorted(layouts.PER_EXPERT_TO_FUSED))
def test_every_expert_layout_table_round_trips(model_type: str) -> None:
    """Per expert -> fused -> per expert, on every dtype: the same bytes under the same names."""
    rules = layouts.PER_EXPERT_TO_FUSED[model_type]
    block = "block_sparse_moe." if model_type == "mixtral" else "mlp."
    names = ("w1", "w3", "w2") if model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for seed, dtype in enumerate(DTYPES):
        state = {f"model.layers.{layer}.{block}gate.weight": _random((3, 4), dtype, seed) for layer in range(2)}
        for layer in range(2):
            for expert in range(3):
                for name, shape in zip(names, ((5, 4), (5, 4), (4, 5))):
                    key = f"model.layers.{layer}.{block}experts.{expert}.{name}.weight"
                    state[key] = _random(shape, dtype, seed + len(state))
        if model_type != "mixtral":
            state = {k: v for k, v in state.items() if not k.endswith("gate.weight")}
        _round_trip(rules, state, {"model_type": model_type})


@pytest.mark.parametrize("chunk", [1, 7, 40, 4096])
def test_a_stack_of_stored_experts_is_their_bytes_read_piece_by_piece(tmp_path: Path, chunk: int) -> None:
    """Stacked experts read from a file are the pieces' own bytes in order (no array of the whole stack is made):
    read in chunks that straddle the pieces, they equal torch's stack of gate and up."""
    from safetensors.torch import save_file

    from ckptconv.architectures.operations import Joined

    gates = [_random((5, 4), torch.bfloat16, e) for e in range(3)]
    ups = [_random((5, 4), torch.bfloat16, 10 + e) for e in range(3)]
    state = {f"m.experts.{e}.gate_proj.weight": gates[e] for e in range(3)}
    state |= {f"m.experts.{e}.up_proj.weight": ups[e] for e in range(3)}
    save_file(state, str(tmp_path / "x.safetensors"))
    refs = ckptconv.open(tmp_path / "x.safetensors").select().weights
    rule = Stack(("m.experts.{E}.gate_proj.weight", "m.experts.{E}.up_proj.weight"), "m.experts.gate_up_proj")
    fused = run_table((rule,), refs, {}, strict=True)["m.experts.gate_up_proj"]
    assert isinstance(fused.storage.source, Joined)
    want = torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups)])
    assert fused.shape == (3, 10, 4)
    got = b"".join(bytes(piece) for piece in fused.storage.source.tensor_bytes(fused, chunk, None))
    assert got == _bytes(want).numpy().tobytes()


def test_two_names_for_one_expert_are_refused() -> None:
    refs = {name: from_torch(torch.zeros(2)) for name in ("w.1", "w.01", "w.0")}
    with pytest.raises(ckptconv.CkptconvError, match=r"'w\.01' and another name are both E 1; rename one"):
        run_table((Stack(("w.{E}",), "stacked"),), refs, {}, strict=True)


@pytest.mark.parametrize("model_type", sorted(layouts.PER_EXPERT_TO_FUSED))
def test_every_expert_table_says_what_transformers_conversion_mapping_says(model_type: str) -> None:
    """transformers' own rules, read as data: each of its expert converters (``MergeModulelist(dim=0)``, then
    ``Concatenate(dim=1)`` for two sources) is a ckptconv ``Stack`` of the same sources in the same order onto the
    same target, and its renamings are ours; ckptconv adds only the fp8 scales' copies its quantizer makes."""
    mapping = pytest.importorskip("transformers.conversion_mapping")
    rules = mapping.get_checkpoint_conversion_mapping(mapping._MODEL_TO_CONVERSION_PATTERN.get(model_type, model_type))
    ours = layouts.PER_EXPERT_TO_FUSED[model_type]
    stacks = [rule for rule in ours if isinstance(rule, Stack) and not rule.target.endswith("_scale_inv")]
    theirs = [rule for rule in rules if type(rule).__name__ == "WeightConverter"]
    assert len(stacks) == len(theirs)
    for stack, converter in zip(stacks, theirs):
        ours_tail = [source.rpartition("experts.")[2].replace("{E}", "*") for source in stack.sources]
        assert ours_tail == [source.rpartition("experts.")[2] for source in converter._original_source_patterns]
        assert stack.target.endswith(converter._original_target_patterns[0].lstrip("."))
        operations = [(type(op).__name__, op.dim) for op in converter.operations]
        assert operations == [("MergeModulelist", 0)] + ([("Concatenate", 1)] if len(stack.sources) == 2 else [])
    renames = [rule for rule in rules if type(rule).__name__ == "WeightRenaming"]
    for renaming in renames:  # Mixtral's .block_sparse_moe. -> .mlp.: our Rename of its router does the same
        old, new = renaming._original_source_patterns[0], renaming._original_target_patterns[0]
        assert any(isinstance(r, Rename) and old in r.source and r.target == r.source.replace(old, new) for r in ours)
