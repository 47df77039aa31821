"""The first hour (issue "firsthour"): checking a conversion, mistakes that cost data, help a newcomer can scan."""

from __future__ import annotations

from pathlib import Path

import torch

from .conftest import run_cli


def _dp_model(path: Path, count: int = 3) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state = {f"module.layers.{i}.weight": torch.randn(2, 3) for i in range(count)}
    torch.save(state, path)
    return state


def test_swapped_arguments_are_refused_and_the_original_kept(tmp_path: Path) -> None:
    original = tmp_path / "dp_model.pkl"
    _dp_model(original)
    model = tmp_path / "model.pt"
    assert run_cli("strip-module", str(original), str(model), "-q")[0] == 0
    before = original.read_bytes()
    for extra in ((), ("--overwrite",)):
        code, stdout, stderr = run_cli("strip-module", str(model), str(original), *extra)
        assert (code, stdout) == (2, "")
        assert stderr == (
            f"ckptconv: error: the arguments look swapped: strip prefix 'module.' changes no key of {str(model)!r} "
            f"and 3 keys of {str(original)!r}, which exists; the source comes first: "
            f"ckptconv strip-module {original} {model}; see 'cli strip-module --help'\n"
        )
        assert "--overwrite" not in stderr
        assert original.read_bytes() == before


def _stripped_pair(tmp_path: Path) -> tuple[Path, Path]:
    original = tmp_path / "dp_model.pkl"
    _dp_model(original)
    model = tmp_path / "model.pt"
    assert run_cli("strip-module", str(original), str(model), "-q")[0] == 0
    return original, model


def test_verify_says_the_only_difference_is_the_prefix_and_names_the_flag(tmp_path: Path) -> None:
    original, model = _stripped_pair(tmp_path)
    assert run_cli("verify", str(original), str(model)) == (
        3,
        "verification failed: the keys differ only by the 'module.' prefix; with --strip-prefix module "
        "all 3 tensors match bit for bit\n",
        "",
    )
    assert run_cli("verify", str(original), str(model), "--strip-prefix", "module") == (
        0,
        "verified: all 3 tensors match bit for bit\n",
        "",
    )


def test_diff_takes_the_transforms_and_says_the_only_difference_is_the_prefix(tmp_path: Path) -> None:
    original, model = _stripped_pair(tmp_path)
    assert run_cli("diff", str(original), str(model)) == (
        3,
        "different only by the 'module.' prefix: with --strip-prefix module, 3 tensors identical, 0 differ\n",
        "",
    )
    assert run_cli("diff", str(model), str(original)) == (
        3,
        "different only by the 'module.' prefix: with --add-prefix module, 3 tensors identical, 0 differ\n",
        "",
    )
    assert run_cli("diff", str(original), str(model), "--strip-prefix", "module") == (
        0,
        "identical: 3 tensors identical, 0 differ, 0 only in A, 0 only in B\n",
        "",
    )
    assert run_cli("diff", str(original), str(model), "--canonical")[0] == 0


def test_strip_module_of_a_compiled_dataparallel_model_points_to_canonical(tmp_path: Path) -> None:
    source = tmp_path / "dp_compiled.pt"
    torch.save({f"module._orig_mod.layers.{i}.weight": torch.ones(2) for i in range(3)}, source)
    code, _, stderr = run_cli("strip-module", str(source), str(tmp_path / "out.pt"))
    assert code == 0
    assert (
        "note: every key still starts with '_orig_mod.' (torch.compile); pass --canonical to remove every "
        "wrapper prefix\n"
    ) in stderr


def _averaged(path: Path) -> torch.nn.Module:
    from torch.optim.swa_utils import AveragedModel

    model = torch.nn.Linear(3, 2)
    torch.save(AveragedModel(model).state_dict(), path)
    return model


def test_canonical_strips_an_averaged_model_and_sets_its_counter_aside(tmp_path: Path) -> None:
    source = tmp_path / "swa.pt"
    model = _averaged(source)
    output = tmp_path / "model.pt"
    code, _, stderr = run_cli("convert", str(source), str(output), "--canonical")
    assert code == 0, stderr
    assert "note: removed wrappers: 'module.' from 2 keys\n" in stderr
    assert (
        "note: set aside 'n_averaged', the counter AveragedModel (SWA/EMA) keeps beside the weights; no model has it\n"
    ) in stderr
    assert "no wrapper prefixes found" not in stderr
    model.load_state_dict(torch.load(output, weights_only=True), strict=True)


def test_fit_recognises_an_averaged_model(tmp_path: Path) -> None:
    source = tmp_path / "swa.pt"
    model = _averaged(source)
    reference = tmp_path / "reference.pt"
    torch.save(model.state_dict(), reference)
    output = tmp_path / "model.pt"
    code, _, stderr = run_cli("fit", str(source), str(output), "--like", str(reference))
    assert code == 0, stderr
    model.load_state_dict(torch.load(output, weights_only=True), strict=True)


