"""HF -> Megatron-Core: the family tables run backwards, and the ``torch_dist`` folder megatron-core reads.

Every comparison is against an independent reader of the fixtures (Megatron-Core 0.19.2's own ``torch_dist``
saves): torch's ``dcp_to_torch_save`` then ``torch.load``, and megatron-core's ``load_plain_tensors`` where it is
installed; never ckptconv's reader on both sides.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ckptconv
from ckptconv.architectures.mapping import to_hugging_face, to_megatron, torch_dist_names
from ckptconv.errors import TransformError

from .conftest import run_cli

torch = pytest.importorskip("torch")
format_utils = pytest.importorskip("torch.distributed.checkpoint.format_utils")

RUNS = Path(__file__).resolve().parent.parent / "fixtures" / "runs"
FIXTURES = ["megatron_llama", "megatron_mixtral", "megatron_qwen3_moe"]
PADDED = ("embedding.word_embeddings.weight", "output_layer.weight")


def _torch_read(folder: Path, tmp_path: Path) -> dict[str, Any]:
    """The folder's tensors as torch's own DCP reader gives them (``_extra_state`` bytes left out)."""
    out = tmp_path / f"{folder.name}.pt"
    format_utils.dcp_to_torch_save(str(folder), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _bits(tensor: Any) -> Any:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _equal(got: dict[str, Any], want: dict[str, Any], vocab: int) -> None:
    """Every tensor bit for bit; the vocabulary's padding rows (which HF never holds) are zeros in ``got``."""
    assert sorted(got) == sorted(want)
    for name, expected in want.items():
        value = got[name]
        assert value.dtype == expected.dtype and value.shape == expected.shape, name
        if name in PADDED:
            assert torch.equal(_bits(value[:vocab]), _bits(expected[:vocab])), name
            assert not value[vocab:].any(), name
        else:
            assert torch.equal(_bits(value), _bits(expected)), name


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
@pytest.mark.parametrize("fixture", FIXTURES)
def test_megatron_to_hf_to_megatron_is_bit_exact(fixture: str, layout: str, tmp_path: Path) -> None:
    folder = RUNS / fixture
    config = json.loads((folder / "config.json").read_text())
    want = _torch_read(folder, tmp_path)
    hf = to_hugging_face(ckptconv.open(str(folder)).select().weights, config, experts=layout)
    padded = want["embedding.word_embeddings.weight"].shape[0]
    assert padded > config["vocab_size"]  # the fixtures are padded: the test covers the padding rows
    back = torch_dist_names(to_megatron(hf, config, padded_vocab_size=padded))
    _equal({name: ref.torch() for name, ref in back.items()}, want, config["vocab_size"])


def test_without_padding_the_vocabulary_keeps_its_rows(tmp_path: Path) -> None:
    folder = RUNS / "megatron_llama"
    config = json.loads((folder / "config.json").read_text())
    hf = to_hugging_face(ckptconv.open(str(folder)).select().weights, config)
    back = to_megatron(hf, config)
    assert back["embedding.word_embeddings.weight"].shape == (config["vocab_size"], config["hidden_size"])
    with pytest.raises(TransformError, match="padded_vocab_size 99 is below the config's vocab_size 100"):
        to_megatron(hf, config, padded_vocab_size=99)


def test_a_missing_or_unknown_tensor_is_refused_by_name() -> None:
    folder = RUNS / "megatron_mixtral"
    config = json.loads((folder / "config.json").read_text())
    hf = to_hugging_face(ckptconv.open(str(folder)).select().weights, config, experts="per_expert")
    lacking = {k: v for k, v in hf.items() if k != "model.layers.1.block_sparse_moe.experts.3.w2.weight"}
    with pytest.raises(TransformError, match=r"lack model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight"):
        to_megatron(lacking, config)
    extra = dict(hf, **{"model.layers.0.extra.weight": hf["model.norm.weight"]})
    with pytest.raises(TransformError, match=r"hold model\.layers\.0\.extra\.weight, which it has no place for"):
        to_megatron(extra, config)


