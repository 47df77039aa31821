"""Multi-GPU training runs read as one set of weights: DeepSpeed ZeRO folders.

The fixtures under ``fixtures/runs/`` were written by real DeepSpeed on 2 GPUs
(``fixtures/make_training_run_fixtures.py``); each holds the framework's own
consolidation as golden: ``golden_fp32.pt`` from
``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` and
``golden_module.pt`` from ``engine.module.state_dict()``. Goldens are read with
``torch.load(weights_only=True)``; outputs with torch or the safetensors library.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

import ckptconv
from ckptconv.cli import cli
from ckptconv.dtypes import dtype_by_name
from ckptconv.errors import SelectionError
from ckptconv.transforms.keys import AddPrefix, Cast, Keep, Rename

from .conftest import FIXTURES, HAS_PUBLIC_DTENSOR, assert_same_state, assert_same_tensor, dcp_one_process, run_cli

RUNS = FIXTURES / "runs"
ROOT = Path(__file__).resolve().parent.parent
ZERO = [f"ds_zero{stage}_{dtype}" for stage in (1, 2, 3) for dtype in ("bf16", "fp16")]
FROZEN = ("frozen.weight", "frozen.bias")


def golden(run: str, name: str = "golden_fp32.pt") -> dict[str, torch.Tensor]:
    return torch.load(RUNS / run / name, map_location="cpu", weights_only=True)


def expected_fp32(run: str) -> dict[str, torch.Tensor]:
    """zero_to_fp32's result; for stage 1, which records no frozen parameters (so zero_to_fp32
    drops them), plus the frozen parameters as the module saved them."""
    expected = golden(run)
    if run.startswith("ds_zero1"):
        module = golden(run, "golden_module.pt")
        assert not set(FROZEN) & set(expected)
        ordered = {k: v for k, v in expected.items() if k in ("pos_scale", "seen")}
        ordered.update({k: module[k] for k in FROZEN})
        ordered.update({k: v for k, v in expected.items() if k not in ordered})
        expected = ordered
    return expected


@pytest.mark.parametrize("run", ZERO)
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_zero_master_weights_equal_zero_to_fp32(run: str, suffix: str, tmp_path: Path) -> None:
    out = tmp_path / f"model{suffix}"
    ckptconv.convert(RUNS / run, out)
    expected = expected_fp32(run)
    if suffix == ".pt":
        ours = torch.load(out, weights_only=True)
        assert_same_state(ours, expected)
        assert ours["head.weight"].data_ptr() == ours["emb.weight"].data_ptr()  # still tied
    else:
        ours = load_file(out)
        with safe_open(out, "pt") as file:
            aliases = json.loads(file.metadata()["ckptconv.aliases"])
        assert aliases == {"head.weight": "emb.weight"}
        assert_same_state(ours, {k: v for k, v in expected.items() if k != "head.weight"}, ordered=False)


@pytest.mark.parametrize("run", [r for r in ZERO if "zero3" not in r])
def test_select_module_gives_the_saved_16_bit_weights(run: str, tmp_path: Path) -> None:
    out = tmp_path / "module.pt"
    ckptconv.convert(RUNS / run, out, select="module")
    assert_same_state(torch.load(out, weights_only=True), golden(run, "golden_module.pt"))


@pytest.mark.parametrize("run", [r for r in ZERO if "zero3" in r])
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_zero3_select_module_gives_the_master_weights_in_their_saved_16_bit_dtype(
    run: str, suffix: str, tmp_path: Path
) -> None:
    """ZeRO-3 saves the module's parameters as empty placeholders; DeepSpeed's 16-bit weights are
    its fp32 masters copied (``copy_``: torch's rounding) into each parameter's dtype after every
    step, which the stage 1-2 runs confirm bit for bit against ``engine.module``
    (test_master_weights_rounded_are_the_module_weights_deepspeed_saved). So the golden here is
    zero_to_fp32's result rounded by torch to the placeholders' dtype, the frozen parameters and
    the buffers as saved."""
    half = torch.bfloat16 if run.endswith("bf16") else torch.float16
    fp32 = golden(run)
    expected = {k: fp32[k] for k in ("pos_scale", "seen")}  # the buffers, as the module saved them
    expected.update({k: fp32[k] for k in FROZEN})  # already 16-bit
    for key in ("emb.weight", "fc1.weight", "fc1.bias", "norm.weight", "norm.bias", "fc2.weight", "head.weight"):
        expected[key] = fp32[key].to(half)
    out = tmp_path / f"module{suffix}"
    ckptconv.convert(RUNS / run, out, select="module")
    ours = torch.load(out, weights_only=True) if suffix == ".pt" else load_file(out)
    if suffix == ".pt":
        assert ours["head.weight"].untyped_storage().data_ptr() == ours["emb.weight"].untyped_storage().data_ptr()
    else:
        ours.setdefault("head.weight", ours.get("emb.weight"))  # the tie, written once
    assert_same_state(ours, expected, ordered=False)


@pytest.mark.parametrize("run", ZERO)
def test_the_tag_folder_and_the_run_folder_read_alike(run: str) -> None:
    from_run = ckptconv.load(RUNS / run)
    from_tag = ckptconv.load(RUNS / run / "global_step3")
    assert_same_state(from_run, expected_fp32(run))
    assert_same_state(from_tag, from_run)


def test_transforms_apply_to_the_rebuilt_weights(tmp_path: Path) -> None:
    out = tmp_path / "bf16.safetensors"
    ckptconv.convert(
        RUNS / "ds_zero3_bf16",
        out,
        transforms=[AddPrefix("model"), Keep(r"^model\.fc"), Cast(dtype_by_name("bfloat16"))],
    )
    ours = load_file(out)
    expected = {f"model.{k}": v.to(torch.bfloat16) for k, v in golden("ds_zero3_bf16").items() if k.startswith("fc")}
    assert_same_state(ours, expected, ordered=False)


def test_inspect_names_framework_stage_world_size_and_outputs() -> None:
    info = ckptconv.inspect(RUNS / "ds_zero2_bf16")
    assert info.format == "deepspeed"
    assert info.metadata["framework"] == "DeepSpeed 0.19.8"
    assert info.metadata["zero_stage"] == "2"
    assert info.metadata["world_size"] == "2"
    assert info.metadata["tag"] == "global_step3"
    assert info.metadata["master_weights"].startswith("float32 (state_dict")
    assert info.metadata["module_weights"].startswith("bfloat16 (module")
    assert info.selected == "state_dict"
    assert info.alternatives == ("module",)
    assert "frozen_parameters" not in info.metadata
    assert ckptconv.inspect(RUNS / "ds_zero1_fp16").metadata["frozen_parameters"].startswith("2 taken from the module")
    assert {"cuda:0", "cuda:1"} <= set(info.saved_devices)
    assert "deepspeed.runtime.zero.config.ZeroStageEnum" in info.foreign_globals
    three = ckptconv.inspect(RUNS / "ds_zero3_fp16")
    assert three.metadata["zero_stage"] == "3"
    assert three.metadata["module_weights"].startswith("float16 (module: the master weights cast")
    assert three.dtypes == {"float32": 8, "int64": 1, "float16": 2}


def test_cli_inspect_and_convert(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(cli, ["inspect", str(RUNS / "ds_zero3_bf16")])
    assert result.exit_code == 0, result.output
    assert "deepspeed" in result.output and "zero_stage: 3" in result.output
    out = tmp_path / "m.safetensors"
    result = runner.invoke(cli, ["convert", str(RUNS / "ds_zero3_bf16"), str(out)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(cli, ["convert", str(RUNS / "ds_zero3_bf16"), str(tmp_path / "x.pt"), "--select", "module"])
    assert result.exit_code == 0, result.output
    assert torch.load(tmp_path / "x.pt", weights_only=True)["fc1.weight"].dtype == torch.bfloat16


def test_zero_checkpoints_read_without_deepspeed_installed() -> None:
    code = (
        "import sys, ckptconv; ckptconv.load(sys.argv[1]); "
        "assert not any(m.split('.')[0] in ('deepspeed', 'megatron') for m in sys.modules)"
    )
    result = subprocess.run(  # noqa: PLW1510 - the return code is asserted
        [sys.executable, "-c", code, str(RUNS / "ds_zero3_fp16")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_batch_treats_a_run_folder_as_one_item(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    shutil.copytree(RUNS / "ds_zero2_fp16", src / "run_a")
    shutil.copytree(RUNS / "ds_zero3_fp16", src / "nested" / "run_b")
    for golden_file in src.rglob("golden_*.pt"):
        golden_file.unlink()
    report = ckptconv.batch(src, tmp_path / "out")
    assert report.exit_code == 0, report.summary()
    assert [(r.source, r.kind, r.output, r.status) for r in report.results] == [
        ("nested/run_b", "run", "nested/run_b.safetensors", "converted"),
        ("run_a", "run", "run_a.safetensors", "converted"),
    ]
    ours = load_file(tmp_path / "out" / "run_a.safetensors")
    assert_same_tensor(ours["fc1.weight"], golden("ds_zero2_fp16")["fc1.weight"])


# -- refusals: one line, nothing written ---------------------------------------------------


def _copy(run: str, tmp_path: Path) -> Path:
    target = tmp_path / run
    shutil.copytree(RUNS / run, target)
    return target


def _refused(path: Path, tmp_path: Path, expected: str) -> None:
    out = tmp_path / "out.safetensors"
    result = CliRunner().invoke(cli, ["convert", str(path), str(out)])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("ckptconv: error: ") and result.output.count("\n") == 1, result.output
    assert expected in result.output
    assert not out.exists()


def test_a_missing_rank_is_refused(tmp_path: Path) -> None:
    run = _copy("ds_zero2_bf16", tmp_path)
    (run / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    _refused(run, tmp_path, "ZeRO was run on 2 ranks but 1 optimizer files are there")


def test_a_missing_stage3_model_file_is_refused(tmp_path: Path) -> None:
    run = _copy("ds_zero3_bf16", tmp_path)
    (run / "global_step3" / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    _refused(run, tmp_path, "is incomplete: 1 model states files for 2 ranks")


def test_latest_may_not_point_outside_the_run(tmp_path: Path) -> None:
    run = _copy("ds_zero2_bf16", tmp_path)
    (run / "latest").write_text("../elsewhere")
    _refused(run, tmp_path, "its 'latest' file names '../elsewhere'")


def test_tensor_parallel_runs_are_refused(tmp_path: Path) -> None:
    run = _copy("ds_zero2_bf16", tmp_path)
    step = run / "global_step3"
    shutil.copy(step / "mp_rank_00_model_states.pt", step / "mp_rank_01_model_states.pt")
    shutil.copy(
        step / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        step / "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt",
    )
    _refused(run, tmp_path, "with tensor or pipeline parallelism")


@pytest.mark.parametrize("run", ["ds_zero1_bf16_fp32accum", *[r for r in ZERO if "zero3" not in r]])
def test_master_weights_rounded_are_the_module_weights_deepspeed_saved(run: str) -> None:
    """DeepSpeed copies the fp32 masters into the 16-bit module after each step: rounding ours
    must give its saved module weights exactly. For BF16_Optimizer checkpoints (ZeRO-1 with fp32
    gradient accumulation), which zero_to_fp32 refuses, this and DeepSpeed's param_slice_mappings
    are the independent checks."""
    ours = ckptconv.load(RUNS / run)
    module = golden(run, "golden_module.pt")
    assert sorted(ours) == sorted(module)
    for key, value in module.items():
        rounded = ours[key].to(value.dtype) if value.is_floating_point() else ours[key]
        assert_same_tensor(rounded, value, key)
    if run == "ds_zero1_bf16_fp32accum":
        info = ckptconv.inspect(RUNS / run)
        assert info.metadata["zero_stage"].startswith("1 (BF16_Optimizer")
        assert info.dtypes == {"float32": 8, "int64": 1, "bfloat16": 2}


# -- memory: bounded by the largest tensor, not by a rank's optimizer file ------------------


def write_zero2_run(folder: Path, shapes: dict[str, tuple[int, ...]], world: int = 2) -> dict[str, torch.Tensor]:
    """A ZeRO-2 checkpoint laid out as DeepSpeed lays it out (plain dicts instead of its classes):
    one parameter group, each rank's fp32 partition beside Adam moments of the same size.
    Returns the parameters, to compare against."""
    generator = torch.Generator().manual_seed(0)
    params = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    flat = torch.cat([p.reshape(-1) for p in params.values()])
    align = 2 * world
    flat = torch.cat([flat, torch.zeros(-len(flat) % align)])
    parts = flat.chunk(world)
    step = folder / "global_step7"
    step.mkdir(parents=True)
    (folder / "latest").write_text("global_step7")
    module = {name: p.to(torch.bfloat16) for name, p in params.items()}
    torch.save(
        {
            "module": module,
            "buffer_names": [],
            "param_shapes": [{name: torch.Size(shape) for name, shape in shapes.items()}],
            "frozen_param_shapes": None,
            "frozen_param_fragments": None,
            "shared_params": {},
            "optimizer": None,
            "global_steps": 7,
            "ds_version": "0.0.synthetic",
        },
        step / "mp_rank_00_model_states.pt",
    )
    for rank, part in enumerate(parts):
        state = {
            "zero_stage": 2,
            "partition_count": [world],
            "single_partition_of_fp32_groups": [part.clone()],
            "base_optimizer_state": {"state": {0: {"exp_avg": part * 0.5, "exp_avg_sq": part * part}}},
        }
        torch.save({"optimizer_state_dict": state}, step / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return params


def test_synthetic_zero2_layout_rebuilds_exactly(tmp_path: Path) -> None:
    shapes = {"a": (3, 5), "b": (7,), "c": (2, 2, 3), "d": (1,)}  # 37 elements: padded, split mid-tensor
    params = write_zero2_run(tmp_path / "run", shapes, world=4)
    assert_same_state(ckptconv.load(tmp_path / "run"), params)


_MEASURE_RSS = """
import resource, sys
import ckptconv, numpy
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ckptconv.convert(sys.argv[1], sys.argv[2], source_hash=False)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_peak_memory_stays_near_the_largest_tensor_not_the_optimizer_files(tmp_path: Path) -> None:
    """Each rank's optimizer file holds 192 MiB (a 64 MiB fp32 partition and Adam's moments) and
    the largest tensor is 1 MiB: converting grows the peak RSS of a fresh process by far less
    than one partition (about 11 MiB measured, the same with 16 MiB partitions)."""
    shapes = {f"layer{i}.weight": (512, 512) for i in range(128)}
    write_zero2_run(tmp_path / "run", shapes)
    partition = 64 << 20
    assert (tmp_path / "run" / "global_step7" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").stat().st_size > (
        3 * partition
    )
    out = tmp_path / "out.safetensors"
    result = subprocess.run(  # noqa: PLW1510 - the return code is asserted
        [sys.executable, "-c", _MEASURE_RSS, str(tmp_path / "run"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    grown = int(result.stdout.strip())
    assert grown < partition // 4, f"peak RSS grew by {grown / 2**20:.1f} MiB"
    with safe_open(out, "pt") as file:
        assert len(file.keys()) == 128


# -- FSDP2: DTensor state dicts saved per rank with torch.save (verl's layout) ---------------

FSDP2 = ["fsdp2_dtensor", "fsdp2_dtensor_bf16"]


@pytest.mark.parametrize("run", FSDP2)
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_fsdp2_rank_files_merge_to_the_gathered_full_state_dict(run: str, suffix: str, tmp_path: Path) -> None:
    out = tmp_path / f"model{suffix}"
    ckptconv.convert(RUNS / run, out)
    expected = golden(run, "golden_full.pt")
    if suffix == ".pt":
        ours = torch.load(out, weights_only=True)
        assert_same_state(ours, expected)
        assert ours["head.weight"].data_ptr() == ours["emb.weight"].data_ptr()  # tied in the model
    else:
        assert_same_state(load_file(out), {k: v for k, v in expected.items() if k != "head.weight"}, ordered=False)


def test_fsdp2_rank_files_torch_2_4_wrote_merge_to_its_gathered_state_dict(tmp_path: Path) -> None:
    """torch 2.4 pickles DTensors as torch.distributed._tensor.api.DTensor with its own DTensorSpec
    layout (fixtures/make_torch24_fixtures.py, run with torch 2.4.1): 7 embedding rows over 2 ranks
    (4 and 3), tied to the head, beside a plain int buffer."""
    run = RUNS / "fsdp2_dtensor_torch24"
    for rank in range(2):
        pickled = zipfile.ZipFile(run / f"model_world_size_2_rank_{rank}.pt").read(
            f"model_world_size_2_rank_{rank}/data.pkl"
        )
        assert b"torch.distributed._tensor.api\nDTensor\n" in pickled
    expected = golden("fsdp2_dtensor_torch24", "golden_full.pt")
    assert_same_state(ckptconv.load(run), expected)
    out = tmp_path / "model.pt"
    ckptconv.convert(run, out, verify="torch")
    ours = torch.load(out, weights_only=True)
    assert_same_state(ours, expected)
    assert ours["head.weight"].data_ptr() == ours["emb.weight"].data_ptr()  # tied in the model


@pytest.mark.parametrize("run", ["fsdp2_dtensor_torch213", "dtensor_2d_mesh_torch213"])
def test_dtensor_rank_files_torch_2_13_wrote_merge_to_their_gathered_state_dict(run: str, tmp_path: Path) -> None:
    """torch 2.13 pickles the mesh as a _MeshLayout of _FlatLayouts (torch 2.11: its shape), which was
    refused as "no readable device mesh" (fixtures/make_torch213_dtensor_fixtures.py, CPU and gloo):
    FSDP2 over 2 ranks, and a 2 x 2 mesh with a dimension split by both mesh dimensions."""
    expected = golden(run, "golden_full.pt")
    assert_same_state(ckptconv.load(RUNS / run), expected)
    out = tmp_path / "model.pt"
    ckptconv.convert(RUNS / run, out, verify="torch")
    assert_same_state(torch.load(out, weights_only=True), expected)


def test_a_dtensor_split_over_the_mesh_in_another_order_is_refused() -> None:
    """torch 2.13's shard_order may split a tensor dimension over the mesh's dimensions in another order
    than the mesh's, which places the pieces elsewhere: refused, not placed in the mesh's order."""
    from ckptconv.reading.formats import rank_shards, torch_zip

    path = str(RUNS / "dtensor_2d_mesh_torch213" / "model_world_size_4_rank_1.pt")
    value = torch_zip.read(path).tree["b"]  # [Shard(0), Shard(0)]: dimension 0 over mesh dimensions (0, 1)
    (entry,) = value.attributes()["_spec"].attributes()["shard_order"]
    assert entry.args == (0, (0, 1))
    rank_shards._shard(value, path, "b")
    entry.args = (0, (1, 0))
    with pytest.raises(ckptconv.UnsupportedFormatError, match="another order than the mesh's"):
        rank_shards._shard(value, path, "b")
    entry.args = (1, (0, 1))
    with pytest.raises(ckptconv.MalformedCheckpointError, match="does not match its placements"):
        rank_shards._shard(value, path, "b")


def test_fsdp2_inspect_and_verl_sibling_files(tmp_path: Path) -> None:
    """verl saves optimizer and extra state per rank beside the model: the model files are taken."""
    run = _copy("fsdp2_dtensor", tmp_path)
    for rank in range(2):
        torch.save({"lr": 0.1}, run / f"optim_world_size_2_rank_{rank}.pt")
        torch.save({"rng": 1}, run / f"extra_state_world_size_2_rank_{rank}.pt")
    info = ckptconv.inspect(run)
    assert info.format == "rank-shards"
    assert info.metadata["world_size"] == "2"
    assert info.metadata["placements"] == "Shard(0): 8 tensors"  # the tied pair counts once
    assert info.metadata["files"] == "model_world_size_2_rank_0.pt ... model_world_size_2_rank_1.pt"
    assert_same_state(ckptconv.load(run), golden("fsdp2_dtensor", "golden_full.pt"))


def test_fsdp2_a_missing_rank_is_not_a_set(tmp_path: Path) -> None:
    run = _copy("fsdp2_dtensor", tmp_path)
    (run / "model_world_size_2_rank_1.pt").unlink()
    (run / "golden_full.pt").unlink()
    # One rank's file alone is an ordinary file: it reads, with its DTensors as stand-ins.
    assert ckptconv.open(run).format == "torch-zip"


def test_fsdp2_a_shard_that_does_not_fit_its_placement_is_refused(tmp_path: Path) -> None:
    run = _copy("fsdp2_dtensor", tmp_path)
    # rank 1's file in place of rank 0's: its shards sit where rank 0's belong by the mesh coordinates
    shutil.copy(run / "model_world_size_2_rank_1.pt", run / "model_world_size_2_rank_0.pt")
    _refused(run, tmp_path, "do not tile a tensor of size [37, 12]")


@pytest.mark.skipif(
    not HAS_PUBLIC_DTENSOR, reason="edits the fixture with torch.load, which needs torch.distributed.tensor.DTensor"
)
def test_fsdp2_a_tie_on_one_rank_only_is_not_taken_for_all(tmp_path: Path) -> None:
    """head.weight views emb.weight's storage on rank 0 but holds values of its own on rank 1: the
    gathered head.weight is rank 0's rows then rank 1's own; ckptconv wrote emb.weight under both."""
    run = _copy("fsdp2_dtensor", tmp_path)
    rank1 = run / "model_world_size_2_rank_1.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = torch.load(rank1, weights_only=False, map_location="cpu")  # the fixture, edited
        state["head.weight"]._local_tensor = state["head.weight"]._local_tensor + 1  # a tensor of its own
        torch.save(state, rank1)
    expected = golden("fsdp2_dtensor", "golden_full.pt")
    rows = expected["emb.weight"].shape[0] - state["head.weight"]._local_tensor.shape[0]
    expected["head.weight"] = torch.cat([expected["emb.weight"][:rows], state["head.weight"]._local_tensor])
    out = tmp_path / "model.pt"
    ckptconv.convert(run, out)
    ours = torch.load(out, weights_only=True)
    assert_same_state(ours, expected)
    assert ours["head.weight"].data_ptr() != ours["emb.weight"].data_ptr()


# -- FSDP1: SHARDED_STATE_DICT (ShardedTensor) and LOCAL_STATE_DICT saved per rank ---------

FSDP1 = ["fsdp1_sharded", "fsdp1_sharded_bf16"]


@pytest.mark.parametrize("run", FSDP1)
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_fsdp1_sharded_tensors_merge_to_the_gathered_full_state_dict(run: str, suffix: str, tmp_path: Path) -> None:
    """FSDP1 pickles reach ShardedTensor.ProcessGroupState (and, on Python 3.12, an enum member)
    through builtins.getattr: read as stand-ins, shards placed by their offsets (37 rows: 19 + 18)."""
    out = tmp_path / f"model{suffix}"
    ckptconv.convert(RUNS / run, out)
    expected = golden(run, "golden_full.pt")
    ours = torch.load(out, weights_only=True) if suffix == ".pt" else load_file(out)
    assert_same_state(ours, expected, ordered=suffix == ".pt")


def test_fsdp1_inspect_names_the_framework() -> None:
    info = ckptconv.inspect(RUNS / "fsdp1_sharded")
    assert info.format == "rank-shards"
    assert info.metadata == {
        "framework": "FSDP1 SHARDED_STATE_DICT (ShardedTensor) saved per rank with torch.save",
        "world_size": "2",
        "files": "model_world_size_2_rank_0.pt ... model_world_size_2_rank_1.pt",
        "placements": "ShardedTensor shards placed by their offsets: 9 tensors",
    }


def test_fsdp1_local_state_dict_is_refused_with_what_to_save_instead(tmp_path: Path) -> None:
    """LOCAL_STATE_DICT holds each rank's slice of the flat parameter (and, with use_orig_params,
    1-D slices of each parameter): no shapes, so no exact rebuild."""
    run = _copy("fsdp1_local", tmp_path)
    (run / "golden_full.pt").unlink()
    expected = (
        "holds FSDP1 LOCAL_STATE_DICT files (2 ranks, flat parameter '_flat_param'): each rank's slice of the "
        "flattened parameters, which does not record their shapes, so they cannot be rebuilt exactly; save with "
        "SHARDED_STATE_DICT or FULL_STATE_DICT and convert that"
    )
    _refused(run, tmp_path, expected)
    result = CliRunner().invoke(cli, ["inspect", str(run)])
    assert result.exit_code == 1 and result.output == f"ckptconv: error: {str(run)!r} {expected}\n"


def _edit_pickle(path: Path, old: bytes, new: bytes) -> None:
    """Replace bytes in a torch zip file's pickle, keeping the file a valid zip."""
    with zipfile.ZipFile(path) as archive:
        members = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in members:
            if name.endswith("data.pkl"):
                assert old in data
            archive.writestr(name, data.replace(old, new) if name.endswith("data.pkl") else data)


def test_fsdp1_overlapping_shards_are_refused(tmp_path: Path) -> None:
    """Rank 1's rows of emb.weight moved from 19 to 18 in every rank's metadata: the volumes still
    add up to 37 rows, but row 18 has two values and row 36 none."""
    run = _copy("fsdp1_sharded", tmp_path)
    for rank in range(2):
        _edit_pickle(run / f"model_world_size_2_rank_{rank}.pt", b"K\x13K\x00", b"K\x12K\x00")
    _refused(run, tmp_path, "the shards of 'emb.weight' at [0, 0] and [18, 0] overlap")


def test_fsdp1_a_shard_no_rank_holds_is_refused(tmp_path: Path) -> None:
    run = _copy("fsdp1_sharded", tmp_path)
    shutil.copy(run / "model_world_size_2_rank_0.pt", run / "model_world_size_2_rank_1.pt")
    _refused(run, tmp_path, "no rank holds the shard of 'emb.weight' at [19, 0] that its metadata lists")


def test_fsdp1_ranks_disagreeing_on_the_metadata_are_refused(tmp_path: Path) -> None:
    run = _copy("fsdp1_sharded", tmp_path)
    _edit_pickle(run / "model_world_size_2_rank_0.pt", b"K\x13K\x00", b"K\x12K\x00")
    _refused(run, tmp_path, "the metadata of 'emb.weight' here differs from rank 0's")


def test_fsdp1_a_shard_of_another_dtype_than_its_metadata_records_is_refused(tmp_path: Path) -> None:
    """Rank 0's ShardedTensor metadata records float64 (tensor_properties) where its shards hold float32:
    ShardedTensor gathers into a tensor of the recorded dtype; ckptconv wrote float32."""
    run = _copy("fsdp1_sharded", tmp_path)
    # torch.float32 is named once in the pickle, by the tensor_properties (the shards' storages are FloatStorage)
    _edit_pickle(run / "model_world_size_2_rank_0.pt", b"torch\nfloat32\n", b"torch\nfloat64\n")
    _refused(run, tmp_path, "the local shard of 'emb.weight' at [0, 0] holds float32 but its metadata records float64")


def test_fsdp1_scan_is_foreign_not_unsafe() -> None:
    report = ckptconv.scan(RUNS / "fsdp1_sharded")
    assert report.verdict == "foreign", report.reason
    assert "ShardedTensor" in report.reason


def test_batch_treats_per_rank_files_as_one_item(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(RUNS / "fsdp2_dtensor", src / "global_step_5" / "actor")
    (src / "global_step_5" / "actor" / "golden_full.pt").unlink()
    for rank in range(2):
        torch.save({"lr": 0.1}, src / "global_step_5" / "actor" / f"optim_world_size_2_rank_{rank}.pt")
    report = ckptconv.batch(src, tmp_path / "out")
    assert [(r.source, r.kind, r.status) for r in report.results] == [("global_step_5/actor", "run", "converted")]
    assert_same_state(
        load_file(tmp_path / "out" / "global_step_5" / "actor.safetensors"),
        {k: v for k, v in golden("fsdp2_dtensor", "golden_full.pt").items() if k != "head.weight"},
        ordered=False,
    )


def test_batch_treats_fsdp1_rank_files_as_one_item_each(tmp_path: Path) -> None:
    """A SHARDED_STATE_DICT set converts as one item; a LOCAL_STATE_DICT set is one failed item
    that says what to save instead."""
    src = tmp_path / "src"
    for run in ("fsdp1_sharded", "fsdp1_local"):
        shutil.copytree(RUNS / run, src / run)
        (src / run / "golden_full.pt").unlink()
    report = ckptconv.batch(src, tmp_path / "out")
    assert [(r.source, r.kind, r.status) for r in report.results] == [
        ("fsdp1_local", "run", "failed"),
        ("fsdp1_sharded", "run", "converted"),
    ]
    assert "save with SHARDED_STATE_DICT or FULL_STATE_DICT" in (report.results[0].error or "")
    assert_same_state(
        load_file(tmp_path / "out" / "fsdp1_sharded.safetensors"),
        golden("fsdp1_sharded", "golden_full.pt"),
        ordered=False,
    )


# -- Megatron-Core torch_dist: TP=2, stacked layers ------------------------------------------

# Megatron's checkpoints use Transformer Engine's names for the layer norms fused into the next
# linear layer; the golden model was built with the local spec, which names them apart.
LOCAL_SPEC = [
    Rename(r"self_attention\.linear_qkv\.layer_norm_", "input_layernorm."),
    Rename(r"mlp\.linear_fc1\.layer_norm_", "pre_mlp_layernorm."),
]


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_megatron_tp2_torch_dist_equals_megatrons_own_loader(suffix: str, tmp_path: Path) -> None:
    out = tmp_path / f"model{suffix}"
    ckptconv.convert(RUNS / "megatron_tp2", out, transforms=LOCAL_SPEC)
    ours = torch.load(out, weights_only=True) if suffix == ".pt" else load_file(out)
    assert_same_state(ours, golden("megatron_tp2", "golden_full.pt"), ordered=suffix == ".pt")


def test_megatron_inspect_names_the_stacked_layers() -> None:
    info = ckptconv.inspect(RUNS / "megatron_tp2")
    assert info.format == "megatron-torch-dist"
    assert info.metadata["layers"] == "decoder.layers: 2 (saved stacked, split per layer)"
    keys = [t.key for t in info.tensors]
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in keys
    assert not any(t.shares_with for t in info.tensors)  # each layer is a tensor of its own
    assert not any("_extra_state" in key for key in keys)
    # Row-parallel weights are split along their last dimension: each layer is assembled from its
    # own two pieces, so reading it pastes one layer together, never the whole stack.
    proj = ckptconv.open(RUNS / "megatron_tp2").tree["decoder.layers.1.self_attention.linear_proj.weight"]
    assert proj.storage.nbytes == 16 * 16 * 4
    assert [(offsets, piece.shape) for offsets, piece in proj.storage.source.chunks] == [
        ((0, 0), (16, 8)),
        ((0, 8), (16, 8)),
    ]


def test_megatron_layers_disagreeing_on_their_count_are_refused(tmp_path: Path) -> None:
    from ckptconv.reading.formats import megatron

    bad = {"decoder.layers.a.weight": torch.zeros(2, 3), "decoder.layers.b.weight": torch.zeros(3, 3)}
    folder = tmp_path / "ckpt"
    torch.distributed.checkpoint.save(bad, checkpoint_id=str(folder), **dcp_one_process())
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    assert megatron.is_torch_dist_folder(str(folder))
    _refused(folder, tmp_path, "'decoder.layers.b.weight' stacks 3 layers, other decoder.layers keys 2")


def test_a_megatron_layer_name_the_checkpoint_also_holds_is_refused(tmp_path: Path) -> None:
    """Splitting the stacked decoder.layers.w gives decoder.layers.0.w, which the checkpoint also holds
    on its own: one of the two was silently written in place of the other."""
    both = {"decoder.layers.w": torch.arange(6.0).reshape(2, 3), "decoder.layers.0.w": torch.full((3,), 9.0)}
    folder = tmp_path / "ckpt"
    torch.distributed.checkpoint.save(both, checkpoint_id=str(folder), **dcp_one_process())
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    _refused(
        folder,
        tmp_path,
        "layer 0 of the stacked 'decoder.layers.w' would be named 'decoder.layers.0.w', which the checkpoint "
        "also holds as a tensor of its own",
    )


def test_megatron_optimizer_state_beside_the_model_is_not_selected(tmp_path: Path) -> None:
    state = {
        "decoder.layers.mlp.weight": torch.arange(12.0).reshape(2, 2, 3),
        "optimizer.state.exp_avg.decoder.layers.mlp.weight": torch.ones(2, 2, 3),
        "output_layer.weight": torch.full((4, 3), 2.0),
    }
    folder = tmp_path / "iter_0000010"
    torch.distributed.checkpoint.save(state, checkpoint_id=str(folder), **dcp_one_process())
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    ours = ckptconv.load(folder)
    assert list(ours) == ["decoder.layers.0.mlp.weight", "decoder.layers.1.mlp.weight", "output_layer.weight"]
    assert_same_tensor(ours["decoder.layers.1.mlp.weight"], state["decoder.layers.mlp.weight"][1])
    assert_same_tensor(ours["output_layer.weight"], state["output_layer.weight"])


@contextlib.contextmanager
def _safe_globals(classes: list[Any]) -> Iterator[None]:
    """torch.serialization.safe_globals(classes); torch 2.4 has only add_safe_globals (and clear/get)."""
    if hasattr(torch.serialization, "safe_globals"):
        with torch.serialization.safe_globals(classes):
            yield
        return
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals(classes)
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def test_a_legacy_megatron_lm_rank_file_is_read_not_refused() -> None:
    """Megatron-LM saves its argparse namespace in every checkpoint, with ``exit_signal =
    signal.SIGTERM``: a real TP=2 rank file (``--ckpt-format torch``) is foreign, not unsafe, and
    its tensors, selected explicitly, are torch's. (Merging the ranks is not supported yet.)"""
    import argparse
    import enum
    import signal

    rank_file = RUNS / "megatron_legacy_tp2" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    report = ckptconv.scan(rank_file)
    assert report.verdict == "foreign", report.reason
    assert "signal.Signals" in report.reason

    class AttnBackend(enum.Enum):  # megatron.core.transformer.enums.AttnBackend, for torch's reader
        flash = 1
        fused = 2
        unfused = 3
        local = 4
        auto = 5

    AttnBackend.__module__, AttnBackend.__qualname__ = "megatron.core.transformer.enums", "AttnBackend"
    with _safe_globals([argparse.Namespace, signal.Signals, AttnBackend]):
        reference = torch.load(rank_file, weights_only=True, map_location="cpu")
    assert reference["args"].tensor_model_parallel_size == 2
    expected = {k: v for k, v in reference["model"].items() if torch.is_tensor(v)}  # not _extra_state
    assert_same_state(ckptconv.load(rank_file, select="model"), expected)


@pytest.mark.parametrize("rank", ["mp_rank_00", "mp_rank_01"])
def test_one_rank_of_a_tensor_parallel_megatron_run_is_not_taken_for_the_model(rank: str, tmp_path: Path) -> None:
    """Its weights are that rank's slices: converting them as the model's would write wrong weights."""
    rank_file = RUNS / "megatron_legacy_tp2" / "iter_0000003" / rank / "model_optim_rng.pt"
    output = tmp_path / "model.safetensors"
    code, _, stderr = run_cli("convert", str(rank_file), str(output))
    assert code == 1 and not output.exists()
    assert "Megatron-LM run split by tensor parallel 2" in stderr and "--select model" in stderr
    assert len(stderr.strip().splitlines()) == 1
    with pytest.raises(SelectionError, match="one rank's file"):
        ckptconv.load(rank_file)


def test_scan_looks_at_every_pickle_of_a_run_folder(tmp_path: Path) -> None:
    """Converting a verl folder reads only the model files; scanning it reads the others too."""
    run = _copy("fsdp2_dtensor", tmp_path / "runs")
    (run / "optim_world_size_2_rank_0.pt").write_bytes(b"\x80\x02cposix\nsystem\nX\x02\x00\x00\x00idq\x01\x85R.")
    summary = ckptconv.scan_many([tmp_path / "runs"])
    verdicts = {Path(report.path).name: report.verdict for report in summary.reports}
    # the run is one item, the worst of every file in it; the full model beside it is an item of its own
    assert verdicts == {"fsdp2_dtensor": "unsafe", "golden_full.pt": "safe"}
    run_report = next(report for report in summary.reports if report.path.endswith("fsdp2_dtensor"))
    assert run_report.reason.startswith("optim_world_size_2_rank_0.pt: names posix.system (runs processes)")
    files = {Path(report.path).name: report.verdict for report in run_report.files}
    assert files["optim_world_size_2_rank_0.pt"] == "unsafe"
    assert files["fsdp2_dtensor"] == "foreign"  # the model files, as converting reads them


def test_per_rank_copies_of_a_plain_state_dict_are_not_a_sharded_model(tmp_path: Path) -> None:
    """DDP saves the same state dict on every rank: those files stay separate items."""
    for rank in range(2):
        torch.save({"w": torch.ones(2)}, tmp_path / f"ddp_rank{rank}.pt")
    assert ckptconv.open(tmp_path / "ddp_rank0.pt").format == "torch-zip"
    from ckptconv.reading.discovery import discover

    assert [(item.name, item.kind) for item in discover(tmp_path)] == [
        ("ddp_rank0.pt", "file"),
        ("ddp_rank1.pt", "file"),
    ]
    with pytest.raises(ckptconv.UnsupportedFormatError, match=r"it holds ddp_rank0\.pt, ddp_rank1\.pt"):
        ckptconv.open(tmp_path)


# Named as DeepSpeed names it; pickled by reference, so ckptconv reads it as a stand-in.
class fragment_address:
    def __init__(self, numel: int, start: int) -> None:
        self.numel = numel
        self.start = start


def test_a_layout_that_disagrees_with_param_slice_mappings_is_refused(tmp_path: Path) -> None:
    params = write_zero2_run(tmp_path / "run", {"a": (3, 5), "b": (7,)}, world=2)
    assert list(ckptconv.load(tmp_path / "run")) == list(params)
    step = tmp_path / "run" / "global_step7"
    for rank, mapping in enumerate(
        [{"a": fragment_address(11, 0)}, {"a": fragment_address(4, 0), "b": fragment_address(7, 4)}]
    ):
        path = step / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        state = torch.load(path, weights_only=False)
        state["optimizer_state_dict"]["param_slice_mappings"] = [mapping]
        torch.save(state, path)
    _refused(tmp_path / "run", tmp_path, "group 0 holds its parameters at {'a': (11, 0)}")


def test_a_tag_folder_linked_from_outside_the_run_is_refused(tmp_path: Path) -> None:
    outside = _copy("ds_zero2_bf16", tmp_path / "elsewhere")
    run = tmp_path / "run"
    run.mkdir()
    (run / "global_step9").symlink_to(outside / "global_step3", target_is_directory=True)
    (run / "latest").write_text("global_step9")
    _refused(run, tmp_path, "its 'latest' names 'global_step9', a link that leads outside the run folder")


def test_a_parameter_described_in_two_groups_is_refused(tmp_path: Path) -> None:
    """fc1.bias renamed fc1.weight in rank 0's param_shapes (group 1): zero_to_fp32 merges the
    groups' names into one dict for stage 3, places fc1.weight once and then fails its check;
    ckptconv placed it twice and wrote group 1's 20 values under fc1.weight."""
    run = _copy("ds_zero3_bf16", tmp_path)
    _edit_pickle(
        run / "global_step3" / "zero_pp_rank_0_mp_rank_00_model_states.pt",
        b"X\x08\x00\x00\x00fc1.bias",
        b"X\x0a\x00\x00\x00fc1.weight",
    )
    _refused(run, tmp_path, "parameter 'fc1.weight' is described in parameter groups 0 and 1")


def test_a_frozen_parameter_saved_in_another_shape_is_refused(tmp_path: Path) -> None:
    """frozen_param_shapes says [16, 9] where the saved fragment is [12, 12]: zero_to_fp32 gives
    the fragment as saved, ckptconv reshaped it to [16, 9]."""
    run = _copy("ds_zero2_bf16", tmp_path)
    _edit_pickle(run / "global_step3" / "mp_rank_00_model_states.pt", b"h~K\x0cK\x0c\x86", b"h~K\x10K\x09\x86")
    _refused(run, tmp_path, "frozen parameter 'frozen.weight' is recorded as [16, 9] but saved as [12, 12]")
