"""Shared helpers: tiny real checkpoints and bit-exact comparisons."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def torch_saves(dtype: torch.dtype | str) -> bool:
    """Whether this torch has ``dtype`` (a name: ``"uint16"``), ``torch.save`` writes it and
    ``torch.load(weights_only=True)`` reads it back: torch 2.4 has uint16/uint32/uint64 tensors but no
    storage type to save them, and its weights_only unpickler does not allow ``torch.uint16``."""
    import io

    if isinstance(dtype, str):
        found = getattr(torch, dtype, None)
        if not isinstance(found, torch.dtype):
            return False
        dtype = found
    buffer = io.BytesIO()
    try:
        torch.save(torch.zeros(16, dtype=torch.uint8).view(dtype), buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:  # KeyError "dtype torch.uint16 is not recognized", then pickle.UnpicklingError
        return False
    return True


def dcp_one_process() -> dict[str, Any]:
    """Keyword arguments for ``torch.distributed.checkpoint.save``/``load`` in one process without a process
    group: ``no_dist=True`` where they take it; torch 2.4's infer it (and warn) instead."""
    import inspect

    import torch.distributed.checkpoint as dcp

    return {"no_dist": True} if "no_dist" in inspect.signature(dcp.save).parameters else {}


# A DTensor pickle names torch.distributed.tensor.DTensor, the public place of the class since torch 2.5
# (torch 2.4 keeps it in torch.distributed._tensor): only such a torch.load reads the FSDP2 fixtures.
HAS_PUBLIC_DTENSOR = hasattr(importlib.import_module("torch.distributed.tensor"), "DTensor")


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's elements as bytes, in logical order: equal bytes mean equal bits (NaNs included)."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same_tensor(ours: torch.Tensor, theirs: torch.Tensor, where: str = "") -> None:
    assert isinstance(ours, torch.Tensor), where
    assert ours.dtype == theirs.dtype, f"{where}: dtype {ours.dtype} != {theirs.dtype}"
    assert tuple(ours.shape) == tuple(theirs.shape), f"{where}: shape {ours.shape} != {theirs.shape}"
    assert ours.device.type == "cpu", where
    assert raw_bytes(ours) == raw_bytes(theirs), f"{where}: values differ"


def assert_same_state(ours: Mapping[str, torch.Tensor], theirs: Mapping[str, Any], *, ordered: bool = True) -> None:
    if ordered:
        assert list(ours) == list(theirs)
    else:
        assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert_same_tensor(ours[key], theirs[key], key)


def torch_tensors(value: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in an object tree from torch.load, with the dotted path ckptconv uses."""
    if type(value).__name__ == "DTensor":
        # A DTensor's data is its local shard; ckptconv keeps it as the stand-in's `_local_tensor`.
        yield f"{path}._local_tensor", value._local_tensor
    elif isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, nn.Module):
        for key, item in value.__dict__.items():
            yield from torch_tensors(item, f"{path}.{key}" if path else key)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from torch_tensors(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from torch_tensors(item, f"{path}.{index}" if path else str(index))
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        for key, item in vars(value).items():
            yield from torch_tensors(item, f"{path}.{key}" if path else key)


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.conv(x)).mean((2, 3)))


def tiny_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = TinyCNN()
    model(torch.randn(2, 3, 8, 8))  # updates BatchNorm running stats and num_batches_tracked
    return model.state_dict()


def all_dtypes_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    base = torch.randn(3, 4)
    state: dict[str, torch.Tensor] = {
        "f32": base,
        "f64": base.double(),
        "f16": base.half(),
        "bf16": base.bfloat16(),
        "i64": torch.arange(6),
        "i32": torch.arange(6, dtype=torch.int32),
        "i16": torch.arange(6, dtype=torch.int16),
        "i8": torch.arange(-3, 3, dtype=torch.int8),
        "u8": torch.arange(6, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "c64": torch.randn(2, dtype=torch.complex64),
        "c128": torch.randn(2, dtype=torch.complex128),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "nan_inf": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]),
    }
    for name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"):
        dtype = getattr(torch, name, None)
        if dtype is not None and torch_saves(dtype):
            state[name] = torch.tensor([1, 2, 3]).to(dtype)
    return state


def views_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(2)
    big = torch.randn(64, 32)
    embedding = torch.randn(10, 4)
    return {
        "embed.weight": embedding,
        "lm_head.weight": embedding,  # tied
        "rows": big[3:5],  # a small view of a bigger storage
        "column": big[:, 7],  # non-contiguous
        "transposed": big[:8, :4].t(),
        "expanded": torch.randn(1, 3).expand(4, 3),  # stride 0
        "whole": big,
    }


def training_checkpoint() -> dict[str, Any]:
    torch.manual_seed(3)
    model = TinyCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    optimizer.step()
    return {
        "epoch": 3,
        "state_dict": model.state_dict(),
        "state_dict_ema": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "args": argparse.Namespace(lr=1e-3, arch="tiny", layers=[1, 2]),
        "numpy_rng": np.random.RandomState(0).get_state(),
        "np_array": np.arange(5, dtype=np.float32),
        "np_scalar": np.float64(0.25),
        "torch_rng": torch.get_rng_state(),
    }


def legacy_save(state: Any) -> tuple[bytes, list[int]]:
    """``torch.save(state)`` in the legacy format, and the offsets where its first three pickles (magic
    number, protocol version, sys_info) end, for tests that replace one of them."""
    import io
    import pickletools

    buffer = io.BytesIO()
    torch.save(state, buffer, _use_new_zipfile_serialization=False)
    raw = buffer.getvalue()
    ends: list[int] = []
    start = 0
    for _ in range(3):
        end = next(p for op, _, p in pickletools.genops(io.BytesIO(raw[start:])) if op.name == "STOP")
        start += end + 1
        ends.append(start)
    return raw, ends


@pytest.fixture
def save_torch(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Save an object with torch.save into tmp_path and return the path."""

    def save(obj: Any, name: str = "ckpt.pt", **kwargs: Any) -> Path:
        path = tmp_path / name
        torch.save(obj, path, **kwargs)
        return path

    return save


def gpu_fixture_files() -> list[Path]:
    folder = FIXTURES / "gpu"
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix not in (".json", ".md", ".txt", ".py"))