def _hf_folder(fixture: str, layout: str, tmp_path: Path) -> Path:
    """The fixture as a Hugging Face model folder (safetensors written by the safetensors library)."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    folder = RUNS / fixture
    config = json.loads((folder / "config.json").read_text())
    hf = to_hugging_face(ckptconv.open(str(folder)).select().weights, config, experts=layout)
    out = tmp_path / f"hf_{fixture}"
    out.mkdir()
    safetensors_torch.save_file({k: v.torch().contiguous() for k, v in hf.items()}, str(out / "model.safetensors"))
    shutil.copy(folder / "config.json", out / "config.json")
    return out


# megatron-core's own loader, on the CPU: a one-rank gloo group (its torch_dist strategy asks for the rank).
_MEGATRON_LOAD = """
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from megatron.core.dist_checkpointing import load_plain_tensors
for folder, out in zip(sys.argv[2::2], sys.argv[3::2]):
    torch.save(load_plain_tensors(folder), out)
dist.destroy_process_group()
"""

_CASES = [("megatron_llama", "fused"), ("megatron_mixtral", "per_expert"), ("megatron_qwen3_moe", "fused")]


def test_convert_to_megatron_is_what_megatron_core_saved(tmp_path: Path) -> None:
    """``convert HF/ OUT/ --to megatron``: torch's DCP reader, and megatron-core's ``load_plain_tensors`` where
    it is installed, read every tensor of the fixture (Megatron-Core's own save) back, bit for bit."""
    outs = []
    for fixture, layout in _CASES:
        source, out = _hf_folder(fixture, layout, tmp_path), tmp_path / f"out_{fixture}"
        args = ("--to", "megatron", "--padded-vocab-size", "128", "--verify")  # read back as it was meant
        code, _, err = run_cli("convert", str(source), f"{out}/", *args)
        assert code == 0 and "verified bit for bit" in err, err
        assert sorted(os.listdir(out)) == [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
        assert (out / "metadata.json").read_bytes() == (RUNS / fixture / "metadata.json").read_bytes()
        assert torch.load(out / "common.pt", weights_only=True) == {}
        vocab = json.loads((RUNS / fixture / "config.json").read_text())["vocab_size"]
        _equal(_torch_read(out, tmp_path), _torch_read(RUNS / fixture, tmp_path), vocab)
        outs.append((fixture, out, vocab))
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is not installed (pip install 'megatron-core>=0.16' on Python 3.10+)")
    args = [str(tmp_path / "pg")]
    for fixture, out, _ in outs:
        args += [str(out), str(tmp_path / f"{fixture}.mcore.pt")]
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _MEGATRON_LOAD, *args], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for fixture, _, vocab in outs:
        loaded = torch.load(tmp_path / f"{fixture}.mcore.pt", weights_only=True)
        _equal(loaded, _torch_read(RUNS / fixture, tmp_path), vocab)


def test_to_megatron_refusals_leave_nothing(tmp_path: Path) -> None:
    source = _hf_folder("megatron_llama", "fused", tmp_path)
    out = tmp_path / "out"
    code, _, err = run_cli("convert", str(source), str(tmp_path / "o.pt"), "--to", "megatron")
    assert code == 2 and "--to megatron writes a folder" in err and "Traceback" not in err
    code, _, err = run_cli("convert", str(source), f"{out}/", "--padded-vocab-size", "128")
    assert code == 1 and "give it with --to megatron" in err
    code, _, err = run_cli("convert", str(source), f"{out}/", "--to", "megatron", "--padded-vocab-size", "99")
    assert code == 1 and "padded_vocab_size 99 is below the config's vocab_size 100" in err
    code, _, err = run_cli("convert", str(source), f"{out}/", "--to", "megatron", "--layout", "fused")
    assert code == 1 and "leave it out with --to megatron" in err
    (source / "config.json").unlink()
    code, _, err = run_cli("convert", str(source), f"{out}/", "--to", "megatron")
    assert code == 1 and "needs the model's config.json" in err
    assert not out.exists() and len(err.strip().splitlines()) == 1


def test_a_megatron_folder_to_megatron_is_the_same_folder(tmp_path: Path) -> None:
    """A ``torch_dist`` source passes as it is: its layers split on reading, stacked again on writing."""
    out = tmp_path / "out"
    code, _, err = run_cli("convert", str(RUNS / "megatron_qwen3_moe"), f"{out}/", "--to", "megatron", "--verify")
    assert code == 0, err
    want = _torch_read(RUNS / "megatron_qwen3_moe", tmp_path)
    _equal(_torch_read(out, tmp_path), want, want["embedding.word_embeddings.weight"].shape[0])


def test_a_tied_config_gives_no_output_layer() -> None:
    """Megatron's ``share_embeddings_and_output_weights`` on one pipeline stage saves no ``output_layer.weight``
    (``LanguageModule.tie_embeddings_and_output_weights_state_dict``: the embedding is the output layer)."""
    folder = RUNS / "megatron_llama"
    config = json.loads((folder / "config.json").read_text())
    hf = to_hugging_face(ckptconv.open(str(folder)).select().weights, config)
    tied = dict(config, tie_word_embeddings=True)
    back = to_megatron({k: v for k, v in hf.items() if k != "lm_head.weight"}, tied)
    assert "output_layer.weight" not in back and "embedding.word_embeddings.weight" in back
    with pytest.raises(TransformError, match=r"lm_head\.weight, which it has no place for"):
        to_megatron(hf, tied)


# A live GPTModel (megatron-core's local layer spec, the fixture's sizes) loads the folder through its own
# sharded_state_dict(); "log_all": the folder has no _extra_state entries (see docs/training-runs.md).
_GPT_LOAD = """
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
parallel_state.initialize_model_parallel(1, 1)
config = TransformerConfig(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
    gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
    add_bias_linear=False, use_cpu_initialization=True,
)
model = GPTModel(
    config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=128, max_sequence_length=64,
    share_embeddings_and_output_weights=False, position_embedding_type="rope",
)
model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), sys.argv[2], strict="log_all"), strict=False)
torch.save({k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}, sys.argv[3])
dist.destroy_process_group()
"""

_LOCAL_SPEC = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def test_a_gpt_model_loads_the_folder_as_megatron_saved_it(tmp_path: Path) -> None:
    """megatron-core's ``GPTModel`` loads ``--to megatron``'s folder through its own ``sharded_state_dict()`` (the
    SwiGLU ``linear_fc1`` factory, the stacked layers) and then holds the fixture's tensors, bit for bit."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is not installed (pip install 'megatron-core>=0.16' on Python 3.10+)")
    source, out = _hf_folder("megatron_llama", "fused", tmp_path), tmp_path / "out"
    code, _, err = run_cli("convert", str(source), f"{out}/", "--to", "megatron", "--padded-vocab-size", "128")
    assert code == 0, err
    loaded_file = tmp_path / "loaded.pt"
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _GPT_LOAD, str(tmp_path / "pg"), str(out), str(loaded_file)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = torch.load(loaded_file, weights_only=True)
    want = _torch_read(RUNS / "megatron_llama", tmp_path)
    assert len(loaded) == 15
    for name, tensor in loaded.items():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            rest = ".".join(parts[3:])
            expected = want["decoder.layers." + _LOCAL_SPEC.get(rest, rest)][int(parts[2])]
        else:
            expected = want[name]
        value = tensor[:100] if name in PADDED else tensor
        expected = expected[:100] if name in PADDED else expected
        assert value.dtype == expected.dtype and value.shape == expected.shape, name
        assert torch.equal(_bits(value), _bits(expected)), name
