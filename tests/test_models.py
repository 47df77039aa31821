"""Model folders in, model folders out: configs, tokenizers and remote code carried, training state left out.

Every model is a tiny random one built here with transformers' own classes and written by its own
``save_pretrained``; outputs are read back by ``from_pretrained`` (never ckptconv's readers), which must report
no missing, unexpected or mismatched key and give logits ``torch.equal`` to the source model cast by torch.
Training-run folders are written by the real ``transformers.Trainer`` (one step on the CPU) and
``accelerate.Accelerator.save_state``.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import transformers
from safetensors.torch import load_file

from .conftest import run_cli, tiny_gpt2, tiny_llama
from .test_quantized_cli import FP8_CONFIG, fp8_block_state, model_folder

transformers.logging.set_verbosity_error()


def _mixtral() -> Any:
    config = transformers.MixtralConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.MixtralForCausalLM(config)


def _bart() -> Any:
    config = transformers.BartConfig(
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=48,
        decoder_ffn_dim=48,
        vocab_size=96,
        max_position_embeddings=32,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    return transformers.BartForConditionalGeneration(config)


def _vit() -> Any:
    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=48,
        image_size=16,
        patch_size=8,
        num_labels=3,
    )
    return transformers.ViTForImageClassification(config)


def _text_inputs(model: Any) -> dict[str, torch.Tensor]:
    ids = torch.arange(1, 9).reshape(1, 8)
    if model.config.is_encoder_decoder:
        return {"input_ids": ids, "decoder_input_ids": ids.flip(1)}
    return {"input_ids": ids}


def _image_inputs(model: Any) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))}


MODELS: dict[str, tuple[Callable[[], Any], Callable[[Any], dict[str, torch.Tensor]], Any]] = {
    "gpt2": (tiny_gpt2, _text_inputs, transformers.AutoModelForCausalLM),
    "llama": (tiny_llama, _text_inputs, transformers.AutoModelForCausalLM),
    "mixtral": (_mixtral, _text_inputs, transformers.AutoModelForCausalLM),
    "bart": (_bart, _text_inputs, transformers.AutoModelForSeq2SeqLM),
    "vit": (_vit, _image_inputs, transformers.AutoModelForImageClassification),
}


def _logits(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(**inputs).logits


def _saved(tmp_path: Path, name: str) -> tuple[Any, Path]:
    torch.manual_seed(0)
    model = MODELS[name][0]()
    folder = tmp_path / name
    model.save_pretrained(folder)
    return model, folder


def _assert_loads_cleanly(out: Path, auto: Any) -> Any:
    loaded, info = auto.from_pretrained(out, output_loading_info=True)
    assert {key: list(value) for key, value in info.items()} == {
        "missing_keys": [],
        "unexpected_keys": [],
        "mismatched_keys": [],
        "error_msgs": [],
    }
    return loaded


@pytest.mark.parametrize("name", list(MODELS))
def test_a_model_folder_converts_to_a_model_folder_from_pretrained_loads_exactly(name: str, tmp_path: Path) -> None:
    model, folder = _saved(tmp_path, name)
    _, inputs_of, auto = MODELS[name]
    out = tmp_path / "out"
    code, _, stderr = run_cli("convert", f"{folder}/", f"{out}/", "--dtype", "bf16")
    assert code == 0, stderr
    assert "note: rewrote config.json: dtype float32 -> bfloat16\n" in stderr
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = _assert_loads_cleanly(out, auto)
    assert loaded.dtype == torch.bfloat16
    inputs = inputs_of(model)
    assert torch.equal(_logits(loaded, inputs), _logits(model.to(torch.bfloat16), inputs))


def _tokenizer_files(folder: Path) -> None:
    """A tokenizer (tokenizers' own WordLevel model), a chat template, remote code, a card and an unknown file."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    # Token names, not passwords:

    vocab = {word: index for index, word in enumerate(["<unk>", "<s>", "hello", "world", *map(str, range(92))])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))  # noqa: S106
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>")  # noqa: S106
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(folder)
    (folder / "modeling_tiny.py").write_text("raise SystemExit('remote code must never be imported')\n")
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# tiny\n")
    (folder / "calibration.dat").write_bytes(bytes(range(256)))