def reference_load(path: os.PathLike[str] | str) -> Any:
    """torch.load as people use it on trusted files, or the safetensors library for a safetensors file
    (torch.load reads those only from torch 2.13): the reference ckptconv must equal."""
    if os.fspath(path).endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=False)


def refusal_in_child(code: str, *args: str) -> str:
    """The ckptconv error ``code`` raises, run in a child Python that imports this checkout (with
    ``args`` as ``sys.argv[1:]``), for failures that would kill the test process (SIGBUS from a file
    cut short under a memory map). The child must exit normally; "" if nothing was raised."""
    script = (
        "import sys\nfrom ckptconv.errors import CkptconvError\ntry:\n"
        + "".join(f"    {line}\n" for line in code.splitlines())
        + "except CkptconvError as error:\n    print(error)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
        check=False,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-500:])
    return done.stdout


def run_cli(*args: str) -> tuple[int, str, str]:
    """Run ``ckptconv ARGS`` in-process: exit code, stdout, stderr (kept apart)."""
    from click.testing import CliRunner

    from ckptconv.cli import cli

    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def swap_after_discovery(monkeypatch: pytest.MonkeyPatch, module: Any, swap: Callable[[], None]) -> None:
    """Make ``module.discover`` run ``swap`` right after it found the items: the window between discovery
    and the reads, where an item can be replaced by a link."""
    found = module.discover

    def discover_then_swap(*args: Any, **kwargs: Any) -> Any:
        items = found(*args, **kwargs)
        swap()
        return items

    monkeypatch.setattr(module, "discover", discover_then_swap)


def transformers_fp8_dequantization() -> Any:
    """transformers' own fp8 block dequantization (``_dequantize_fp8_weight``), the oracle of the ragged-block
    tests; skipped where the installed transformers lacks it (the last release for Python 3.10 does)."""
    module = pytest.importorskip("transformers.integrations.finegrained_fp8")
    function = getattr(module, "_dequantize_fp8_weight", None)
    if function is None:
        pytest.skip("this transformers has no _dequantize_fp8_weight, the oracle (transformers 5.25 has it)")
    return function


def tiny_llama(*, tied: bool = False) -> Any:
    """A two-layer transformers Llama (hidden 32, 4 heads, 2 key/value heads, vocabulary 96), random weights."""
    transformers = pytest.importorskip("transformers")
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
    return transformers.LlamaForCausalLM(config)


def tiny_gpt2() -> Any:
    """A two-layer transformers GPT-2 (hidden 32, 2 heads, vocabulary 96; its class ties the head), random weights."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)
