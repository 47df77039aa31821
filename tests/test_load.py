"""Loading: every tensor ckptconv reads equals torch.load's, bit for bit, in every format."""

from __future__ import annotations

import os
import pickle
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

import ckptconv
from ckptconv.gpu.torch_tensors import to_torch
from ckptconv.values.standins import ForeignObject, NumpyArray

from .conftest import (
    all_dtypes_state,
    assert_same_state,
    assert_same_tensor,
    legacy_save,
    reference_load,
    run_cli,
    tiny_state_dict,
    torch_tensors,
    training_checkpoint,
    views_state,
)

BUILDERS: dict[str, Callable[[], Any]] = {
    "tiny": tiny_state_dict,
    "all_dtypes": all_dtypes_state,
    "views": views_state,
    "training": training_checkpoint,
}

SAVE_STYLES: dict[str, dict[str, Any]] = {
    "zip": {},
    "zip-protocol4": {"pickle_protocol": 4},
    "legacy": {"_use_new_zipfile_serialization": False},
    "legacy-protocol4": {"_use_new_zipfile_serialization": False, "pickle_protocol": 4},
    # Text opcodes (the magic number as `L...L\n`): was taken for a plain pickle and refused.
    "legacy-protocol1": {"_use_new_zipfile_serialization": False, "pickle_protocol": 1},
    "zip-protocol1": {"pickle_protocol": 1},
    "zip-protocol5": {"pickle_protocol": 5},
}


def assert_tree_matches_torch(path: Path) -> int:
    """Every tensor torch.load finds is in ckptconv's tree at the same path, bit for bit."""
    checkpoint = ckptconv.open(path)
    ours = dict(checkpoint.tensors())
    reference = reference_load(path)
    count = 0
    for where, tensor in torch_tensors(reference):
        assert where in ours, f"{where} missing from ckptconv's tree"
        assert_same_tensor(to_torch({where: ours[where]})[where], tensor, where)
        count += 1
    return count


@pytest.mark.parametrize("style", SAVE_STYLES)
@pytest.mark.parametrize("builder", BUILDERS)
def test_every_tensor_equals_torch_load(tmp_path: Path, builder: str, style: str) -> None:
    obj = BUILDERS[builder]()
    if style.startswith("legacy") and builder == "all_dtypes":
        # The legacy format cannot hold dtypes without a typed storage class.
        obj = {k: v for k, v in obj.items() if k not in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2")}
    path = tmp_path / "ckpt.pt"
    torch.save(obj, path, **SAVE_STYLES[style])
    assert assert_tree_matches_torch(path) > 0


@pytest.mark.parametrize(("zip_format", "what"), [(False, "legacy torch"), (True, "torch")])
def test_a_file_of_pickle_protocol_0_is_refused_as_torch_refuses_it(
    tmp_path: Path, zip_format: bool, what: str
) -> None:
    """Protocol 0 turns each storage reference into its text (torch.load: "saved_id must be a tuple"); a zip
    file of protocol 0 was called damaged ("data.pkl refers to ... instead of a storage")."""
    path = tmp_path / "p0.pt"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=zip_format, pickle_protocol=0)
    for load in (reference_load, lambda p: torch.load(p, weights_only=False)):
        with pytest.raises(Exception) as refused:
            load(path)
        # torch 2.4 checks it with a bare `assert isinstance(saved_id, tuple)`: an AssertionError without words.
        said_by_torch = str(refused.value)
        assert "saved_id must be a tuple" in said_by_torch or (refused.type is AssertionError and not said_by_torch)
    said = (
        f"{str(path)!r} is a {what} checkpoint saved with pickle protocol 0, whose storage references are text "
        "that neither torch.load nor ckptconv reads back; save it again with the default protocol"
    )
    with pytest.raises(ckptconv.UnsupportedFormatError) as caught:
        ckptconv.open(path)
    assert str(caught.value) == said
    assert run_cli("convert", str(path), str(tmp_path / "o.safetensors")) == (1, "", f"ckptconv: error: {said}\n")
    assert os.listdir(tmp_path) == ["p0.pt"]


