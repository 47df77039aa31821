"""The model is the unit everywhere (issue 40): ``batch`` converts a model folder as ``convert`` does, ``inspect``
says what the model is, ``fit``/``--like`` understand tied heads, and wrapper prefixes are named with their flag.

Models are tiny ones built here with transformers' own classes; outputs are read back by ``from_pretrained`` (never
ckptconv's readers), which must report no missing, unexpected or mismatched key and give ``torch.equal`` logits.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

from .conftest import run_cli

transformers.logging.set_verbosity_error()


def _llama(*, tie: bool = False) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        max_position_embeddings=16,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(config)


def _hf_bin_folder(model: Any, folder: Path) -> Path:
    """A Hugging Face folder as older transformers wrote it: pytorch_model.bin (torch.save of the state dict, tied
    tensors sharing storage), config.json and tokenizer files."""
    folder.mkdir(parents=True)
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 16}')
    (folder / "special_tokens_map.json").write_text('{"bos_token": "<s>"}')
    return folder


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=torch.arange(1, 9).reshape(1, 8)).logits


def _loads_cleanly(out: Path) -> Any:
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {key: list(value) for key, value in info.items()} == {
        "missing_keys": [],
        "unexpected_keys": [],
        "mismatched_keys": [],
        "error_msgs": [],
    }
    return loaded


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------
# batch converts a model folder as convert does
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_batch_gives_a_model_folder_for_a_hugging_face_folder_as_convert_does(tmp_path: Path, jobs: str) -> None:
    model = _llama()
    zoo = tmp_path / "zoo"
    _hf_bin_folder(model, zoo / "hf")
    torch.save({"w": torch.arange(6.0)}, zoo / "plain.pt")
    code, _, stderr = run_cli("batch", str(zoo), str(tmp_path / "out"), "--jobs", jobs)
    assert code == 0, stderr
    assert stderr.splitlines()[-1].startswith("converted 2 of 2 items")
    out = tmp_path / "out"
    # Before: hf/pytorch_model.safetensors alone (no config.json: from_pretrained failed).
    assert sorted(os.listdir(out / "hf")) == [
        "config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer_config.json",
    ]
    code, _, stderr = run_cli("convert", str(zoo / "hf"), f"{tmp_path / 'converted'}/")
    assert code == 0, stderr
    assert _files(out / "hf") == _files(tmp_path / "converted")  # file by file, byte for byte
    loaded = _loads_cleanly(out / "hf")
    assert torch.equal(_logits(loaded), _logits(model))
    assert torch.equal(load_file(out / "plain.safetensors")["w"], torch.arange(6.0))


def test_batch_resumes_a_model_folder_it_converted(tmp_path: Path) -> None:
    zoo = tmp_path / "zoo"
    _hf_bin_folder(_llama(), zoo / "hf")
    assert run_cli("batch", str(zoo), str(tmp_path / "out"))[0] == 0
    code, _, stderr = run_cli("batch", str(zoo), str(tmp_path / "out"), "--resume")
    assert code == 0, stderr
    assert stderr.splitlines()[-1].startswith("converted 0 of 1 item; 1 skipped;")
    (tmp_path / "out" / "hf" / "config.json").write_text("{}")  # an output no record vouches for: converted again
    code, _, stderr = run_cli("batch", str(zoo), str(tmp_path / "out"), "--resume")
    assert stderr.splitlines()[-1].startswith("converted 1 of 1 item")
    _loads_cleanly(tmp_path / "out" / "hf")


def test_batch_gives_a_sharded_model_folder_its_model_folder(tmp_path: Path) -> None:
    model = _llama()
    model.save_pretrained(tmp_path / "zoo" / "sharded", max_shard_size="20KB")
    assert (tmp_path / "zoo" / "sharded" / "model.safetensors.index.json").exists()
    code, _, stderr = run_cli("batch", str(tmp_path / "zoo"), str(tmp_path / "out"), "--dtype", "bf16")
    assert code == 0, stderr
    loaded = _loads_cleanly(tmp_path / "out" / "sharded")
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(_logits(loaded), _logits(model.to(torch.bfloat16)))


# ------------------------------------------------------------------------------------------------
# Wrappers: named, with the flag that removes them
# ------------------------------------------------------------------------------------------------

WRAPPED = {
    "module": "every key starts with 'module.' (DataParallel/DDP); pass --strip-prefix module or --canonical to "
    "remove it",
    "_orig_mod": "every key starts with '_orig_mod.' (torch.compile); pass --strip-prefix _orig_mod or --canonical "
    "to remove it",
    "_forward_module": "every key starts with '_forward_module.' (Lightning); pass --strip-prefix _forward_module or "
    "--canonical to remove it",
    "_fsdp_wrapped_module": "every key starts with '_fsdp_wrapped_module.' (FSDP); pass --strip-prefix "
    "_fsdp_wrapped_module or --canonical to remove it",
}


def _wrapped(path: Path, wrapper: str) -> Path:
    torch.save({f"{wrapper}.fc.weight": torch.ones(2, 3), f"{wrapper}.fc.bias": torch.zeros(2)}, path)
    return path


@pytest.mark.parametrize("wrapper", list(WRAPPED))
def test_convert_names_a_wrapper_on_every_key_and_its_flag(wrapper: str, tmp_path: Path) -> None:
    source = _wrapped(tmp_path / "model_best.pth.tar", wrapper)
    code, _, stderr = run_cli("convert", str(source), str(tmp_path / "out.safetensors"), "--dtype", "bf16")
    assert code == 0, stderr
    assert f"note: {WRAPPED[wrapper]}\n" in stderr
    # The flag it names removes it, and then nothing is said.
    flag = ["--strip-prefix", wrapper]
    code, _, stderr = run_cli("convert", str(source), str(tmp_path / "b.safetensors"), *flag)
    assert code == 0 and "every key starts with" not in stderr
    assert set(load_file(tmp_path / "b.safetensors")) == {"fc.weight", "fc.bias"}


def test_no_wrapper_note_for_a_prefix_of_the_model_itself(tmp_path: Path) -> None:
    # A Hugging Face base model's keys all start with 'model.': no wrapper, nothing to strip.
    torch.save({"model.fc.weight": torch.ones(2), "model.fc.bias": torch.ones(1)}, tmp_path / "m.pt")
    code, _, stderr = run_cli("convert", str(tmp_path / "m.pt"), str(tmp_path / "m.safetensors"))
    assert code == 0 and "note:" not in stderr, stderr


def test_inspect_names_a_wrapper_on_every_key(tmp_path: Path) -> None:
    source = _wrapped(tmp_path / "dp.pt", "module")
    code, stdout, _ = run_cli("inspect", str(source))
    assert code == 0
    assert f"note: {WRAPPED['module']}\n" in stdout
    code, stdout, _ = run_cli("inspect", str(source), "--json")
    import json

    assert json.loads(stdout)["notes"] == [WRAPPED["module"]]


def test_batch_names_a_wrapper_on_every_key_of_an_item(tmp_path: Path) -> None:
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    _wrapped(zoo / "dp.pt", "module")
    torch.save({"fc.weight": torch.ones(2)}, zoo / "plain.pt")
    code, _, stderr = run_cli("batch", str(zoo), str(tmp_path / "out"))
    assert code == 0, stderr
    assert stderr.splitlines()[0] == f"note: dp.pt: {WRAPPED['module']}"
    assert stderr.splitlines()[1].startswith("converted 2 of 2 items")


@pytest.mark.parametrize("order", ["_orig_mod.module", "_forward_module.module", "module._orig_mod"])
def test_strip_module_strips_module_under_another_wrapper_and_points_to_canonical(order: str, tmp_path: Path) -> None:
    source = _wrapped(tmp_path / "compiled.pt", order)
    out = tmp_path / "out.safetensors"
    code, _, stderr = run_cli("strip-module", str(source), str(out))
    assert code == 0, stderr
    left = order.replace("module.", "").replace(".module", "")
    assert set(load_file(out)) == {f"{left}.fc.weight", f"{left}.fc.bias"}  # before: an unchanged copy
    wrapper = {"_orig_mod": "torch.compile", "_forward_module": "Lightning"}[left]
    assert stderr.splitlines()[0] == (
        f"note: every key still starts with '{left}.' ({wrapper}); pass --canonical to remove every wrapper prefix"
    )


# ------------------------------------------------------------------------------------------------
# Tied heads: a tied copy in the source fits a base that ties
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def tied_base(tmp_path: Path) -> tuple[Any, Path]:
    """A tied model and its save_pretrained folder: tie_word_embeddings true, no lm_head.weight stored."""
    model = _llama(tie=True)
    model.save_pretrained(tmp_path / "base")
    assert "lm_head.weight" not in load_file(tmp_path / "base" / "model.safetensors")
    return model, tmp_path / "base"


def _lightning_ckpt(model: Any, path: Path) -> Path:
    state = model.state_dict()  # lm_head.weight and model.embed_tokens.weight: one tensor
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    torch.save({"state_dict": {f"model.{k}": v for k, v in state.items()}, "epoch": 3}, path)
    return path


@pytest.mark.parametrize("command", ["convert", "fit"])
def test_a_tied_head_sharing_storage_fits_a_base_that_ties(
    tied_base: tuple[Any, Path], tmp_path: Path, command: str
) -> None:
    model, base = tied_base
    source = _lightning_ckpt(model, tmp_path / "last.ckpt")
    out = tmp_path / "out"
    code, _, stderr = run_cli(command, str(source), f"{out}/", "--like", f"{base}/")
    # Before: "no key transform makes the checkpoint fit ...: 1 unexpected (e.g. 'lm_head.weight')", exit 3.
    assert code == 0, stderr
    assert stderr.splitlines()[0] == (
        "note: left out 'model.lm_head.weight' ('lm_head.weight'): it shares storage with "
        f"'model.model.embed_tokens.weight', and the checkpoint '{base}/' ties them (it stores only "
        "'model.embed_tokens.weight')"
    )
    assert "lm_head.weight" not in load_file(out / "model.safetensors")
    loaded = _loads_cleanly(out)
    assert torch.equal(_logits(loaded), _logits(model))


def test_bit_identical_copies_of_a_tied_head_fit_a_base_that_ties(tied_base: tuple[Any, Path], tmp_path: Path) -> None:
    # DCP (FSDP) stores the head and the embeddings as two records of equal bytes: no storage is shared.
    import torch.distributed.checkpoint as dcp

    from .conftest import dcp_one_process

    model, base = tied_base
    dcp.save(
        {k: v.clone() for k, v in model.state_dict().items()}, checkpoint_id=str(tmp_path / "dcp"), **dcp_one_process()
    )
    out = tmp_path / "out"
    code, _, stderr = run_cli("convert", str(tmp_path / "dcp"), f"{out}/", "--like", f"{base}/")
    assert code == 0, stderr
    assert stderr.splitlines()[0] == (
        "note: left out 'lm_head.weight': it is a bit-identical copy of 'model.embed_tokens.weight', and the "
        f"checkpoint '{base}/' ties them (it stores only 'model.embed_tokens.weight')"
    )
    assert torch.equal(_logits(_loads_cleanly(out)), _logits(model))


def test_a_head_that_differs_from_the_embeddings_is_never_dropped(tied_base: tuple[Any, Path], tmp_path: Path) -> None:
    model, base = tied_base
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"][0, 0] += 1  # trained untied: the head is data of its own
    torch.save(state, tmp_path / "untied.pt")
    code, _, stderr = run_cli("convert", str(tmp_path / "untied.pt"), f"{tmp_path / 'out'}/", "--like", f"{base}/")
    assert code == 3
    assert stderr.splitlines()[0].endswith("matches 20 keys, with 1 unexpected (e.g. 'lm_head.weight')")


def test_a_tied_models_head_the_checkpoint_does_not_store_is_not_missing(tied_base: tuple[Any, Path]) -> None:
    import ckptconv

    model, base = tied_base
    fresh = _llama(tie=True)
    torch.nn.init.zeros_(fresh.model.embed_tokens.weight)
    # Before: FitError "1 missing (e.g. 'lm_head.weight')".
    report = ckptconv.load_into(fresh, base / "model.safetensors")
    assert report.ok and report.tied == ("lm_head.weight",) and not report.missing
    assert report.notes == (
        "the checkpoint does not store 'lm_head.weight', which the LlamaForCausalLM model ties to "
        "'model.embed_tokens.weight': not missing",
    )
    assert torch.equal(_logits(fresh), _logits(model))


# ------------------------------------------------------------------------------------------------
# inspect says what the model is
# ------------------------------------------------------------------------------------------------


def _model_lines(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith("model: "))
    end = next(index for index in range(start + 1, len(lines)) if not lines[index].startswith("  "))
    return lines[start:end]


def test_inspect_says_a_tied_model_folder_is_tied(tied_base: tuple[Any, Path]) -> None:
    code, stdout, _ = run_cli("inspect", str(tied_base[1]))
    assert code == 0
    assert _model_lines(stdout) == [  # before: the weights file alone
        "model: model folder (LlamaForCausalLM)",
        "  ties: tied (tie_word_embeddings: true, no lm_head.weight stored)",
    ]


def test_inspect_says_a_torch_save_shares_the_head_with_the_embeddings(tmp_path: Path) -> None:
    _hf_bin_folder(_llama(tie=True), tmp_path / "hf")
    code, stdout, _ = run_cli("inspect", str(tmp_path / "hf"))
    assert code == 0
    assert _model_lines(stdout)[1] == (
        "  ties: tied (tie_word_embeddings: true, lm_head.weight shares storage with model.embed_tokens.weight)"
    )


def test_inspect_gives_a_mixture_of_experts_count_of_experts(tmp_path: Path) -> None:
    config = transformers.MixtralConfig(
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path / "moe")
    code, stdout, _ = run_cli("inspect", str(tmp_path / "moe"), "--json")
    assert code == 0
    import json

    model = json.loads(stdout)["model"]
    assert (model["kind"], model["architecture"], model["experts"]) == ("model folder", "MixtralForCausalLM", 4)
    assert "  experts: 4 (as config.json says)" in _model_lines(run_cli("inspect", str(tmp_path / "moe"))[1])


def test_inspect_says_a_training_run_holds_training_state_beside_the_model(tmp_path: Path) -> None:
    model = _llama()
    model.save_pretrained(tmp_path / "checkpoint-500")
    optimizer = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.arange(4).reshape(1, 4), labels=torch.arange(4).reshape(1, 4)).loss.backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    torch.save(optimizer.state_dict(), tmp_path / "checkpoint-500" / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp_path / "checkpoint-500" / "scheduler.pt")
    code, stdout, _ = run_cli("inspect", str(tmp_path / "checkpoint-500"))
    assert code == 0
    assert _model_lines(stdout) == [
        "model: training run (LlamaForCausalLM)",
        "  ties: untied (tie_word_embeddings: false, lm_head.weight stored)",
        "  training state beside it: optimizer.pt (optimizer state (Adam moments)), scheduler.pt (learning-rate "
        "scheduler state)",
    ]


def test_inspect_gives_the_quantization_scheme_the_config_declares(tmp_path: Path) -> None:
    from .test_quantized_cli import FP8_CONFIG, fp8_block_state, model_folder

    folder = model_folder(tmp_path / "fp8", fp8_block_state(), {**FP8_CONFIG, "architectures": ["LlamaForCausalLM"]})
    code, stdout, _ = run_cli("inspect", str(folder))
    assert code == 0
    assert _model_lines(stdout) == [
        "model: model folder (LlamaForCausalLM)",
        "  quantization: fp8 (as config.json says)",
    ]


def test_batch_fails_a_model_folder_holding_a_link_out_as_convert_does(tmp_path: Path) -> None:
    zoo = tmp_path / "zoo"
    _hf_bin_folder(_llama(), zoo / "hf")
    (tmp_path / "private.json").write_text('{"secret": 1}')
    (zoo / "hf" / "tokenizer.json").symlink_to(tmp_path / "private.json")
    code, _, stderr = run_cli("batch", str(zoo), str(tmp_path / "out"))
    assert code == 3
    link = zoo / "hf" / "tokenizer.json"
    assert stderr.splitlines()[0] == (
        f"failed: hf: {str(link)!r} is a link that leads outside the checkpoint folder {str(zoo / 'hf')!r}; ckptconv "
        "reads only files inside it (copy the file in instead of linking it)"
    )
    assert not (tmp_path / "out" / "hf").exists() or not any((tmp_path / "out" / "hf").iterdir())


def test_batch_gives_an_adapter_and_a_folder_of_model_folders_their_folders(tmp_path: Path) -> None:
    import json

    from safetensors.torch import save_file

    zoo = tmp_path / "zoo"
    (zoo / "adapter").mkdir(parents=True)
    (zoo / "st" / "1_Dense").mkdir(parents=True)
    lora = {"base_model.model.q_proj.lora_A.weight": torch.arange(8.0).reshape(2, 4)}
    save_file(lora, zoo / "adapter" / "adapter_model.safetensors")
    (zoo / "adapter" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    save_file({"embeddings.weight": torch.ones(4, 2)}, zoo / "st" / "model.safetensors")
    (zoo / "st" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (zoo / "st" / "modules.json").write_text(json.dumps([{"idx": 1, "path": "1_Dense", "type": "Dense"}]))
    save_file({"linear.weight": torch.eye(2)}, zoo / "st" / "1_Dense" / "model.safetensors")
    (zoo / "st" / "1_Dense" / "config.json").write_text("{}")
    code, _, stderr = run_cli("batch", str(zoo), str(tmp_path / "out"), "--dtype", "bf16")
    assert code == 0, stderr
    assert stderr.splitlines()[-1].startswith("converted 2 of 2 items")
    out = tmp_path / "out"
    assert sorted(os.listdir(out / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
    assert torch.equal(
        load_file(out / "adapter" / "adapter_model.safetensors")[next(iter(lora))], lora[next(iter(lora))].bfloat16()
    )
    assert torch.equal(
        load_file(out / "st" / "1_Dense" / "model.safetensors")["linear.weight"], torch.eye(2).bfloat16()
    )
    assert sorted(os.listdir(out / "st")) == ["1_Dense", "config.json", "model.safetensors", "modules.json"]


class _TinyBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(16), torch.nn.LayerNorm(16)
        self.qkv, self.proj = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)
        self.fc1, self.fc2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)


class _TinyLM(torch.nn.Module):
    """The model fixtures/gpu/tied_lm_save_model.safetensors was saved from (its PROVENANCE): tok_emb and lm_head
    tied, the file holding lm_head.weight alone (safetensors' save_model keeps one of the tied names)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = torch.nn.Embedding(64, 16), torch.nn.Embedding(16, 16)
        self.block, self.ln_f = _TinyBlock(), torch.nn.LayerNorm(16)
        self.lm_head = torch.nn.Linear(16, 64, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self.register_buffer("position_ids", torch.zeros(1, 16, dtype=torch.int64))


def test_a_tied_model_loads_the_gpu_fixture_that_kept_only_one_of_its_tied_names() -> None:
    import ckptconv

    fixture = Path(__file__).parent.parent / "fixtures" / "gpu" / "tied_lm_save_model.safetensors"
    model = _TinyLM()
    # Before: FitError "1 missing (e.g. 'tok_emb.weight')".
    report = ckptconv.load_into(model, fixture)
    assert report.ok and report.tied == ("tok_emb.weight",)
    stored = load_file(fixture)  # the safetensors library's own reader
    assert torch.equal(model.tok_emb.weight, stored["lm_head.weight"])
    assert model.lm_head.weight is model.tok_emb.weight
    assert all(torch.equal(model.state_dict()[key], value) for key, value in stored.items())


def test_inspect_shows_an_untrusted_config_escaped_and_bounded(tmp_path: Path) -> None:
    import json

    from safetensors.torch import save_file

    (tmp_path / "m").mkdir()
    save_file({"w": torch.ones(2)}, tmp_path / "m" / "model.safetensors")
    config = {"architectures": ["\x1b]0;pwned\x07" + "A" * 500] * 9, "quantization_config": {"quant_method": 7}}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    code, stdout, _ = run_cli("inspect", str(tmp_path / "m"))
    assert code == 0
    (line,) = _model_lines(stdout)  # a quant_method that is no text is not shown
    assert "\x1b" not in line and "\x07" not in line and len(line) < 600
    assert line.startswith("model: model folder (\\x1b]0;pwned\\x07AAA") and line.endswith("... ...)")


@pytest.mark.parametrize(
    "fixture, note",
    [
        (
            "compiled_over_dataparallel.pt",
            "every key starts with '_orig_mod.' (torch.compile), with 'module.' inside; pass --canonical to remove "
            "every wrapper prefix",
        ),
        (
            "fsdp1_ac_named_parameters.pt",
            "every key starts with '_fsdp_wrapped_module.' (FSDP), with '_checkpoint_wrapped_module.' inside; pass "
            "--canonical to remove every wrapper prefix",
        ),
    ],
)
def test_stacked_wrappers_on_every_key_point_to_canonical(fixture: str, note: str, tmp_path: Path) -> None:
    source = Path(__file__).parent.parent / "fixtures" / "gpu" / fixture  # saved on GPUs by the frameworks
    code, _, stderr = run_cli("convert", str(source), str(tmp_path / "out.safetensors"))
    assert code == 0, stderr
    assert f"note: {note}\n" in stderr
    code, _, stderr = run_cli("convert", str(source), str(tmp_path / "c.safetensors"), "--canonical")
    assert code == 0 and "every key starts with" not in stderr
    assert not any(part.startswith("_") for key in load_file(tmp_path / "c.safetensors") for part in key.split("."))


def _tied_base_storing_its_head(model: Any, folder: Path) -> Path:
    """A base folder whose config ties the head, but whose weights store a copy of it too."""
    from safetensors.torch import save_file

    folder.mkdir()
    model.config.save_pretrained(folder)
    state = {key: value.clone().contiguous() for key, value in model.state_dict().items()}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_a_head_the_base_ties_is_not_missing_when_the_source_stores_only_the_embeddings(tmp_path: Path) -> None:
    model = _llama(tie=True)
    base = _tied_base_storing_its_head(model, tmp_path / "base")
    state = {key: value for key, value in model.state_dict().items() if key != "lm_head.weight"}
    torch.save(state, tmp_path / "headless.pt")
    out = tmp_path / "out"
    code, _, stderr = run_cli("convert", str(tmp_path / "headless.pt"), f"{out}/", "--like", f"{base}/")
    # Before: "... 1 missing (e.g. 'lm_head.weight')", exit 3.
    assert code == 0, stderr
    assert stderr.splitlines()[0] == (
        f"note: the checkpoint does not store 'lm_head.weight', which the checkpoint '{base}/' ties to "
        "'model.embed_tokens.weight': not missing"
    )
    assert torch.equal(_logits(_loads_cleanly(out)), _logits(model))


def test_embeddings_the_source_lacks_are_missing_even_when_the_base_ties_them(tmp_path: Path) -> None:
    # A tied model takes its head from its embeddings, never the reverse: the head cannot stand in for them.
    model = _llama(tie=True)
    base = _tied_base_storing_its_head(model, tmp_path / "base")
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "model.embed_tokens.weight"}
    torch.save(state, tmp_path / "no_embeddings.pt")
    code, _, stderr = run_cli("convert", str(tmp_path / "no_embeddings.pt"), f"{tmp_path}/out/", "--like", f"{base}/")
    assert code == 3
    assert stderr.splitlines()[0].endswith("with 1 missing (e.g. 'model.embed_tokens.weight')")
