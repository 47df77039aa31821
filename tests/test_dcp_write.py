"""``convert SRC DST/ --to dcp`` writes, without importing torch, what torch's own DCP loaders read back bit for
bit, with the ``.metadata`` torch's ``FileSystemWriter`` would write for the same state dict."""

from __future__ import annotations

import dataclasses
import math
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptconv

from .conftest import assert_same_tensor, dcp_one_process, run_cli, torch_saves

ROOT = Path(__file__).resolve().parent.parent

_DTYPES = [
    "float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz", "int8", "uint8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "bool",
    "complex64", "complex128",
]  # fmt: skip


def _state() -> dict[str, torch.Tensor]:
    """Every dtype ckptconv writes that this torch saves, and the layouts real files hold."""
    torch.manual_seed(5)
    state: dict[str, torch.Tensor] = {}
    for name in _DTYPES:
        if torch_saves(name):
            raw = torch.randint(0, 256, (3, 5), dtype=torch.uint8)
            dtype = getattr(torch, name)
            if dtype.is_floating_point and dtype.itemsize == 1:
                raw = raw & 0x77  # finite float8 values (no NaN patterns: equal bits are compared anyway)
            elif dtype == torch.bool:
                raw = raw & 1
            wide = torch.randint(0, 100, (3, 5)).to(dtype)
            state[f"dtypes.{name}"] = raw.view(dtype) if dtype.itemsize == 1 else wide
    big = torch.randn(64, 32)
    embedding = torch.randn(10, 4)
    state.update(
        {
            "scalar": torch.tensor(2.5),  # 0-dim
            "empty": torch.zeros(0, 3),
            "embed.weight": embedding,
            "lm_head.weight": embedding,  # one storage, two keys
            "rows": big[3:5],  # a view into a bigger storage
            "column": big[:, 7],  # non-contiguous
            "transposed": big[:8, :4].t(),
            "expanded": torch.randn(1, 3).expand(4, 3),  # stride 0
            "whole": big,
            "large": torch.randn(512, 640),  # 1.25 MiB: streamed to the file, not filled in memory
            "naïve.ключ": torch.arange(4),  # a key outside ASCII
        }
    )
    return state


def _dcp_load(folder: Path, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    targets = {key: torch.empty(value.shape, dtype=value.dtype) for key, value in state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(targets, checkpoint_id=str(folder), **dcp_one_process())
    return targets


def _torch_dcp_save(state: dict[str, torch.Tensor], folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {key: value.clone() for key, value in state.items()},
            storage_writer=dcp.FileSystemWriter(str(folder), thread_count=1),
            **dcp_one_process(),
        )


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], Path]:
    """``_state()`` saved by torch.save, then ``ckptconv convert model.pt out/ --to dcp`` as a user types it."""
    work = tmp_path_factory.mktemp("dcp_write")
    state = _state()
    torch.save(state, work / "model.pt")
    code, _, stderr = run_cli("convert", str(work / "model.pt"), str(work / "out"), "--to", "dcp", "-q")
    assert code == 0, stderr
    return state, work / "out"


def test_torch_dcp_load_reads_every_tensor_bit_for_bit(written: tuple[dict[str, torch.Tensor], Path]) -> None:
    state, out = written
    loaded = _dcp_load(out, state)
    for key, expected in state.items():
        assert_same_tensor(loaded[key], expected, key)


def test_dcp_to_torch_save_reads_every_tensor_bit_for_bit(
    written: tuple[dict[str, torch.Tensor], Path], tmp_path: Path
) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    state, out = written
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(out), str(tmp_path / "torch.pt"))
    loaded = torch.load(tmp_path / "torch.pt", weights_only=True)
    assert sorted(loaded) == sorted(state)
    for key, expected in state.items():
        assert_same_tensor(loaded[key], expected, key)
        assert loaded[key].stride() == torch.empty(expected.shape).stride(), key


def test_each_record_is_a_torch_save_of_the_tensor(written: tuple[dict[str, torch.Tensor], Path]) -> None:
    """torch's reader hands each record to torch.load(weights_only=True) as a slice of the data file."""
    import io

    state, out = written
    metadata = pickle.loads((out / ".metadata").read_bytes())
    data = (out / "__0_0.distcp").read_bytes()
    for index, info in metadata.storage_data.items():
        record = torch.load(io.BytesIO(data[info.offset : info.offset + info.length]), weights_only=True)
        assert_same_tensor(record, state[index.fqn], index.fqn)


def test_the_metadata_is_what_torchs_own_writer_writes(
    written: tuple[dict[str, torch.Tensor], Path], tmp_path: Path
) -> None:
    state, out = written
    _torch_dcp_save(state, tmp_path / "torch")
    ours = pickle.loads((out / ".metadata").read_bytes())
    theirs = pickle.loads((tmp_path / "torch" / ".metadata").read_bytes())
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.planner_data == theirs.planner_data
    assert set(ours.storage_data) == set(theirs.storage_data)
    assert {info.relative_path for info in ours.storage_data.values()} == {
        info.relative_path for info in theirs.storage_data.values()
    }
    if "version" in {f.name for f in dataclasses.fields(type(theirs))}:
        assert ours.version == theirs.version
    else:  # torch before 2.8 has no such field; its unpickler keeps ours as an extra attribute
        assert ours.version == "1.0.0"
    assert all(getattr(info, "transform_descriptors", None) is None for info in ours.storage_data.values())


def test_ckptconvs_reader_reads_it_back(written: tuple[dict[str, torch.Tensor], Path]) -> None:
    state, out = written
    loaded = ckptconv.load(out)
    for key, expected in state.items():
        assert_same_tensor(loaded[key], expected, key)