@pytest.mark.parametrize("protocol", [0, 1])
def test_an_old_protocol_plain_pickle_says_what_it_holds_as_protocol_2_does(tmp_path: Path, protocol: int) -> None:
    """pickle.dumps of tensors (which torch.load reads in no mode: it is no torch.save file) at protocol 0 or 1
    was "not a checkpoint format ckptconv knows" once its content failed; protocol 2 said what was wrong."""
    state = {"w": torch.ones(2)}
    reasons = []
    for number in (protocol, 2):
        path = tmp_path / f"p{number}.pkl"
        path.write_bytes(pickle.dumps(state, protocol=number))
        with pytest.raises(Exception, match="Invalid magic number"):
            torch.load(path, weights_only=False)
        reasons.append(re.sub(r"at pickle byte \d+", "at pickle byte N", ckptconv.scan(path).reason))
    assert reasons[0] == reasons[1]
    assert "not a checkpoint format ckptconv knows" not in reasons[0]


@pytest.mark.parametrize("style", SAVE_STYLES)
def test_load_returns_the_weights_as_torch_tensors(tmp_path: Path, style: str) -> None:
    path = tmp_path / "train.pth"
    checkpoint = training_checkpoint()
    torch.save(checkpoint, path, **SAVE_STYLES[style])
    assert_same_state(ckptconv.load(path), checkpoint["state_dict"])


def test_shared_storage_stays_shared(save_torch: Callable[..., Path]) -> None:
    state = views_state()
    path = save_torch(state)
    loaded = ckptconv.load(path)
    assert_same_state(loaded, state)
    assert loaded["embed.weight"].untyped_storage().data_ptr() == loaded["lm_head.weight"].untyped_storage().data_ptr()
    assert loaded["column"].stride() == state["column"].stride()
    # A view of a big storage does not drag the whole storage along.
    small = ckptconv.load(save_torch({"rows": torch.randn(1000, 100)[3:5]}, "small.pt"))
    assert small["rows"].untyped_storage().nbytes() < 2 * 100 * 4 + 64


def test_numpy_arrays_and_scalars_are_read(save_torch: Callable[..., Path]) -> None:
    checkpoint = training_checkpoint()
    tree = ckptconv.open(save_torch(checkpoint)).tree
    array = tree["np_array"]
    assert isinstance(array, NumpyArray)
    np.testing.assert_array_equal(array.to_numpy(), checkpoint["np_array"])
    state = tree["numpy_rng"]
    assert state[0] == "MT19937"
    np.testing.assert_array_equal(state[1].to_numpy(), checkpoint["numpy_rng"][1])
    assert tree["np_scalar"] == checkpoint["np_scalar"]
    assert isinstance(tree["args"], ForeignObject)
    assert tree["args"].qualname == "argparse.Namespace"
    assert tree["args"].attributes() == {"lr": 1e-3, "arch": "tiny", "layers": [1, 2]}


@pytest.mark.parametrize("protocol", [0, 1, 2, 3, 4, 5])
def test_plain_pickle_of_numpy_arrays(tmp_path: Path, protocol: int) -> None:
    weights = {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": np.ones(3, dtype=np.int64),
        "f": np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)),
    }
    path = tmp_path / "weights.pkl"
    path.write_bytes(pickle.dumps(weights, protocol=protocol))
    loaded = ckptconv.load(path)
    for key, array in weights.items():
        assert_same_tensor(loaded[key], torch.from_numpy(np.ascontiguousarray(array)), key)


def test_whole_pickled_module_yields_its_state_dict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module_dir = tmp_path / "code"
    (module_dir / "gone_research").mkdir(parents=True)
    (module_dir / "gone_research" / "__init__.py").write_text("")
    (module_dir / "gone_research" / "nets.py").write_text(
        "import torch, torch.nn as nn\n"
        "class Block(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = nn.Linear(4, 4)\n"
        "        self.register_buffer('scratch', torch.zeros(2), persistent=False)\n"
        "        self.register_buffer('counter', torch.tensor(7))\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.blocks = nn.ModuleList([Block(), Block()])\n"
        "        self.head = nn.Linear(4, 2, bias=False)\n"
        "        self.config = {'depth': 2}\n"
    )
    monkeypatch.syspath_prepend(str(module_dir))
    import importlib

    nets = importlib.import_module("gone_research.nets")
    net = nets.Net()
    path = tmp_path / "whole.pt"
    torch.save(net, path)
    expected = net.state_dict()
    monkeypatch.delitem(__import__("sys").modules, "gone_research.nets")
    monkeypatch.delitem(__import__("sys").modules, "gone_research")
    monkeypatch.syspath_prepend(str(tmp_path / "nowhere"))

    checkpoint = ckptconv.open(path)
    assert "gone_research.nets.Net" in checkpoint.foreign_globals
    selection = checkpoint.select()
    assert selection.kind == "module"
    assert "blocks.0.scratch" not in selection.weights  # non-persistent buffer
    assert_same_state(to_torch(selection.weights), expected)


