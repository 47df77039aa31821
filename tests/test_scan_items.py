"""ckptconv scan answers for what it was pointed at: folders and archives are the worst of every file in them,
legacy tar checkpoints have every member read, and "safe" means torch.load(weights_only=True) loads the file."""

from __future__ import annotations

import argparse
import collections
import gzip
import io
import json
import os
import pickle
import random
import struct
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import ckptconv
from ckptconv.checking import archives
from ckptconv.cli import cli
from ckptconv.reading.unpickling import rebuild, torch_parity
from tests.scan_corpus import build_corpus, call

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")


class _Evil:
    """Pickles as a call of os.system (posix.system); never loaded here."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned",))


def _trainer_folder(folder: Path, *, malicious: bool) -> None:
    """What transformers' Trainer writes at a save step: sharded weights and the training state beside them."""
    folder.mkdir(parents=True)
    save_file({"a": torch.randn(3, 4)}, folder / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file({"b": torch.randn(5)}, folder / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text("{}")
    (folder / "trainer_state.json").write_text('{"global_step": 500}')
    optimizer: dict[str, Any] = {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": [{"lr": 0.1}]}
    if malicious:
        optimizer["hook"] = _Evil()
    torch.save(optimizer, folder / "optimizer.pt")
    torch.save({"last_epoch": 500, "_step_count": 501}, folder / "scheduler.pt")
    torch.save(
        {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()},
        folder / "rng_state.pth",
    )
    torch.save(argparse.Namespace(lr=0.1), folder / "training_args.bin")


def _torch_verdict(path: str) -> bool:
    try:
        torch.load(path, weights_only=True, map_location="cpu")
    except Exception:  # what torch refuses, for whatever reason
        return False
    return True


def test_a_trainer_folder_is_the_worst_of_every_file_in_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`scan run/checkpoint-500` said "1 item: 1 safe" with a malicious optimizer.pt beside the weights."""
    _trainer_folder(tmp_path / "run" / "checkpoint-500", malicious=True)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["scan", "run/checkpoint-500"])
    assert result.exit_code == 4, result.output
    assert result.stdout.startswith(
        "unsafe            run/checkpoint-500: optimizer.pt: names posix.system (runs processes)"
    )
    assert result.stdout.endswith("(the worst of 5 files: 2 safe, 1 torch-refuses, 1 foreign, 1 unsafe)\n")
    assert result.stderr == "1 item: 1 unsafe\n"
    report = ckptconv.scan("run/checkpoint-500")
    by_file = {os.path.basename(item.path): item.verdict for item in report.files}
    assert by_file == {
        "optimizer.pt": "unsafe",
        "training_args.bin": "foreign",
        "rng_state.pth": "torch-refuses",
        "scheduler.pt": "safe",
        "checkpoint-500": "safe",  # the sharded weights
    }
    # Each benign file's verdict is torch's own answer.
    for item in report.files:
        if item.verdict != "unsafe":
            assert (item.verdict == "safe") == _torch_verdict(item.path) or os.path.isdir(item.path), item
    # The run's parent: the sharded checkpoint and each state file are items, the malicious one among them.
    parent = CliRunner().invoke(cli, ["scan", "run", "-q"])
    assert parent.exit_code == 4
    assert "unsafe            run/checkpoint-500/optimizer.pt: names posix.system" in parent.stdout


def test_a_clean_trainer_folder_is_as_good_as_its_worst_file(tmp_path: Path) -> None:
    _trainer_folder(tmp_path / "ckpt", malicious=False)
    report = ckptconv.scan(tmp_path / "ckpt")
    assert report.verdict == "foreign"  # training_args.bin: a TrainingArguments (here a Namespace)
    assert report.reason.startswith("training_args.bin: names code that is not here (argparse.Namespace)")
    assert report.foreign == {"argparse.Namespace": 1}
    # the weights themselves are still what safetensors reads
    assert set(load_file(tmp_path / "ckpt" / "model-00001-of-00002.safetensors")) == {"a"}


# ---------------------------------------------------------------------------------------
# Archives
# ---------------------------------------------------------------------------------------


def _model_folder(folder: Path) -> None:
    folder.mkdir(parents=True)
    torch.save({"w": torch.ones(2), "x": _Evil()}, folder / "pytorch_model.bin")
    (folder / "config.json").write_text("{}")


def _archive(kind: str, source: Path, out: Path) -> Path:
    if kind == "zip":
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
            for file in sorted(source.rglob("*")):
                archive.write(file, file.relative_to(source.parent))
    elif kind in ("tar", "tar.gz", "tgz", "tar.bz2", "tar.xz"):
        mode = {"tar": "w", "tar.gz": "w:gz", "tgz": "w:gz", "tar.bz2": "w:bz2", "tar.xz": "w:xz"}[kind]
        with tarfile.open(out, mode) as archive:
            archive.add(source, source.name)
    return out


@pytest.mark.parametrize("kind", ["zip", "tar", "tar.gz", "tgz", "tar.bz2", "tar.xz"])
def test_an_archive_of_a_model_folder_is_opened_and_every_member_scanned(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`scan downloads/` holding only a .zip of a model folder with a malicious pytorch_model.bin said
    "0 items: nothing scanned", exit 0."""
    _model_folder(tmp_path / "model")
    (tmp_path / "downloads").mkdir()
    _archive(kind, tmp_path / "model", tmp_path / "downloads" / f"model.{kind}")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["scan", "downloads"])
    assert result.exit_code == 4, result.output
    assert result.stdout == (
        f"unsafe            downloads/model.{kind}: model/pytorch_model.bin: names posix.system (runs processes) "
        "at pickle byte 169 (the worst of 1 file: 1 unsafe)\n"
    )
    assert result.stderr == "1 item: 1 unsafe\n"
    (finding,) = ckptconv.scan(f"downloads/model.{kind}").unsafe
    assert finding.where.startswith(f"downloads/model.{kind}:model/pytorch_model.bin")


def test_archives_inside_archives_and_compressed_files_are_opened(tmp_path: Path) -> None:
    _model_folder(tmp_path / "model")
    inner = _archive("zip", tmp_path / "model", tmp_path / "inner.zip")
    with tarfile.open(tmp_path / "outer.tar.gz", "w:gz") as outer:
        outer.add(inner, "inner.zip")
    report = ckptconv.scan(tmp_path / "outer.tar.gz")
    assert report.verdict == "unsafe"
    assert report.reason.startswith("inner.zip: model/pytorch_model.bin: names posix.system")
    (tmp_path / "model.pt.gz").write_bytes(gzip.compress((tmp_path / "model" / "pytorch_model.bin").read_bytes()))
    assert ckptconv.scan(tmp_path / "model.pt.gz").verdict == "unsafe"


def test_an_archive_of_safe_files_is_safe_and_one_of_text_is_no_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    torch.save({"w": torch.ones(2)}, tmp_path / "m" / "pytorch_model.bin")
    (tmp_path / "m" / "config.json").write_text("{}")
    report = ckptconv.scan(_archive("tar.gz", tmp_path / "m", tmp_path / "m.tar.gz"))
    assert (report.verdict, report.format) == ("safe", "gzip archive")
    with zipfile.ZipFile(tmp_path / "docs.zip", "w") as archive:
        archive.writestr("README.md", "# hello")
    result = CliRunner().invoke(cli, ["scan", str(tmp_path / "docs.zip")])
    assert result.exit_code == 3
    assert "a zip archive of 1 members, none that torch.load, pickle, numpy or an unpacker would open" in result.stdout


def _zip_of(members: dict[str, bytes], path: Path) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def test_archive_bounds_are_not_scanned_and_exit_non_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = pickle.dumps({"a": 1}, protocol=2)
    # a compression bomb: a megabyte of zeros in a zip of a few kilobytes, with the slack taken away
    monkeypatch.setattr(archives, "_SLACK", 0)
    bomb = _zip_of({"zeros.pkl": b"\x80\x02" + bytes(1 << 20)}, tmp_path / "bomb.zip")
    result = CliRunner().invoke(cli, ["scan", str(bomb)])
    assert result.exit_code == 3
    assert f"it unpacks to more than {archives.MAX_RATIO} times its size (at 'zeros.pkl')" in result.stdout
    assert result.stdout.startswith("not-scanned")
    monkeypatch.undo()
    monkeypatch.setattr(archives, "MAX_MEMBERS", 3)
    many = _zip_of({f"m{i}.pkl": payload for i in range(4)}, tmp_path / "many.zip")
    assert ckptconv.scan(many).verdict == "not-scanned"
    monkeypatch.undo()
    nested = _zip_of({"x.pkl": call("posix", "system", "id", protocol=2)}, tmp_path / "n0.zip")
    for depth in range(1, archives.MAX_DEPTH + 2):  # the payload one level deeper than scan opens
        nested = _zip_of({f"n{depth - 1}.zip": nested.read_bytes()}, tmp_path / f"n{depth}.zip")
    report = ckptconv.scan(nested)
    assert report.verdict == "not-scanned"
    assert "deeper than scan opens" in report.reason
    (tmp_path / "x.7z").write_bytes(b"7z\xbc\xaf\x27\x1c" + bytes(64))
    assert ckptconv.scan(tmp_path / "x.7z").verdict == "not-scanned"


@pytest.mark.parametrize(
    ("name", "link"),
    [("../outside.pt", None), ("/etc/cron.d/x", None), ("a/../../up.bin", None), ("link", "../../etc"), ("l2", "/tmp")],
)
def test_archive_names_and_links_that_leave_the_folder_are_unsafe(tmp_path: Path, name: str, link: str | None) -> None:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo(name)
        if link is None:
            data = pickle.dumps([1, 2], protocol=2)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        else:
            info.type, info.linkname = tarfile.SYMTYPE, link
            tar.addfile(info)
    (tmp_path / "a.tar").write_bytes(out.getvalue())
    report = ckptconv.scan(tmp_path / "a.tar")
    assert report.verdict == "unsafe", report.reason
    assert "outside the folder it is unpacked in" in report.reason
    assert not (tmp_path / "outside.pt").exists() and not (tmp_path.parent / "outside.pt").exists()


def test_a_zip_member_with_a_bad_crc_is_damaged(tmp_path: Path) -> None:
    path = tmp_path / "z.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("m.pkl", pickle.dumps(list(range(100)), protocol=2))
    data = bytearray(path.read_bytes())
    data[30 + len("m.pkl") + 20] ^= 0x01  # a byte of the stored pickle's data
    path.write_bytes(bytes(data))
    with zipfile.ZipFile(path) as archive, pytest.raises(zipfile.BadZipFile, match="Bad CRC-32"):
        archive.read("m.pkl")
    report = ckptconv.scan(path)
    assert (report.verdict, report.reason) == (
        "damaged",
        "m.pkl: cannot be unpacked (Bad CRC-32 for file 'm.pkl') (the worst of 1 file: 1 damaged)",
    )


# ---------------------------------------------------------------------------------------
# Legacy (pre-0.4) tar checkpoints
# ---------------------------------------------------------------------------------------


def legacy_tar(
    values: dict[str, torch.Tensor], *, storages: bytes = b"", tensors: bytes = b"", main: bytes = b""
) -> bytes:
    """What torch < 0.4 wrote, built the way its ``_save`` did: a tar of ``sys_info``, ``pickle`` (the object,
    tensors as persistent ids), ``tensors`` (a count, then per tensor its pickle and sizes) and ``storages`` (a
    count, then per storage its pickle and bytes, then the views). ``storages``/``tensors``/``main`` replace
    the first pickle of a member (the count) or the whole ``pickle`` member."""
    storage_data, tensor_data = io.BytesIO(), io.BytesIO()
    storage_data.write(storages or pickle.dumps(len(values), protocol=2))
    for number, value in enumerate(values.values()):
        storage_data.write(pickle.dumps((number, "cpu", torch.FloatStorage), protocol=2))
        storage_data.write(struct.pack("<q", value.numel()) + value.contiguous().numpy().tobytes())
    storage_data.write(pickle.dumps([], protocol=2))
    tensor_data.write(tensors or pickle.dumps(len(values), protocol=2))
    for number, value in enumerate(values.values()):
        tensor_data.write(pickle.dumps((100 + number, number, torch.FloatTensor), protocol=2))
        tensor_data.write(struct.pack("<i", value.dim()) + bytes(4))
        tensor_data.write(struct.pack(f"<{2 * value.dim()}q", *value.shape, *value.stride()) + struct.pack("<q", 0))
    names = list(values)

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> str | None:
            return str(100 + names.index(obj[1])) if isinstance(obj, tuple) and obj[:1] == ("ref",) else None

    body = io.BytesIO()
    Pickler(body, protocol=2).dump({name: ("ref", name) for name in values})
    members = {
        "sys_info": pickle.dumps({"protocol_version": 1000, "little_endian": True, "type_sizes": {}}, protocol=2),
        "pickle": main or body.getvalue(),
        "tensors": tensor_data.getvalue(),
        "storages": storage_data.getvalue(),
    }
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_a_benign_legacy_tar_is_what_torch_reads_and_refuses_with_weights_only(tmp_path: Path) -> None:
    want = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4)}
    path = tmp_path / "old.pt"
    path.write_bytes(legacy_tar(want))
    got = torch.load(path, weights_only=False)  # benign, built here: the layout is torch's
    assert all(torch.equal(got[key], want[key]) for key in want)
    assert not _torch_verdict(str(path))
    report = ckptconv.scan(path)
    assert report.verdict == "torch-refuses"
    assert "torch's pre-0.4 tar checkpoint" in report.reason
    assert {os.path.basename(item.path.rpartition(":")[2]) for item in report.files} == {
        "sys_info",
        "pickle",
        "tensors",
        "storages",
    }