def test_every_non_weight_file_is_carried_byte_for_byte_and_the_unknown_one_named(tmp_path: Path) -> None:
    model, folder = _saved(tmp_path, "gpt2")
    model.generation_config.save_pretrained(folder)
    _tokenizer_files(folder)
    out = tmp_path / "out"
    code, _, stderr = run_cli("convert", str(folder), f"{out}/", "--dtype", "bf16")
    assert code == 0, stderr
    source_files = sorted(p.name for p in folder.iterdir())
    assert sorted(p.name for p in out.iterdir()) == source_files
    for name in source_files:
        if name not in ("config.json", "model.safetensors"):
            assert (out / name).read_bytes() == (folder / name).read_bytes(), name
    assert (
        "note: copied 1 file ckptconv does not interpret verbatim (calibration.dat); check that they still describe "
        "the converted weights\n"
    ) in stderr
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("hello world")["input_ids"] == [2, 3]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"
    assert transformers.GenerationConfig.from_pretrained(out).to_dict() == model.generation_config.to_dict()


def test_a_sharded_pytorch_bin_folder_gives_a_safetensors_model_folder(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = tiny_llama()
    folder = tmp_path / "bin"
    model.config.save_pretrained(folder)
    # The layout transformers 4 wrote (v5 writes safetensors only): torch.save shards and their index.
    state = model.state_dict()
    keys = list(state)
    weight_map = {}
    for number, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2 :]), 1):
        name = f"pytorch_model-{number:05d}-of-00002.bin"
        torch.save({key: state[key] for key in part}, folder / name)
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    code, _, stderr = run_cli("convert", str(folder), f"{out}/", "--max-shard-size", "20KB")
    assert code == 0, stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = [load_file(out / name) for name in set(index["weight_map"].values())]
    written = sum(tensor.numel() * tensor.element_size() for shard in shards for tensor in shard.values())
    assert index["metadata"]["total_size"] == written
    assert not any(p.name.startswith("pytorch_model") for p in out.iterdir())
    loaded = _assert_loads_cleanly(out, transformers.AutoModelForCausalLM)
    inputs = _text_inputs(model)
    assert torch.equal(_logits(loaded, inputs), _logits(model, inputs))


def test_a_file_destination_says_the_model_files_stayed_behind(tmp_path: Path) -> None:
    _, folder = _saved(tmp_path, "gpt2")
    code, _, stderr = run_cli("convert", str(folder), str(tmp_path / "model.safetensors"))
    assert code == 0
    assert stderr.splitlines()[0] == (
        "note: 2 model files (config.json, generation_config.json) stayed behind: give a folder as DST (out/) to get "
        "a model folder"
    )


def test_an_existing_config_is_refused_before_any_weight_is_written(tmp_path: Path) -> None:
    _, folder = _saved(tmp_path, "gpt2")
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    code, _, stderr = run_cli("convert", str(folder), f"{out}/")
    assert code == 2  # an output that exists: a usage error
    assert stderr == f"ckptconv: error: {str(out)!r} already holds config.json; pass --overwrite to replace them\n"
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    assert run_cli("convert", str(folder), f"{out}/", "--overwrite")[0] == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"


def test_a_link_out_of_the_model_folder_is_refused(tmp_path: Path) -> None:
    _, folder = _saved(tmp_path, "gpt2")
    secret = tmp_path / "secret.txt"
    secret.write_text("not the model's")
    os.symlink(secret, folder / "tokenizer.json")
    code, _, stderr = run_cli("convert", str(folder), f"{tmp_path / 'out'}/")
    assert code == 1
    assert "is a link that leads outside the checkpoint folder" in stderr
    assert not (tmp_path / "out" / "tokenizer.json").exists()