def test_ordered_dict_metadata_does_not_break_loading(save_torch: Callable[..., Path]) -> None:
    state = tiny_state_dict()
    assert isinstance(state, OrderedDict) and hasattr(state, "_metadata")
    tree = ckptconv.open(save_torch(state)).tree
    assert isinstance(tree, OrderedDict)
    assert tree._metadata == state._metadata  # type: ignore[attr-defined]


def test_big_endian_zip_checkpoint_is_byteswapped(tmp_path: Path) -> None:
    import io
    import zipfile

    state = {"f": torch.arange(6, dtype=torch.float32) / 3, "i": torch.arange(4, dtype=torch.int64) - 2}
    path = tmp_path / "le.pt"
    torch.save(state, path)
    big = tmp_path / "be.pt"
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(big, "w", zipfile.ZIP_STORED) as target:
        root = source.namelist()[0].split("/")[0]
        for info in source.infolist():
            data = source.read(info)
            if info.filename == f"{root}/byteorder":
                data = b"big"
            elif info.filename.startswith(f"{root}/data/"):
                key = info.filename.rsplit("/", 1)[1]
                itemsize = {"0": 4, "1": 8}[key]
                data = np.frombuffer(data, dtype=f"<u{itemsize}").byteswap().tobytes()
            target.writestr(info.filename, data)
    assert_same_state(ckptconv.load(big), state)
    del io


def test_device_tags_are_reported_and_ignored(tmp_path: Path) -> None:
    """A checkpoint saved from cuda:7 opens on a machine without GPUs."""
    import zipfile

    state = {"w": torch.randn(3)}
    path = tmp_path / "cpu.pt"
    torch.save(state, path)
    gpu = tmp_path / "cuda7.pt"
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(gpu, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            data = source.read(info)
            if info.filename.endswith("data.pkl"):
                data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:7")
            target.writestr(info.filename, data)
    checkpoint = ckptconv.open(gpu)
    assert checkpoint.saved_devices == frozenset({"cuda:7"})
    assert_same_state(ckptconv.load(gpu), state)


def test_zip_with_any_root_folder_name(tmp_path: Path) -> None:
    import zipfile

    state = tiny_state_dict()
    path = tmp_path / "orig.pt"
    torch.save(state, path)
    renamed = tmp_path / "renamed.pth.tar"
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(renamed, "w") as target:
        for info in source.infolist():
            target.writestr("some_other_root/" + info.filename.split("/", 1)[1], source.read(info))
    assert_same_state(ckptconv.load(renamed), state)


def test_compressed_zip_members_are_read(tmp_path: Path) -> None:
    import zipfile

    state = tiny_state_dict()
    path = tmp_path / "orig.pt"
    torch.save(state, path)
    deflated = tmp_path / "deflated.pt"
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info))
    assert_same_state(ckptconv.load(deflated), state)