@pytest.mark.parametrize("member", ["storages", "tensors", "pickle"])
def test_a_legacy_tar_whose_member_calls_posix_system_is_unsafe(tmp_path: Path, member: str) -> None:
    """A pre-0.4 tar .pt whose ``storages`` member calls posix.system was "not-a-checkpoint"."""
    payload = call("posix", "system", "echo pwned", protocol=2)
    values = {"w": torch.ones(3)}
    path = tmp_path / "old.pt"
    path.write_bytes(legacy_tar(values, **{"main" if member == "pickle" else member: payload}))
    result = CliRunner().invoke(cli, ["scan", str(path)])
    assert result.exit_code == 4, result.output
    assert result.stdout.startswith(
        f"unsafe            {path}: {member}: names posix.system (runs processes) at pickle byte"
    )
    (finding,) = ckptconv.scan(path).unsafe
    assert finding.where == f"{path}:{member}"


def test_a_later_pickle_of_a_legacy_storages_member_is_read_too(tmp_path: Path) -> None:
    """Not only a member's first pickle: the per-storage pickles after the bytes of the one before."""
    data = bytearray(legacy_tar({"w": torch.ones(3), "v": torch.zeros(2)}))
    good = pickle.dumps((1, "cpu", torch.FloatStorage), protocol=2)
    evil = call("posix", "system", "x", protocol=2)
    at = data.find(good)
    assert at > 0 and len(evil) <= len(good) + 64
    out = io.BytesIO()
    with (
        tarfile.open(fileobj=io.BytesIO(bytes(data))) as tar,
        tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as new,
    ):
        for info in tar.getmembers():
            body = tar.extractfile(info).read()  # type: ignore[union-attr]
            if info.name == "storages":
                body = body.replace(good, evil)
            info.size = len(body)
            new.addfile(info, io.BytesIO(body))
    (tmp_path / "old.pt").write_bytes(out.getvalue())
    report = ckptconv.scan(tmp_path / "old.pt")
    assert report.verdict == "unsafe", report.reason
    assert report.unsafe[0].where.endswith(":storages")