def test_dequantized_weights_lose_their_quantization_config(tmp_path: Path) -> None:
    folder = model_folder(tmp_path / "fp8", fp8_block_state(), {**FP8_CONFIG, "tie_word_embeddings": False})
    out = tmp_path / "out"
    code, _, stderr = run_cli("convert", str(folder), f"{out}/", "--dtype", "bf16")
    assert code == 0, stderr
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["torch_dtype"] == "bfloat16"
    assert "note: rewrote config.json: quantization_config removed (the weights were dequantized)\n" in stderr


def test_tie_word_embeddings_follows_the_head_written(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = tiny_gpt2()
    folder = tmp_path / "gpt2"
    model.save_pretrained(folder)
    # A head of its own (an untied fine-tune) under a config that still says tied.
    state = load_file(folder / "model.safetensors")
    head = torch.randn_like(state["transformer.wte.weight"])
    from safetensors.torch import save_file

    save_file({**state, "lm_head.weight": head}, folder / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    code, _, stderr = run_cli("convert", str(folder), f"{out}/")
    assert code == 0, stderr
    assert "note: rewrote config.json: tie_word_embeddings true -> false\n" in stderr
    loaded = _assert_loads_cleanly(out, transformers.AutoModelForCausalLM)
    assert torch.equal(loaded.lm_head.weight, head)


# ------------------------------------------------------------------------------------------------
# Training runs
# ------------------------------------------------------------------------------------------------


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.arange(8) % 96
        return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """A real transformers.Trainer run of one step: run/checkpoint-1/ with optimizer.pt, scheduler.pt ..."""
    run = tmp_path_factory.mktemp("trainer") / "run"
    torch.manual_seed(0)
    model = tiny_gpt2()
    arguments = transformers.TrainingArguments(
        str(run),
        max_steps=1,
        save_steps=1,
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        logging_strategy="no",
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=_Tokens())
    trainer.train()
    trainer.save_model()  # the final model at the top of the run, beside checkpoint-1/
    return model, run


def test_a_trainer_checkpoint_folder_converts_its_model_and_leaves_the_training_state_out(
    trainer_run: tuple[Any, Path], tmp_path: Path
) -> None:
    model, run = trainer_run
    checkpoint = run / "checkpoint-1"
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"} <= set(os.listdir(checkpoint))
    out = tmp_path / "out"
    code, _, stderr = run_cli("convert", str(checkpoint), f"{out}/", "--dtype", "bf16")
    assert code == 0, stderr
    assert stderr.splitlines()[1:3] == [
        "note: rewrote config.json: dtype float32 -> bfloat16",
        "note: left out the training state beside the model, which is not weights: optimizer.pt (optimizer state "
        "(Adam moments)), rng_state.pth (random number generator state), scheduler.pt (learning-rate scheduler "
        "state), trainer_state.json (trainer state), training_args.bin (training arguments "
        "(transformers.training_args.TrainingArguments))",
    ]
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    loaded = _assert_loads_cleanly(out, transformers.AutoModelForCausalLM)
    inputs = _text_inputs(model)
    assert torch.equal(_logits(loaded, inputs), _logits(copy.deepcopy(model).to(torch.bfloat16), inputs))


def test_a_trainer_save_model_folder_converts_its_model_and_leaves_the_checkpoints_out(
    trainer_run: tuple[Any, Path], tmp_path: Path
) -> None:
    model, run = trainer_run
    out = tmp_path / "out"
    code, _, stderr = run_cli("convert", str(run), f"{out}/")
    assert code == 0, stderr
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert stderr.splitlines()[1:3] == [
        "note: left out the training state beside the model, which is not weights: training_args.bin (training "
        "arguments (transformers.training_args.TrainingArguments))",
        "note: left out 1 folder holding another model's weights (checkpoint-1/); convert them on their own",
    ]
    loaded = _assert_loads_cleanly(out, transformers.AutoModelForCausalLM)
    inputs = _text_inputs(model)
    assert torch.equal(_logits(loaded, inputs), _logits(model, inputs))


def test_an_optimizer_file_on_its_own_says_what_it_holds(trainer_run: tuple[Any, Path], tmp_path: Path) -> None:
    optimizer = run_dir = trainer_run[1] / "checkpoint-1" / "optimizer.pt"
    code, _, stderr = run_cli("convert", str(optimizer), str(tmp_path / "o.safetensors"))
    assert code == 1
    assert stderr == (
        f"ckptconv: error: {str(run_dir)!r} holds optimizer state (Adam moments), not model weights; convert the "
        "model file beside it\n"
    )


def test_batch_over_a_training_run_gives_its_model_folders(trainer_run: tuple[Any, Path], tmp_path: Path) -> None:
    # Each model folder of the run (its top, checkpoint-1/) is one item, converted into a model folder as convert
    # converts it; the training state beside each is left out with the note convert gives.
    model, run = trainer_run
    code, _, stderr = run_cli("batch", str(run), str(tmp_path / "out"))
    assert code == 0, stderr
    assert stderr.splitlines() == [
        "note: checkpoint-1: left out the training state beside the model, which is not weights: optimizer.pt "
        "(optimizer state (Adam moments)), rng_state.pth (random number generator state), scheduler.pt "
        "(learning-rate scheduler state), trainer_state.json (trainer state), training_args.bin (training arguments "
        "(transformers.training_args.TrainingArguments))",
        "note: run: left out the training state beside the model, which is not weights: training_args.bin (training "
        "arguments (transformers.training_args.TrainingArguments))",
        stderr.splitlines()[-1],
    ]
    assert stderr.splitlines()[-1].startswith("converted 2 of 2 items")
    for folder in ("checkpoint-1", "run"):
        out = tmp_path / "out" / folder
        assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
        loaded = _assert_loads_cleanly(out, transformers.AutoModelForCausalLM)
        assert torch.equal(_logits(loaded, _text_inputs(model)), _logits(model, _text_inputs(model)))


def test_an_accelerate_save_state_folder_converts_its_model(tmp_path: Path) -> None:
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = tiny_gpt2()
    accelerator = accelerate.Accelerator(cpu=True)
    accelerator.prepare(model, torch.optim.Adam(model.parameters()))
    accelerator.save_state(str(tmp_path / "state"))
    out = tmp_path / "out.safetensors"
    code, _, stderr = run_cli("convert", str(tmp_path / "state"), str(out))
    assert code == 0, stderr
    assert set(load_file(out)) == set(model.state_dict()) - {"lm_head.weight"}
    assert (
        "note: left out the training state beside the model, which is not weights: optimizer.bin (optimizer state), "
        "random_states_0.pkl (random number generator state)"
    ) in stderr


# ------------------------------------------------------------------------------------------------
# --like MODEL_DIR
# ------------------------------------------------------------------------------------------------


def _lightning(state: dict[str, torch.Tensor], folder: Path) -> Path:
    path = folder / "last.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in state.items()}, "epoch": 3, "optimizer_states": []}, path)
    return path


def _dcp(state: dict[str, torch.Tensor], folder: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    from .conftest import dcp_one_process

    dcp.save({k: v.clone() for k, v in state.items()}, checkpoint_id=str(folder / "dcp"), **dcp_one_process())
    return folder / "dcp"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize(
    ("command", "write_source"),
    [("fit", _lightning), ("fit", _dcp), ("convert", _lightning)],
    ids=["fit-lightning", "fit-dcp", "convert-lightning"],
)
def test_like_a_model_folder_gives_that_model_folder(command: str, write_source: Any, tmp_path: Path) -> None:
    torch.manual_seed(0)
    base = tiny_llama().to(torch.bfloat16)
    base.config.dtype = torch.bfloat16
    base.save_pretrained(tmp_path / "base", max_shard_size="40KB")
    reference_shards = sorted(p.name for p in (tmp_path / "base").glob("model-*.safetensors"))
    assert len(reference_shards) > 1
    torch.manual_seed(1)
    trained = tiny_llama()  # fp32 training weights, another seed
    source = write_source(trained.state_dict(), tmp_path)
    out = tmp_path / "out"
    code, _, stderr = run_cli(command, str(source), f"{out}/", "--like", f"{tmp_path / 'base'}/")
    assert code == 0, stderr
    assert sorted(os.listdir(out)) == sorted(os.listdir(tmp_path / "base"))
    assert (out / "config.json").read_bytes() == (tmp_path / "base" / "config.json").read_bytes()
    loaded = _assert_loads_cleanly(out, transformers.AutoModelForCausalLM)
    assert loaded.dtype == torch.bfloat16
    inputs = _text_inputs(trained)
    assert torch.equal(_logits(loaded, inputs), _logits(trained.to(torch.bfloat16), inputs))


def test_fit_like_a_model_folder_with_dtype_casts_as_asked(tmp_path: Path) -> None:
    torch.manual_seed(0)
    tiny_llama().save_pretrained(tmp_path / "base")
    torch.manual_seed(1)
    trained = tiny_llama()
    source = _lightning(trained.state_dict(), tmp_path)
    out = tmp_path / "out"
    code, _, stderr = run_cli("fit", str(source), f"{out}/", "--like", str(tmp_path / "base"), "--dtype", "fp16")
    assert code == 0, stderr
    assert "note: rewrote config.json: dtype float32 -> float16\n" in stderr
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.float16}


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft 0.21's own call
def test_a_peft_adapter_folder_converts_to_an_adapter_folder_peft_loads(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    adapted = peft.get_peft_model(tiny_llama(), config)
    adapted.save_pretrained(tmp_path / "adapter")
    out = tmp_path / "out"
    code, _, stderr = run_cli("convert", str(tmp_path / "adapter"), f"{out}/", "--dtype", "bf16")
    assert code == 0, stderr
    assert sorted(os.listdir(out)) == sorted(os.listdir(tmp_path / "adapter"))
    assert (out / "adapter_config.json").read_bytes() == (tmp_path / "adapter" / "adapter_config.json").read_bytes()
    source = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    written = load_file(out / "adapter_model.safetensors")
    assert written.keys() == source.keys()
    assert all(torch.equal(written[key], tensor.to(torch.bfloat16)) for key, tensor in source.items())
    loaded = peft.PeftModel.from_pretrained(tiny_llama(), out)
    held = peft.get_peft_model_state_dict(loaded)
    assert held.keys() == written.keys()
    assert all(torch.equal(held[key].to(torch.bfloat16), tensor) for key, tensor in written.items())
    assert all(torch.equal(held[key], tensor.to(held[key].dtype)) for key, tensor in written.items())


# ------------------------------------------------------------------------------------------------
# Folders of model folders: sentence-transformers modules, diffusers components
# ------------------------------------------------------------------------------------------------


def _sentence_transformer(folder: Path) -> Any:
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    bert = folder / "bert"
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48, vocab_size=50
    )
    transformers.BertModel(config).save_pretrained(bert)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"w{i}" for i in range(45))]
    (bert / "vocab.txt").write_text("\n".join(words))
    transformers.BertTokenizerFast(vocab_file=str(bert / "vocab.txt")).save_pretrained(bert)
    modules = [Transformer(str(bert)), Pooling(32), Dense(32, 8), Normalize()]
    model = st.SentenceTransformer(modules=modules, device="cpu")
    model.save(str(folder / "st"))
    return model