def test_safetensors_input(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    state = {k: v for k, v in all_dtypes_state().items() if k not in ("c128", "complex32")}
    state = {k: v for k, v in state.items() if k not in ("uint16", "uint32", "uint64")}
    path = tmp_path / "x.safetensors"
    save_file(state, path)
    loaded = ckptconv.load(path)
    assert sorted(loaded) == sorted(state)
    for key in state:
        assert_same_tensor(loaded[key], state[key], key)


def test_trust_hands_the_file_to_torch_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--trust is the one way to get real objects: torch.load(weights_only=False) unpickles the file."""
    module_dir = tmp_path / "code"
    module_dir.mkdir()
    (module_dir / "trusted_nets.py").write_text(
        "import torch.nn as nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = nn.Linear(3, 2)\n"
    )
    monkeypatch.syspath_prepend(str(module_dir))
    import importlib

    net = importlib.import_module("trusted_nets").Net()
    path = tmp_path / "whole.pt"
    torch.save({"model": net, "epoch": 2}, path)
    checkpoint = ckptconv.open(path, trust=True)
    assert checkpoint.trusted and checkpoint.foreign_globals == {}
    assert checkpoint.tree["epoch"] == 2
    assert_same_state(ckptconv.load(path, trust=True), net.state_dict())
    # Without trust the same file opens too, through stand-ins, and gives the same weights.
    assert "trusted_nets.Net" in ckptconv.open(path).foreign_globals
    assert_same_state(ckptconv.load(path), net.state_dict())


def test_open_pauses_the_cyclic_collector_only_while_it_reads(tmp_path: Path) -> None:
    """The collector is off while a reader builds the tree (ckptconv.runtime.collector), and comes back as it was."""
    import gc

    from ckptconv.reading import detection as formats
    from ckptconv.reading.formats import torch_zip

    path = tmp_path / "x.pt"
    torch.save({"w": torch.arange(3.0)}, path)
    seen: list[bool] = []
    original = formats.READERS[torch_zip.FORMAT]
    formats.READERS[torch_zip.FORMAT] = lambda p: (seen.append(gc.isenabled()), original(p))[1]
    try:
        assert gc.isenabled()
        ckptconv.open(path)
        assert seen == [False] and gc.isenabled()
        (tmp_path / "bad.pt").write_bytes(path.read_bytes()[:-30])
        with pytest.raises(ckptconv.LoadError):
            ckptconv.open(tmp_path / "bad.pt")
        assert gc.isenabled()  # restarted after a failure too
        gc.disable()
        try:
            ckptconv.open(path)
            assert not gc.isenabled()  # a collector someone else turned off stays off
        finally:
            gc.enable()
    finally:
        formats.READERS[torch_zip.FORMAT] = original


def test_a_legacy_file_whose_sys_info_says_big_endian_is_read_little_endian_as_torch_reads_it(tmp_path: Path) -> None:
    """torch writes legacy storages and their element counts little-endian on every machine and reads them
    so, whatever sys_info's little_endian says; ckptconv byte-swapped them by sys_info (and so refused a
    file torch reads, "holds 432345564227567616 elements")."""
    state = {"f": torch.arange(6, dtype=torch.float32), "i": torch.arange(3, dtype=torch.int64) - 1}
    raw, ends = legacy_save(state)
    sys_info = pickle.loads(raw[ends[1] : ends[2]])
    assert sys_info["little_endian"] is True
    big = pickle.dumps({**sys_info, "little_endian": False}, protocol=2)
    path = tmp_path / "big.pt"
    path.write_bytes(raw[: ends[1]] + big + raw[ends[2] :])
    expected = torch.load(path, weights_only=True)
    loaded = ckptconv.load(path)
    for key, tensor in expected.items():
        assert_same_tensor(loaded[key], tensor, key)
        assert torch.equal(tensor, state[key])


def test_each_format_module_reads_the_format_it_is_listed_for() -> None:
    import importlib

    from ckptconv.reading import detection as formats

    for kind, name in formats._MODULES.items():
        assert kind == importlib.import_module(f"ckptconv.reading.formats.{name}").FORMAT


def test_a_safetensors_load_imports_neither_the_pickle_machinery_nor_the_training_run_formats(tmp_path: Path) -> None:
    """The readers are imported when a file needs them: a fresh process loading safetensors skips about a third
    of ckptconv's import time (bench/results/bench_gpu_load_h200.md, round 6)."""
    import subprocess
    import sys

    from safetensors.torch import save_file

    save_file({"w": torch.arange(4.0)}, tmp_path / "m.safetensors")
    code = (
        "import sys, ckptconv; state = ckptconv.load(sys.argv[1]); assert state['w'].tolist() == [0, 1, 2, 3]; "
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('ckptconv'))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "m.safetensors")], capture_output=True, text=True, check=True
    ).stdout.split()
    assert "ckptconv.reading.formats.safetensors" in loaded
    lazy = {"unpickler", "pickle_policy", "rebuild", "formats.torch_zip", "formats.dcp", "formats.deepspeed"}
    assert not {f"ckptconv.{name}" for name in lazy} & set(loaded), loaded