# ---------------------------------------------------------------------------------------
# "safe" is torch.load(weights_only=True)'s answer, and the records' CRC-32s match
# ---------------------------------------------------------------------------------------


def test_a_record_with_a_damaged_crc_is_damaged_as_convert_says(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torch.save({"a": torch.arange(100, dtype=torch.float32)}, path)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        info = next(info for info in archive.infolist() if info.filename.endswith("data/0"))
    name_length, extra_length = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    data[info.header_offset + 30 + name_length + extra_length + 4] ^= 0xFF
    path.write_bytes(bytes(data))
    assert _torch_verdict(str(path))  # torch does not check it: the flipped bit loads silently
    report = ckptconv.scan(path)
    assert report.verdict == "damaged"
    assert "has CRC-32" in report.reason
    with pytest.raises(ckptconv.LoadError, match="CRC-32"):
        ckptconv.convert(path, tmp_path / "out.safetensors")


def _cases(folder: Path) -> list[Path]:
    """Files of every class scan sorts, written by torch.save (which torch.load reads back)."""
    cases: dict[str, Any] = {
        "plain": {"w": torch.randn(2, 3), "n": 3, "s": "x", "l": [1.5, None]},
        "numpy_array": {"a": np.arange(3)},
        "numpy_scalar": {"a": np.float32(1.5)},
        "defaultdict": collections.defaultdict(list, {"a": [torch.ones(1)]}),
        "frozenset": {"a": frozenset([1, 2])},
        "slice": {"a": slice(1, 2)},
        "ordered": collections.OrderedDict(a=torch.ones(2)),
        "set_bytes_complex": {"a": {1, 2}, "b": b"xy", "c": 1 + 2j, "d": bytearray(b"z")},
        "namespace": {"args": argparse.Namespace(lr=1)},
        "module": torch.nn.Linear(2, 2),
        "parameter": {"p": torch.nn.Parameter(torch.ones(2))},
        "views": {"a": torch.arange(10.0)[2:5], "b": torch.arange(10.0).view(2, 5).t()},
    }
    written = []
    for name, value in cases.items():
        for protocol in (2, 4):
            path = folder / f"{name}_p{protocol}.pt"
            torch.save(value, path, pickle_protocol=protocol)
            written.append(path)
        legacy = folder / f"{name}_legacy.pt"
        torch.save(value, legacy, _use_new_zipfile_serialization=False)
        written.append(legacy)
    return written


def test_safe_is_exactly_what_torch_load_weights_only_loads(tmp_path: Path) -> None:
    files = _cases(tmp_path)
    for folder, _subfolders, names in os.walk(FIXTURES):
        files += [Path(folder, name) for name in names if name.endswith((".pt", ".pth", ".bin", ".ckpt"))]
    disagree, dtensors = [], []
    verdicts: collections.Counter[str] = collections.Counter()
    for path in files:
        report = ckptconv.scan(path)
        verdicts[report.verdict] += 1
        if report.format == "pickle":
            continue  # torch.load does not open plain pickles: see the next test
        if (report.verdict == "safe") != _torch_verdict(str(path)):
            foreign = list(report.foreign)
            if (
                report.verdict == "foreign"
                and all(name.startswith("torch.") for name in foreign)
                and any(name.startswith("torch.distributed.") for name in foreign)
            ):
                # DTensors: torch allows their classes once torch.distributed.tensor is imported (this process
                # has), a fresh process refuses them; their loading runs torch.distributed's code: foreign.
                dtensors.append(path.name)
                continue
            disagree.append((path.name, report.verdict, report.reason[:150]))
    assert not disagree
    assert all("rank" in name or "dtensor" in name for name in dtensors), dtensors
    assert verdicts["safe"] and verdicts["torch-refuses"] and verdicts["foreign"], verdicts


class _Stub:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


def test_a_plain_pickle_is_safe_when_it_names_only_data(tmp_path: Path) -> None:
    """torch.load does not open plain pickles (no magic number): pickle.load does, and runs what they name.
    "safe" is a pickle that names only what torch's weights-only allowlist holds, and numpy's data."""
    from torch._weights_only_unpickler import _get_allowed_globals

    allowed = set(_get_allowed_globals()) | {name for name in rebuild._SAFE_CALLABLES if name.startswith("numpy")}

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            named.add(f"{module}.{name}")
            return _Stub  # nothing imported, nothing run

        def persistent_load(self, pid: Any) -> Any:
            return None

    for sample, path in build_corpus(tmp_path):
        if sample.label != "benign":
            continue
        report = ckptconv.scan(path)
        if report.format != "pickle":
            continue
        named: set[str] = set()
        with open(path, "rb") as file:
            Recording(file).load()
        only_data = all(pickle_name in allowed for pickle_name in named)
        assert (report.verdict == "safe") == only_data, (sample.name, report.verdict, named)


def test_the_refusal_tables_are_torchs_own() -> None:
    """torch_parity's tables against torch's weights-only unpickler itself."""
    import inspect
    import pickletools
    import re

    from torch import _weights_only_unpickler as weights_only

    allowed = weights_only._get_allowed_globals()
    candidates = list(rebuild._SAFE_CALLABLES)
    for module in ("torch", "torch.cuda", "torch.storage", "torch.cuda.storage"):
        candidates += [f"{module}.{name}" for name in dir(torch) if name.endswith("Storage")]
        candidates += [f"{module}.{name}" for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)]
    known = [name for name in candidates if rebuild.known_global(*name.rsplit(".", 1)) is not None]
    assert len(known) > 60
    assert [name for name in known if torch_parity.refused_global(name) != (name not in allowed)] == []
    source = inspect.getsource(weights_only.Unpickler.load)
    read = {opcode.name for opcode in pickletools.opcodes if re.search(rf"\b{opcode.name}\[0\]", source)}
    assert read == torch_parity.TORCH_OPCODES