def test_many_tensors_metadata_matches_torchs(tmp_path: Path) -> None:
    """More than a pickle memo's 256 one-byte slots and than one SETITEMS batch of 1000 entries."""
    state = {f"layers.{i}.w": torch.full((2,), float(i)) for i in range(1100)}
    ckptconv.save(state, tmp_path / "model.safetensors")
    ckptconv.convert(tmp_path / "model.safetensors", tmp_path / "out", to="dcp")
    _torch_dcp_save(state, tmp_path / "torch")
    ours = pickle.loads((tmp_path / "out" / ".metadata").read_bytes())
    theirs = pickle.loads((tmp_path / "torch" / ".metadata").read_bytes())
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.planner_data == theirs.planner_data
    assert set(ours.storage_data) == set(theirs.storage_data)
    loaded = _dcp_load(tmp_path / "out", state)
    assert all(torch.equal(loaded[key], value) for key, value in state.items())


def test_a_cast_is_written_as_the_new_dtype(tmp_path: Path) -> None:
    state = {"w": torch.randn(16, 8), "b": torch.randn(8)}
    torch.save(state, tmp_path / "model.pt")
    source, out = str(tmp_path / "model.pt"), str(tmp_path / "out")
    code, _, stderr = run_cli("convert", source, out, "--to", "dcp", "--dtype", "bf16")
    assert code == 0, stderr
    expected = {key: value.to(torch.bfloat16) for key, value in state.items()}
    loaded = _dcp_load(tmp_path / "out", expected)
    for key, value in expected.items():
        assert_same_tensor(loaded[key], value, key)


def test_progress_counts_every_tensor_byte(tmp_path: Path) -> None:
    state = {"big": torch.randn(1024, 1024), "small": torch.randn(3)}  # 4 MiB: copied in 1 MiB pieces
    ckptconv.save(state, tmp_path / "model.safetensors")
    counts: list[int] = []
    ckptconv.convert(tmp_path / "model.safetensors", tmp_path / "out", to="dcp", progress=counts.append)
    assert sum(counts) == sum(value.nbytes for value in state.values())
    assert len(counts) > 2  # the big tensor reported as it is copied, not once at its end
    loaded = _dcp_load(tmp_path / "out", state)
    for key, value in state.items():
        assert_same_tensor(loaded[key], value, key)


# The CLI run as a user types it, in a fresh interpreter: torch must not be imported on the way.
_NO_TORCH = """
import sys
from ckptconv.cli import cli
try:
    cli(sys.argv[1:], prog_name="ckptconv")
except SystemExit as end:
    assert end.code == 0, end.code
assert "torch" not in sys.modules, sorted(name for name in sys.modules if name.startswith("torch"))[:5]
print("no torch")
"""


@pytest.mark.parametrize("options", [[], ["--dtype", "fp16"]], ids=["as-is", "cast"])
def test_convert_to_dcp_does_not_import_torch(tmp_path: Path, options: list[str]) -> None:
    from safetensors.torch import save_file

    state = {"w": torch.randn(64, 32), "t": torch.randn(32, 64).t().contiguous(), "i": torch.arange(5)}
    save_file(state, str(tmp_path / "model.safetensors"))
    argv = ["convert", str(tmp_path / "model.safetensors"), str(tmp_path / "out"), "--to", "dcp", "-q", *options]
    result = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, *argv], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "no torch"
    expected: dict[str, Any] = {k: v.half() if options else v for k, v in state.items()}
    expected["i"] = state["i"]  # --dtype casts floating-point tensors only
    loaded = _dcp_load(tmp_path / "out", expected)
    for key, value in expected.items():
        assert_same_tensor(loaded[key], value, key)


_VIEW_DTYPES = [torch.float32, torch.bfloat16, torch.float8_e5m2, torch.int16, torch.bool, torch.complex64]


@settings(max_examples=25, deadline=None)
@given(
    dtype=st.sampled_from(_VIEW_DTYPES),
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    steps=st.lists(st.integers(1, 3), min_size=3, max_size=3),
    start=st.integers(0, 2),
    transpose=st.booleans(),
    conj_neg=st.sampled_from(["", "conj", "neg"]),
)
def test_any_view_torch_holds_is_loaded_by_dcp_as_itself(
    dtype: torch.dtype, shape: list[int], steps: list[int], start: int, transpose: bool, conj_neg: str
) -> None:
    """Strided views (steps, an offset, transposes), conj and neg bits, saved by ``ckptconv.save(to="dcp")``
    from torch tensors in memory, read back by ``torch.distributed.checkpoint.load``."""
    import tempfile

    base = torch.randint(0, 256, (64 * 64 * 4,), dtype=torch.uint8)
    if dtype == torch.bool:
        base = base & 1
    flat = base.view(dtype) if dtype.itemsize == 1 else base.view(torch.int16).to(dtype)
    sizes = [s * step for s, step in zip(shape, steps)]
    needed = math.prod(sizes) if sizes else 1
    block = flat[start : start + needed].reshape(sizes) if needed else flat[:0].reshape(sizes)
    view = block[tuple(slice(None, None, step) for step in steps[: len(sizes)])]
    if transpose and view.dim() >= 2:
        view = view.transpose(0, -1)
    if conj_neg == "conj" and view.is_complex():
        view = view.conj()
    elif conj_neg == "neg" and view.is_complex():
        view = view.conj().imag  # a view with the negative bit set
    state = {"view": view, "base": flat[:16]}
    with tempfile.TemporaryDirectory() as work:
        ckptconv.save(state, Path(work) / "out", to="dcp")
        loaded = _dcp_load(Path(work) / "out", state)
    for key, value in state.items():
        expected = torch.empty(value.shape, dtype=value.dtype).copy_(value)  # the values, conj/neg applied
        assert_same_tensor(loaded[key], expected, key)