def test_a_sentence_transformer_converts_with_every_module(tmp_path: Path) -> None:
    model = _sentence_transformer(tmp_path)
    st = pytest.importorskip("sentence_transformers")
    out = tmp_path / "out"
    code, _, stderr = run_cli("convert", str(tmp_path / "st"), f"{out}/", "--dtype", "bf16")
    assert code == 0, stderr
    source_files = sorted(str(p.relative_to(tmp_path / "st")) for p in (tmp_path / "st").rglob("*") if p.is_file())
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == source_files
    assert "2_Dense/: cast floating-point tensors to bfloat16: 2 changed, 0 unchanged\n" in stderr
    dense = load_file(out / "2_Dense" / "model.safetensors")
    assert {tensor.dtype for tensor in dense.values()} == {torch.bfloat16}
    loaded = st.SentenceTransformer(str(out), device="cpu")
    sentences = ["w1 w2 w3", "w4 w5"]
    expected = model.to(torch.bfloat16).encode(sentences, convert_to_tensor=True)
    assert torch.equal(loaded.encode(sentences, convert_to_tensor=True), expected)


def test_a_diffusers_pipeline_folder_converts_component_by_component(tmp_path: Path) -> None:
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(
        sample_size=8,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
    )
    pipeline = diffusers.DDPMPipeline(unet=unet, scheduler=diffusers.DDPMScheduler(num_train_timesteps=10))
    pipeline.save_pretrained(tmp_path / "pipe")
    out = tmp_path / "out"
    code, _, stderr = run_cli("convert", str(tmp_path / "pipe"), f"{out}/", "--dtype", "bf16")
    assert code == 0, stderr
    wrote = stderr.splitlines()[-1]
    assert wrote.startswith(f"wrote {out}/: model_index.json, ") and wrote.endswith(
        " (safetensors, 114 tensors, 81.8 KiB)"
    )
    for name in ("model_index.json", "scheduler/scheduler_config.json", "unet/config.json"):
        assert (out / name).read_bytes() == (tmp_path / "pipe" / name).read_bytes()
    loaded, info = diffusers.UNet2DModel.from_pretrained(out / "unet", output_loading_info=True)
    assert all(not value for value in info.values()), info
    sample = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    reference = unet.to(torch.bfloat16).to(torch.float32)  # what the bf16 file holds, read into fp32
    with torch.no_grad():
        assert torch.equal(loaded.float()(sample, 3).sample, reference(sample, 3).sample)
    assert isinstance(diffusers.DDPMPipeline.from_pretrained(out).scheduler, diffusers.DDPMScheduler)