def test_canonical_says_how_many_keys_have_module_when_only_some_do(tmp_path: Path) -> None:
    source = tmp_path / "mixed.pt"
    torch.save({"module.a": torch.ones(1), "module.b": torch.ones(1), "head.c": torch.ones(1)}, source)
    code, _, stderr = run_cli("convert", str(source), str(tmp_path / "out.pt"), "--canonical")
    assert code == 0
    assert (
        "note: 'module.' starts 2 of 3 keys, so --canonical kept it (it removes 'module.' only when every key "
        "has it); pass --strip-prefix module to remove it from those 2\n"
    ) in stderr
    assert "already canonical" not in stderr


def test_transform_help_is_grouped_and_shows_only_what_the_command_takes() -> None:
    code, stdout, _ = run_cli("strip-module", "--help")
    assert code == 0
    headings = [line for line in stdout.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert headings == ["Selection:", "Transforms:", "Output:", "Safety:", "Speed:", "Run:", "Other options:"]
    assert "--add-prefix" not in stdout and "dcp" not in stdout
    assert "--strip-prefix" not in run_cli("add-module", "--help")[1]
    assert "[pt|safetensors|dcp|megatron]" in run_cli("convert", "--help")[1]


def test_commands_are_listed_in_workflow_order_with_whole_summaries() -> None:
    import re

    stdout = run_cli("--help")[1]
    commands = [line.split()[0] for line in stdout.splitlines() if re.match(r"^  [a-z][a-z-]+ +[A-Z]", line)]
    converting = ["convert", "strip-module", "add-module", "fit", "batch", "merge-lora", "extract-lora"]
    assert commands == ["inspect", "scan", *converting, "verify", "diff"]
    words = " ".join(stdout.split())
    assert "strip-module Remove the 'module.' prefix DataParallel and DDP add to every key. add-module" in words
    assert "..." not in stdout[stdout.index("Look at checkpoints:") : stdout.index("Exit codes:")]


def test_a_close_command_is_suggested() -> None:
    assert run_cli("strip", "a.pt", "b.pt") == (
        2,
        "",
        "ckptconv: error: No such command 'strip'. Did you mean 'strip-module'?; see 'cli --help'\n",
    )


def test_scan_names_the_files_under_the_folder_as_it_was_typed(tmp_path: Path, monkeypatch: object) -> None:
    import os

    (tmp_path / "incoming").mkdir()
    torch.save({"w": torch.ones(1)}, tmp_path / "incoming" / "model.pt")
    os.chdir(tmp_path)
    try:
        assert run_cli("scan", "incoming/")[:2] == (
            0,
            "safe              incoming/model.pt: holds only tensors, containers and plain data, which "
            "torch.load(weights_only=True) loads\n",
        )
    finally:
        os.chdir(Path(__file__).parent)


def test_inspect_of_a_training_run_counts_the_bytes_of_its_files() -> None:
    run = Path(__file__).resolve().parent.parent / "fixtures" / "runs" / "ds_zero2_bf16" / "global_step3"
    total = sum(path.stat().st_size for path in run.iterdir())
    code, stdout, _ = run_cli("inspect", str(run), "--limit", "0")
    assert code == 0
    assert stdout.splitlines()[0].startswith(f"{run}: deepspeed, {total / 1024:.1f} KiB, saved on")


def test_wrote_a_folder_names_its_files(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"a": torch.ones(300, 300), "b": torch.ones(300, 300)}, str(tmp_path / "m.safetensors"))
    out = tmp_path / "out"
    code, _, stderr = run_cli("convert", str(tmp_path / "m.safetensors"), f"{out}/", "--max-shard-size", "400KB")
    assert code == 0
    assert stderr.splitlines()[-1] == (
        f"wrote {out}/: model-00001-of-00002.safetensors, model-00002-of-00002.safetensors, "
        "model.safetensors.index.json (safetensors, 2 tensors, 703.1 KiB)"
    )


def test_inspect_of_safetensors_says_nothing_of_devices_it_does_not_record(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"a": torch.ones(2)}, str(tmp_path / "m.safetensors"))
    first = run_cli("inspect", str(tmp_path / "m.safetensors"))[1].splitlines()[0]
    assert first == f"{tmp_path / 'm.safetensors'}: safetensors, {(tmp_path / 'm.safetensors').stat().st_size} B"


def test_a_hub_id_says_ckptconv_reads_local_files_and_how_to_download(tmp_path: Path) -> None:
    import os

    os.chdir(tmp_path)
    try:
        code, _, stderr = run_cli("inspect", "openai-community/gpt2")
    finally:
        os.chdir(Path(__file__).parent)
    assert code == 1
    assert stderr == (
        "ckptconv: error: 'openai-community/gpt2' does not exist (ckptconv reads local files; for the Hugging "
        "Face Hub model, download it first: huggingface-cli download openai-community/gpt2 --local-dir gpt2, "
        "then pass the folder); check the path\n"
    )