def test_a_folder_is_judged_by_what_loaders_open_not_by_every_byte_in_it(tmp_path: Path) -> None:
    """Config, text and numeric .npy files are not pickles: a folder of a safe checkpoint and those is safe; an
    object .npy (numpy loads it with pickle) and a suffix-less pickle are scanned."""
    folder = tmp_path / "m"
    folder.mkdir()
    torch.save({"w": torch.ones(2)}, folder / "model.pt")
    np.save(folder / "embeddings.npy", np.arange(4.0))
    (folder / "tokenizer.json").write_text("{}")
    assert ckptconv.scan(folder).verdict == "safe"
    (folder / "state").write_bytes(call("posix", "system", "id", protocol=2))
    report = ckptconv.scan(folder)
    assert (report.verdict, report.reason.split(":")[0]) == ("unsafe", "state")
    (folder / "state").unlink()
    np.save(folder / "objects.npy", np.array([_Evil()], dtype=object), allow_pickle=True)
    report = ckptconv.scan(folder)
    assert (report.verdict, report.reason.split(":")[0]) == ("unsafe", "objects.npy")


def test_members_go_to_a_private_folder_removed_after_and_need_room_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    _model_folder(tmp_path / "model")
    archive = _archive("tar.gz", tmp_path / "model", tmp_path / "model.tar.gz")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    seen: list[int] = []
    real_mkstemp = tempfile.mkstemp

    def recorded(*args: Any, **kwargs: Any) -> tuple[int, str]:
        descriptor, name = real_mkstemp(*args, **kwargs)
        seen.append(os.stat(os.path.dirname(name)).st_mode & 0o777)
        return descriptor, name

    monkeypatch.setattr(tempfile, "mkstemp", recorded)
    assert ckptconv.scan(archive).verdict == "unsafe"
    assert seen == [0o700]  # one member copied, into a folder only this user can enter
    assert list(temporary.iterdir()) == []  # and nothing left behind
    free = collections.namedtuple("usage", "total used free")(1 << 40, 0, 1 << 20)
    monkeypatch.setattr(archives.shutil, "disk_usage", lambda folder: free)
    report = ckptconv.scan(archive)
    assert (report.verdict, report.reason) == (
        "not-scanned",
        "model/pytorch_model.bin: it is "
        f"{(tmp_path / 'model' / 'pytorch_model.bin').stat().st_size:,} bytes, more than the temporary folder has "
        "room for (the worst of 1 file: 1 not-scanned)",
    )
    assert list(temporary.iterdir()) == []


def test_a_run_ckptconv_refuses_keeps_its_own_verdict_beside_its_files() -> None:
    """An FSDP1 LOCAL_STATE_DICT run is not-a-checkpoint to ckptconv (its shapes are not recorded); its files'
    verdicts (foreign) do not hide that: the item is the worst of the folder's own verdict and theirs."""
    summary = ckptconv.scan_many([os.path.join(FIXTURES, "runs")])
    (report,) = [report for report in summary.reports if report.path.endswith("fsdp1_local")]
    assert report.verdict == "not-a-checkpoint"
    assert report.reason.startswith("holds FSDP1 LOCAL_STATE_DICT files (2 ranks")
    assert report.reason.endswith("(the worst of 3 files: 2 foreign, 1 not-a-checkpoint)")
    assert sorted(os.path.basename(item.path) for item in report.files) == [
        "fsdp1_local",
        "model_world_size_2_rank_0.pt",
        "model_world_size_2_rank_1.pt",
    ]