@pytest.mark.parametrize(("run", "golden"), [("ds_zero2_bf16", "golden_fp32.pt"), ("fsdp2_dtensor", "golden_full.pt")])
def test_fit_like_a_model_folder_from_zero_and_fsdp_runs(run: str, golden: str, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from .conftest import FIXTURES

    expected = torch.load(FIXTURES / "runs" / run / golden, map_location="cpu", weights_only=True)
    reference = tmp_path / "base"
    reference.mkdir()
    weights = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).clone() for k, v in expected.items()}
    save_file(weights, reference / "model.safetensors")
    (reference / "config.json").write_text(json.dumps({"model_type": "tiny", "dtype": "bfloat16"}))
    (reference / "tokenizer_config.json").write_text("{}")
    out = tmp_path / "out"
    code, _, stderr = run_cli("fit", str(FIXTURES / "runs" / run), f"{out}/", "--like", str(reference))
    assert code == 0, stderr
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer_config.json"]
    from safetensors import safe_open

    written = load_file(out / "model.safetensors")
    with safe_open(out / "model.safetensors", "pt") as file:
        aliases = json.loads((file.metadata() or {}).get("ckptconv.aliases", "{}"))  # tied: stored once
    written.update({alias: written[kept] for alias, kept in aliases.items()})
    assert sorted(written) == sorted(weights)
    assert all(torch.equal(written[key], tensor) for key, tensor in weights.items())
