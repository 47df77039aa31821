"""ckptconv scan: verdicts on an attack corpus and real checkpoints; parser differentials refused everywhere."""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptconv
from ckptconv.cli import cli
from ckptconv.errors import MalformedCheckpointError, UnsafeCheckpointError
from tests.conftest import swap_after_discovery
from tests.scan_corpus import (
    build_corpus,
    call,
    dup_expansion,
    memo_self_appends,
    nested_frame_pickle,
    peer_cases,
    straddle_binary_pickle,
    straddle_pickle,
)

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
REFUSED = ("unsafe", "damaged", "not-a-checkpoint", "unreadable")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Any, str]]:
    return build_corpus(tmp_path_factory.mktemp("corpus"))


# ---------------------------------------------------------------------------------------
# What CPython would do: find_class records the names instead of importing them
# ---------------------------------------------------------------------------------------


class _Recording(pickle.Unpickler):
    """CPython's C unpickler, with a find_class that imports nothing and calls nothing."""

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self.names: list[str] = []

    def find_class(self, module: str, name: str) -> Any:
        self.names.append(f"{module}.{name}")
        return lambda *args, **kwargs: ("called", module, name)


def _cpython_names(data: bytes, *, pickles: int = 1) -> list[str]:
    """The globals CPython's unpickler resolves reading ``data`` from a file object, as torch does."""
    file = io.BytesIO(data)
    unpickler = _Recording(file)
    for _ in range(pickles):
        unpickler.load()
    return unpickler.names


def _frame_blind_names(data: bytes) -> list[str]:
    """The globals a reader that ignores frames sees (pickletools, and scanners built on it)."""
    names = []
    strings: list[str] = []
    for opcode, arg, _pos in pickletools.genops(data):
        if opcode.name in ("GLOBAL", "INST"):
            names.append(str(arg).replace(" ", "."))
        elif isinstance(arg, str):
            strings.append(arg)
        elif opcode.name == "STACK_GLOBAL":
            names.append(".".join(strings[-2:]))
    return names


def _write(tmp_path: Any, name: str, data: bytes) -> str:
    path = os.path.join(tmp_path, name)
    with open(path, "wb") as file:
        file.write(data)
    return path


# ---------------------------------------------------------------------------------------
# The corpus
# ---------------------------------------------------------------------------------------


def test_every_malicious_sample_is_unsafe_or_refused(corpus: list[tuple[Any, str]]) -> None:
    verdicts = Counter()
    missed = []
    for sample, path in corpus:
        if sample.label != "malicious":
            continue
        report = ckptconv.scan(path)
        verdicts[report.verdict] += 1
        if report.verdict not in REFUSED:
            missed.append((sample.name, report.verdict, report.reason))
        # Whatever scan says, the file can never be converted.
        with pytest.raises(ckptconv.LoadError):
            ckptconv.open(path)
    assert not missed
    # Nearly all of them are named as unsafe, not merely refused as broken.
    assert verdicts["unsafe"] >= 0.95 * sum(verdicts.values()), verdicts


def test_no_benign_sample_is_unsafe(corpus: list[tuple[Any, str]]) -> None:
    for sample, path in corpus:
        if sample.label == "benign":
            report = ckptconv.scan(path)
            assert report.verdict != "unsafe", (sample.name, report.reason)


def test_unsafe_findings_name_the_global_and_its_opcode_offset(tmp_path: Any) -> None:
    data = pickle.dumps({"a": 1}, protocol=2)[:-1] + b"0" + call("posix", "system", "id", protocol=2)[2:]
    path = _write(tmp_path, "x.pkl", data)
    report = ckptconv.scan(path)
    assert report.verdict == "unsafe"
    (finding,) = report.unsafe
    assert finding.name == "posix.system"
    assert finding.family == "runs processes"
    assert data[finding.offset : finding.offset + 1] == b"c"  # the GLOBAL opcode itself
    assert data[finding.offset + 1 :].startswith(b"posix\nsystem\n")


@pytest.mark.parametrize(
    ("module", "name", "family"),
    [
        ("httplib", "HTTPSConnection", "reaches the network"),
        ("nntplib", "NNTP", "reaches the network"),
        ("logging", "FileHandler", "touches files"),
        ("ast", "parse", "runs code"),
        ("_interpreters", "create", "runs code"),
        ("torch.storage", "_load_from_bytes", "loads further pickles"),
        ("torch", "compile", "runs code"),
        ("torch.utils._config_module", "ConfigModule.load_config", "loads further pickles"),
        ("fickling.hook", "remove_hook", "tampers with scanners"),
        ("picklescan.scanner", "scan_pickle_bytes", "tampers with scanners"),
        ("_operator", "attrgetter", "reaches into the interpreter"),
        ("_functools", "reduce", "runs code"),
        ("_imp", "create_dynamic", "imports code"),
        ("numpy.lib.format", "read_array", "loads further pickles"),
        ("pandas", "read_csv", "touches files"),
        ("torch.utils.model_zoo", "load_url", "reaches the network"),
    ],
)
def test_what_inspect_called_ordinary_is_refused_and_unsafe(tmp_path: Any, module: str, name: str, family: str) -> None:
    for protocol in (0, 2, 4):
        path = _write(tmp_path, f"p{protocol}.pkl", call(module, name, "x", protocol=protocol))
        with pytest.raises(UnsafeCheckpointError) as raised:
            ckptconv.inspect(path)
        assert family in str(raised.value)
        report = ckptconv.scan(path)
        assert report.verdict == "unsafe"
        assert report.unsafe[0].family == family


# ---------------------------------------------------------------------------------------
# Real checkpoints: never unsafe
# ---------------------------------------------------------------------------------------


def _fixture_files() -> list[str]:
    found = []
    for folder, _subfolders, names in os.walk(FIXTURES):
        found += [os.path.join(folder, name) for name in names if name.endswith((".pt", ".pth", ".bin", ".pkl"))]
    return sorted(found)


@pytest.mark.parametrize("path", _fixture_files(), ids=os.path.basename)
def test_real_checkpoints_are_safe_or_foreign(path: str) -> None:
    report = ckptconv.scan(path)
    if os.path.basename(path) == "torchscript_model.pt":  # code for torch.jit, refused by every command
        assert report.verdict == "not-a-checkpoint"
        return
    assert report.verdict in ("safe", "foreign"), report.reason
    if report.verdict == "foreign":
        assert report.foreign


def test_torch_save_outputs_are_safe(tmp_path: Any) -> None:
    state = {"w": torch.randn(3, 4), "b": torch.zeros(4, dtype=torch.bfloat16), "n": torch.tensor(3)}
    for name, kwargs in [("zip.pt", {}), ("legacy.pt", {"_use_new_zipfile_serialization": False})]:
        path = os.path.join(tmp_path, name)
        torch.save(state, path, **kwargs)
        report = ckptconv.scan(path)
        assert (report.verdict, report.foreign, report.unsafe) == ("safe", {}, ())
    model = torch.nn.Linear(2, 3)
    torch.save(model, os.path.join(tmp_path, "model.pt"))
    report = ckptconv.scan(os.path.join(tmp_path, "model.pt"))
    assert report.verdict == "foreign"
    assert "torch.nn.modules.linear.Linear" in report.foreign


# ---------------------------------------------------------------------------------------
# Parser differentials: CPython and ckptconv would read the file differently; refused
# ---------------------------------------------------------------------------------------


def test_text_line_straddling_a_frame_hides_os_system(tmp_path: Any) -> None:
    data = straddle_pickle()
    # A frame-blind reader sees an unknown class; CPython's unpickler reads os.system.
    assert _frame_blind_names(data) == ["chaos.system"]
    assert _cpython_names(data) == ["os.system"]
    path = _write(tmp_path, "straddle.pkl", data)
    with pytest.raises(UnsafeCheckpointError, match="runs past the end of the frame"):
        ckptconv.open(path)
    with pytest.raises(UnsafeCheckpointError):
        ckptconv.open(_write(tmp_path, "straddle.pt", _in_torch_zip(data)))
    assert ckptconv.scan(path).verdict == "unsafe"


def test_binary_argument_straddling_a_frame(tmp_path: Any) -> None:
    data = straddle_binary_pickle()
    # CPython's C unpickler reads across the frame's end, its Python unpickler refuses.
    assert _cpython_names(data) == ["builtins.len"]
    with pytest.raises(pickle.UnpicklingError, match="exhausted before end of frame"):
        pickle._Unpickler(io.BytesIO(data)).load()  # type: ignore[attr-defined]
    with pytest.raises(UnsafeCheckpointError, match="runs past the end of the frame"):
        ckptconv.open(_write(tmp_path, "x.pkl", data))


def test_frame_opened_inside_a_frame(tmp_path: Any) -> None:
    data = nested_frame_pickle()
    assert _cpython_names(data) == ["os.system"]
    with pytest.raises(pickle.UnpicklingError, match="new frame before end of current frame"):
        pickle._Unpickler(io.BytesIO(data)).load()  # type: ignore[attr-defined]
    with pytest.raises(UnsafeCheckpointError, match="starts inside the frame"):
        ckptconv.open(_write(tmp_path, "x.pkl", data))


def test_frame_longer_than_the_file(tmp_path: Any) -> None:
    body = pickle.dumps({"a": [1, 2]}, protocol=4)[11:]
    data = b"\x80\x04\x95" + struct.pack("<Q", 4096) + body
    # A frame-blind reader reads a whole pickle; CPython refuses the frame.
    assert [op.name for op, _a, _p in pickletools.genops(data)][-1] == "STOP"
    with pytest.raises(pickle.UnpicklingError):
        _cpython_names(data)
    with pytest.raises(MalformedCheckpointError, match="FRAME at byte 2 holds 4,096 bytes"):
        ckptconv.open(_write(tmp_path, "x.pkl", data))


def test_well_formed_frames_and_large_unframed_bytes_still_load(tmp_path: Any) -> None:
    value = {"blob": b"\x01" * 100_000, "text": "x" * 70_000, "items": list(range(5000))}
    for protocol in (4, 5):
        path = _write(tmp_path, f"p{protocol}.pkl", pickle.dumps(value, protocol=protocol))
        assert ckptconv.open(path).tree == value


def test_second_pickle_after_stop(tmp_path: Any) -> None:
    data = pickle.dumps(["a", "b"], protocol=4) + call("os", "system", "id")
    # torch.load and pickle.load read the first; a loader that reads on runs the second.
    assert _cpython_names(data) == []
    assert _cpython_names(data, pickles=2) == ["os.system"]
    path = _write(tmp_path, "x.pkl", data)
    with pytest.raises(MalformedCheckpointError, match="bytes after its pickle's STOP opcode"):
        ckptconv.open(path)
    report = ckptconv.scan(path)
    assert report.verdict == "unsafe"
    assert report.unsafe[0].name == "os.system"
    assert report.unsafe[0].offset > len(pickle.dumps(["a", "b"], protocol=4))


def test_data_after_stop_in_a_torch_zip(tmp_path: Any) -> None:
    data = pickle.dumps({}, protocol=2) + b"junk"
    path = _write(tmp_path, "x.pt", _in_torch_zip(data))
    with pytest.raises(MalformedCheckpointError, match="4 bytes after its pickle's STOP"):
        ckptconv.open(path)
    assert ckptconv.scan(path).verdict == "damaged"


def test_memo_and_dup_expansion_beyond_the_budget(tmp_path: Any) -> None:
    levels = 40
    data = b"\x80\x04]" + b"2\x86" * levels + b"."  # EMPTY_LIST, then (DUP, TUPLE2) forty times
    # CPython builds it in microseconds: a tree of 2**40 leaves that any walker expands.
    value = pickle.loads(data)
    depth = 0
    while isinstance(value, tuple):
        assert value[0] is value[1]
        value, depth = value[0], depth + 1
    assert depth == levels and 2**levels > ckptconv.reading.unpickling.unpickler.DEFAULT_MAX_ITEMS
    with pytest.raises(MalformedCheckpointError, match="expands to more than"):
        ckptconv.open(_write(tmp_path, "x.pkl", data))
    # Sharing within the budget (tied objects, shared lists) still loads.
    shared = list(range(100))
    ok = {"a": shared, "b": [shared] * 100}
    assert ckptconv.open(_write(tmp_path, "ok.pkl", pickle.dumps(ok, protocol=4))).tree == ok


_EXPANSION = "memo/DUP expansion: "
_PEER_LINES = {
    "fk_memo_expansion.pkl": (
        f"{_EXPANSION}puts containers into themselves 60 times (exhausts memory) from pickle byte 4"
    ),
    "fk_dup_expansion.pkl": (
        f"{_EXPANSION}duplicates containers with DUP 150 times (exhausts memory) from pickle byte 3"
    ),
    "fk_resource_limits.pkl": (
        f"{_EXPANSION}puts containers into themselves 100 times (exhausts memory) from pickle byte 4"
    ),
    "fk_get_ratio.pkl": f"{_EXPANSION}puts containers into themselves 60 times (exhausts memory) from pickle byte 6",
    "fk_check_safety_exhaustion.pkl": (
        f"{_EXPANSION}puts containers into themselves 200 times (exhausts memory) from pickle byte 4"
    ),
    "ck_two_lists_in_each_other.pkl": (
        f"{_EXPANSION}puts containers into themselves 30 times (exhausts memory) from pickle byte 6"
    ),
    "ck_memo_reads_left_on_the_stack.pkl": (
        f"{_EXPANSION}leaves shared containers on the stack at STOP 100 times (exhausts memory) from pickle byte 4"
    ),
    "ck_object_in_itself.pkl": (
        f"{_EXPANSION}puts containers into themselves 40 times (exhausts memory) from pickle byte 16"
    ),
    "ck_future_ssl.pkl": "names __future__._ssl.RAND_bytes (reaches the network) at pickle byte 31",
    "ck_module_attribute_sys.pkl": "names collections.abc.sys.modules (reaches into the interpreter) at pickle byte 32",
    "ck_elastic_etcd.pkl": (
        "names torch.distributed.elastic.rendezvous.etcd_rendezvous.EtcdRendezvousHandler (runs processes) "
        "at pickle byte 79"
    ),
    "ck_elastic_c10d.pkl": (
        "names torch.distributed.elastic.rendezvous.c10d_rendezvous_backend.C10dRendezvousBackend (runs processes) "
        "at pickle byte 87"
    ),
    "ck_saferpickle.pkl": "names saferpickle.disable (tampers with scanners) at pickle byte 24",
    "ck_model_unpickler.pkl": "names model_unpickler.disable (tampers with scanners) at pickle byte 28",
    "ck_short_protocol0.pkl": "names os.system (runs processes) at pickle byte 0",
    "ck_no_proto_header.pkl": "names builtins.exec (runs code) at pickle byte 16",
    "ck_itemgetter.pkl": "names operator.itemgetter (reaches into the interpreter) at pickle byte 24",
    "ck_platform.pkl": "names platform.architecture (runs processes) at pickle byte 26",
    "ck_pexpect.pkl": "names pexpect.spawn (runs processes) at pickle byte 18",
}
_PEER_CASES = [
    ("fk_memo_expansion.pkl", memo_self_appends(60)),
    ("fk_dup_expansion.pkl", dup_expansion(150)),
    ("fk_resource_limits.pkl", memo_self_appends(100)),
    ("fk_get_ratio.pkl", memo_self_appends(60, protocol=2)),
    ("fk_check_safety_exhaustion.pkl", memo_self_appends(200)),
    *((name, data) for name, data, _what in peer_cases()),
]


@pytest.mark.parametrize(("name", "data"), _PEER_CASES, ids=[name for name, _ in _PEER_CASES])
def test_what_the_peer_scanners_flag_is_unsafe(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, name: str, data: bytes
) -> None:
    """fickling's expansion cases, names under an allowed module, torch elastic, scanner-disabling modules,
    pickles without a header or shorter than a placeholder: scan said safe, foreign or not a checkpoint."""
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, name, data)
    result = CliRunner().invoke(cli, ["scan", name])
    assert (result.exit_code, result.stdout) == (4, f"unsafe            {name}: {_PEER_LINES[name]}\n")
    with pytest.raises(UnsafeCheckpointError):
        ckptconv.open(name)


def test_a_list_that_holds_itself_a_few_times_is_still_safe(tmp_path: Any) -> None:
    """What CPython's pickler writes for a list that contains itself (16 times at most) is no expansion."""
    value: list[Any] = [1]
    value.extend([value] * 16)
    path = _write(tmp_path, "self.pkl", pickle.dumps(value, protocol=4))
    assert ckptconv.scan(path).verdict == "safe"
    assert ckptconv.scan(_write(tmp_path, "many.pkl", pickle.dumps([[1]] * 1000))).verdict == "safe"


def _deep_folder(root: Path, levels: int = 25, length: int = 200) -> tuple[str, ...]:
    """``levels`` folders of ``length`` characters, one inside the other (deeper than PATH_MAX), made and
    filled through directory descriptors; returns the folder names."""
    names = tuple(chr(ord("a") + level % 26) * length for level in range(levels))
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in names:
            os.mkdir(name, dir_fd=fd)
            inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
        payload = os.open("evil.pkl", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(payload, call("os", "system", "id"))
        os.close(payload)
    finally:
        os.close(fd)
    return names


def test_a_folder_deeper_than_path_max_is_never_called_safe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """os.walk drops the folders it cannot list: a malicious pickle 25 folders of 200 characters down was
    "1 item: 1 safe" (the one good file beside it) and exit 0."""
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    torch.save({"w": torch.ones(2)}, zoo / "good.pt")
    names = _deep_folder(zoo)
    real = os.path.realpath(zoo)
    # The first folder that cannot be listed: the first whose path is longer than PATH_MAX allows.
    depth = next(i for i in range(1, len(names) + 1) if len(os.path.join(real, *names[:i])) >= 4096)
    unlisted = os.path.join(real, *names[:depth])
    monkeypatch.chdir(zoo)
    result = CliRunner().invoke(cli, ["scan", "."])
    assert result.exit_code == 3
    assert result.stdout.splitlines()[-1] == (
        f"unreadable        {os.path.join('.', os.path.relpath(unlisted, real))}: cannot be listed (File name too "
        "long); what it holds was not scanned"
    )  # named from the folder as it was typed
    assert result.stderr.splitlines()[-1] == "2 items: 1 safe, 1 unreadable"


def _in_torch_zip(data_pkl: bytes) -> bytes:
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/data.pkl", data_pkl)
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------
# The CLI
# ---------------------------------------------------------------------------------------


def test_cli_lines_summary_and_exit_codes(tmp_path: Any) -> None:
    torch.save({"w": torch.ones(2)}, os.path.join(tmp_path, "good.pt"))
    runner = CliRunner()
    result = runner.invoke(cli, ["scan", os.path.join(tmp_path, "good.pt")])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("safe ")
    assert "1 item: 1 safe" in result.stderr

    _write(tmp_path, "bad.pkl", call("os", "system", "id"))
    result = runner.invoke(cli, ["scan", str(tmp_path)])
    assert result.exit_code == 4
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("unsafe ")
    assert "names os.system (runs processes) at pickle byte" in lines[0]
    assert "2 items: 1 safe, 1 unsafe" in result.stderr

    os.remove(os.path.join(tmp_path, "bad.pkl"))
    _write(tmp_path, "ns.pkl", pickle.dumps({"args": _namespace()}))
    result = runner.invoke(cli, ["scan", str(tmp_path), "--json"])
    assert result.exit_code == 3
    parsed = json.loads(result.stdout)
    assert parsed["counts"]["foreign"] == 1 and parsed["worst"] == "foreign"
    item = next(i for i in parsed["items"] if i["verdict"] == "foreign")
    assert item["foreign"] == {"argparse.Namespace": 1}


def test_cli_escapes_names_from_the_file(tmp_path: Any) -> None:
    for module, code in (("os.a\x1b[2J", 4), ("mod\x1b[2J", 3)):
        path = _write(tmp_path, "x.pkl", call(module, "system\u202e", "id"))
        result = CliRunner().invoke(cli, ["scan", path])
        assert result.exit_code == code
        assert "\x1b" not in result.stdout and "\u202e" not in result.stdout
        assert module.replace("\x1b", "\\x1b") + ".system\\u202e" in result.stdout


def test_cli_sharded_and_dcp_folders_are_one_item(tmp_path: Any) -> None:
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"a": torch.ones(2)}, str(hf / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(2)}, str(hf / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    result = CliRunner().invoke(cli, ["scan", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    items = json.loads(result.stdout)["items"]
    assert [item["verdict"] for item in items] == ["safe"]
    assert items[0]["path"].endswith("model.safetensors.index.json")


def test_cli_missing_path_is_an_error() -> None:
    result = CliRunner().invoke(cli, ["scan", "/nonexistent/x.pt"])
    assert result.exit_code == 1
    assert result.stderr.strip() == "ckptconv: error: '/nonexistent/x.pt' does not exist; check the path"


def _namespace() -> Any:
    import argparse

    return argparse.Namespace(lr=0.1)


# ---------------------------------------------------------------------------------------
# convert: a file holding one bare tensor
# ---------------------------------------------------------------------------------------


def test_convert_a_bare_tensor(tmp_path: Any) -> None:
    from safetensors.torch import load_file

    tensor = torch.randn(3, 5)
    src = os.path.join(tmp_path, "t.pt")
    torch.save(tensor, src)
    out = os.path.join(tmp_path, "t.safetensors")
    report = ckptconv.convert(src, out)
    assert any("single tensor" in note for note in report.notes)
    loaded = load_file(out)
    assert list(loaded) == ["tensor"] and torch.equal(loaded["tensor"], tensor)
    renamed = os.path.join(tmp_path, "r.safetensors")
    ckptconv.convert(src, renamed, transforms=ckptconv.Pipeline.of([ckptconv.Rename("^tensor$", "embedding")]))
    assert torch.equal(load_file(renamed)["embedding"], tensor)


def test_cli_on_the_gpu_fixtures_folder_groups_sharded_and_dcp_items() -> None:
    gpu = os.path.join(FIXTURES, "gpu")
    result = CliRunner().invoke(cli, ["scan", gpu, "--json"])
    parsed = json.loads(result.stdout)
    by_name = {os.path.relpath(item["path"], gpu): item["verdict"] for item in parsed["items"]}
    assert by_name["fsdp2_dcp"] == "safe"
    assert by_name["hf_sharded_safetensors/model.safetensors.index.json"] == "safe"
    assert by_name["hf_sharded_bin/pytorch_model.bin.index.json"] == "safe"
    assert not any(name.startswith("hf_sharded_safetensors/model-0") for name in by_name)
    assert by_name["torchscript_model.pt"] == "not-a-checkpoint"
    assert parsed["counts"]["unsafe"] == 0 and parsed["worst"] == "not-a-checkpoint"
    assert result.exit_code == 3


def test_pickles_hidden_in_zip_members_are_named_with_their_member(corpus: list[tuple[Any, str]]) -> None:
    paths = {sample.name: path for sample, path in corpus}
    for name, member in [
        ("ps_zip_crc.pt", "archive/data.pkl"),
        ("ps_zip_cd_name.pt", "archive/data.pkl"),
        ("ps_zip_wrong_ext.zip", "archive/data.txt"),
        ("ps_zip_root_data_pkl.zip", "data.pkl"),
    ]:
        report = ckptconv.scan(paths[name])
        assert report.verdict == "unsafe", (name, report.reason)
        assert "names builtins.eval (runs code) at pickle byte" in report.reason
        assert f"of {member}" in report.reason
    report = ckptconv.scan(paths["ps_dns_exfiltration.npy"])
    assert report.verdict == "unsafe" and report.unsafe[0].name == "ssl.get_server_certificate"


@pytest.mark.parametrize(
    ("module", "name", "cpython_name"),
    [("commands", "getoutput", "subprocess.getoutput"), ("__builtin__", "reduce", "functools.reduce")],
)
def test_python2_spellings_count_as_cpython_renames_them(
    tmp_path: Any, module: str, name: str, cpython_name: str
) -> None:
    data = call(module, name, "id", protocol=0)

    # CPython's unpickler renames Python 2 modules for protocols 0-2 before importing them.
    class Renaming(_Recording):
        def find_class(self, module: str, name: str) -> Any:
            import _compat_pickle

            module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
            return super().find_class(_compat_pickle.IMPORT_MAPPING.get(module, module), name)

    unpickler = Renaming(io.BytesIO(data))
    unpickler.load()
    assert unpickler.names == [cpython_name]
    with pytest.raises(UnsafeCheckpointError):
        ckptconv.open(_write(tmp_path, "x.pkl", data))


def _torch_load_asks(path: str) -> list[str]:
    """The globals ``torch.load(path, weights_only=False)`` asks its unpickler for, in order; nothing is
    imported or called (find_class is ours)."""
    asked: list[str] = []

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            asked.append(f"{module}.{name}")
            return lambda *args: None

    class Module:
        Unpickler = Recording
        load = staticmethod(pickle.load)
        __name__ = "recording"

    torch.load(path, weights_only=False, pickle_module=Module)
    return asked


def test_two_zip_records_of_one_name(tmp_path: Any) -> None:
    import warnings
    import zipfile

    evil = call("posix", "system", "id", protocol=2)
    buffer = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(buffer, "w") as archive:
        warnings.simplefilter("ignore")  # zipfile warns about the duplicate name, as it should
        archive.writestr("archive/data.pkl", evil)
        archive.writestr("archive/data.pkl", pickle.dumps({"a": torch.ones(1).numpy()}, protocol=2))
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")
    path = _write(tmp_path, "dup.pt", buffer.getvalue())
    # torch.load reads the first record: its find_class is asked for posix.system.
    assert _torch_load_asks(path) == ["posix.system"]  # nothing runs: find_class is ours
    # Python's zipfile, and so a reader built on it, sees the benign last record.
    with zipfile.ZipFile(path) as archive:
        assert archive.read("archive/data.pkl") != evil
    with pytest.raises(UnsafeCheckpointError, match=r"two records named 'archive/data\.pkl'"):
        ckptconv.open(path)
    report = ckptconv.scan(path)
    assert report.verdict == "unsafe" and report.unsafe[0].name == "posix.system"


def test_a_zip_appended_to_another_is_refused_not_read_as_the_second(tmp_path: Any) -> None:
    """torch's reader takes the directory's offsets from the start of the file, Python's zipfile shifts
    them past the bytes before the archive: a benign torch.save file appended to one whose data.pkl names
    posix.system was the benign one to ckptconv (scan: 'safe') and the other to torch.load."""
    import zipfile

    benign = pickle.dumps({"a": "x" * 40}, protocol=2)
    evil = call("posix", "system", "id", protocol=2)
    evil = call("posix", "system", "id" + " " * (len(benign) - len(evil)), protocol=2)
    assert len(benign) == len(evil)  # the same layout: the second archive's directory numbers fit the first
    first, second = _in_torch_zip(evil), _in_torch_zip(benign)
    path = _write(tmp_path, "two.pt", first + second)
    assert _torch_load_asks(path) == ["posix.system"]  # nothing runs: find_class is ours
    with zipfile.ZipFile(path) as archive:  # the second archive's records
        assert archive.read("archive/data.pkl") == benign
    shift = len(first)
    said = (
        f"has {shift} bytes before its zip archive that the archive's directory does not count (another "
        "archive?); torch reads the records at the offsets as recorded and other zip readers past those bytes, "
        "so refusing a file that can be read two ways (nothing was executed)"
    )
    with pytest.raises(UnsafeCheckpointError) as caught:
        ckptconv.open(path)
    assert str(caught.value) == f"{str(path)!r} {said}"
    report = ckptconv.scan(path)
    assert (report.verdict, report.reason) == ("unsafe", said)


def test_two_torch_files_one_after_the_other_are_refused(tmp_path: Any) -> None:
    """Plain concatenation: torch.load reads the first file's tensors, Python's zipfile the second's."""
    buffers = []
    for value in (1.0, 2.0):
        buffer = io.BytesIO()
        torch.save({"w": torch.full((4,), value)}, buffer)
        buffers.append(buffer.getvalue())
    path = _write(tmp_path, "both.pt", b"".join(buffers))
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.full((4,), 1.0))
    # Refused either way: the bytes before the archive are named, or (Python 3.12.3 and later, whose zipfile checks
    # the zip64 locator before the offset is known) the directory is called damaged.
    with pytest.raises(
        (UnsafeCheckpointError, MalformedCheckpointError),
        match=f"has {len(buffers[0])} bytes before its zip archive|its zip directory cannot be read",
    ):
        ckptconv.load(path)
    from tests.conftest import run_cli

    code, stdout, stderr = run_cli("convert", str(path), str(tmp_path / "out.safetensors"))
    assert (code, stdout, stderr.count("\n")) == (1, "", 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["both.pt"]


def test_scan_answers_with_a_verdict_for_damaged_variants(corpus: list[tuple[Any, str]], tmp_path: Any) -> None:
    """Random byte flips, cuts and insertions in every kind of sample: a verdict, never an exception."""
    import random

    rng = random.Random(17)
    files = [path for _sample, path in corpus]
    target = os.path.join(tmp_path, "mutant.bin")
    verdicts = Counter()
    for _ in range(400):
        with open(rng.choice(files), "rb") as file:
            data = bytearray(file.read())
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(max(len(data), 1))
            kind = rng.randrange(3)
            if kind == 0 and data:
                data[at] = rng.randrange(256)
            elif kind == 1:
                del data[at : at + rng.randint(1, 8)]
            else:
                data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        _write(tmp_path, "mutant.bin", bytes(data))
        verdicts[ckptconv.scan(target).verdict] += 1
    assert set(verdicts) <= set(ckptconv.checking.scanning.VERDICTS)
    assert verdicts["unsafe"] and verdicts["damaged"]


def test_a_broken_file_that_names_code_is_unsafe_and_says_both(tmp_path: Path) -> None:
    path = tmp_path / "broken.pkl"
    path.write_bytes(b"\x80\x02cposix\nsystem\nX\x02\x00\x00\x00idq")  # no STOP: truncated
    report = ckptconv.scan(path)
    assert report.verdict == "unsafe"
    assert report.reason.startswith("names posix.system (runs processes) at pickle byte 2; reading it also failed: ")
    assert report.reason.endswith(
        "is truncated: its pickle ends at byte 24 before the STOP opcode; the file is incomplete or damaged"
    )


def test_a_file_swapped_for_a_link_out_of_the_folder_after_discovery_is_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """scan_many found m.pt, which then became a link to a private file outside the folder: scan read it
    and showed its first bytes ("it starts with bytes 72 6f 6f 74 ...")."""
    from ckptconv.reading import discovery

    zoo, secret = tmp_path / "zoo", tmp_path / "secret.txt"
    zoo.mkdir()
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n" * 2)
    torch.save({"w": torch.ones(2)}, zoo / "m.pt")

    def swap() -> None:
        (zoo / "m.pt").unlink()
        (zoo / "m.pt").symlink_to(secret)

    swap_after_discovery(monkeypatch, discovery, swap)
    (report,) = ckptconv.scan_many([zoo]).reports
    assert report.reason == (
        f"is a link that leads outside the source folder {str(zoo)!r} (to {str(secret)!r}); not followed"
    )
    assert "72 6f 6f 74" not in report.reason
    assert ckptconv.scan(zoo / "m.pt").verdict != "safe"  # named itself, the link is followed: the user's choice


def test_a_folder_swapped_for_a_link_to_a_look_alike_hub_snapshot_after_discovery_is_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hub-cache exception (a snapshot's link into ../../blobs) was asked of the file's folder as it
    resolves: a folder under SRC swapped for a link to a made-up snapshot, whose blobs link leads anywhere,
    let scan_many read a private file outside SRC and show its first bytes."""
    from ckptconv.reading import discovery

    zoo, secret, fake = tmp_path / "zoo", tmp_path / "secret.txt", tmp_path / "fake"
    (zoo / "sub").mkdir(parents=True)
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n" * 2)
    torch.save({"w": torch.ones(2)}, zoo / "sub" / "m.pt")
    (fake / "snapshots" / "rev").mkdir(parents=True)
    (fake / "blobs").symlink_to(tmp_path)  # the "blobs" are the folder holding the secret
    (fake / "snapshots" / "rev" / "m.pt").symlink_to("../../blobs/secret.txt")

    def swap() -> None:
        (zoo / "sub" / "m.pt").unlink()
        (zoo / "sub").rmdir()
        (zoo / "sub").symlink_to(fake / "snapshots" / "rev")

    swap_after_discovery(monkeypatch, discovery, swap)
    (report,) = ckptconv.scan_many([zoo]).reports
    assert report.reason == (
        f"is a link that leads outside the source folder {str(zoo)!r} (to {str(secret)!r}); not followed"
    )
    assert "72 6f 6f 74" not in report.reason


def _legacy_that_is_also_a_tar() -> bytes:
    """A legacy torch.save file whose first 512 bytes are also a valid (v7) tar header: the sys_info pickle
    is a string that holds the header's octal fields and checksum at their offsets."""
    from tests.conftest import legacy_save

    raw, ends = legacy_save({"w": torch.arange(4.0)})
    head = raw[: ends[1]] + b"\x80\x02X"  # then a BINUNICODE string filling the rest of the block
    text_at = len(head) + 4
    block = bytearray(b"a" * 157 + b"\0" * (512 - 157))
    for at, field in {100: b"0000644\0", 108: b"0000000\0", 116: b"0000000\0", 124: b"00000000000\0"}.items():
        block[at : at + len(field)] = field
    block[136:157] = b"00000000000\0" + b" " * 8 + b"0"  # mtime, checksum (spaces while summing), type
    block[:text_at] = head + struct.pack("<I", 512 - text_at)
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block) + b"." + raw[ends[2] :]


def test_a_legacy_file_that_is_also_a_tar_archive_is_refused(tmp_path: Any) -> None:
    """torch.load opens a non-zip file with tarfile first and, when that works, reads the pre-0.4 tar
    format (weights_only=True refuses it from torch 2.6) instead of the legacy pickles ckptconv read: scan said 'safe'
    about pickles torch never reads."""
    import tarfile

    path = _write(tmp_path, "both.pt", _legacy_that_is_also_a_tar())
    with tarfile.open(path, mode="r:"):
        pass
    # torch 2.6+ refuses the tar format under weights_only=True; torch 2.4 reads it as one (and fails
    # to find its 'storages' member): either way torch.load takes the tar, not the legacy pickles.
    with pytest.raises((RuntimeError, KeyError), match=r"legacy \.tar format|'storages' not found"):
        torch.load(path, weights_only=True)
    said = (
        "is both a legacy torch checkpoint and a tar archive, which torch.load reads instead (torch's pre-0.4 "
        "format, which weights_only=True refuses from torch 2.6), so refusing a file that can be read two ways "
        "(nothing was executed)"
    )
    with pytest.raises(UnsafeCheckpointError) as caught:
        ckptconv.open(path)
    assert str(caught.value) == f"{path!r} {said}"
    assert (ckptconv.scan(path).verdict, ckptconv.scan(path).reason) == ("unsafe", said)


def test_records_whose_names_differ_only_in_case_are_refused(tmp_path: Any) -> None:
    """torch's reader finds a record whatever the case of its name, and with 'archive/DATA.PKL' after
    'archive/data.pkl' it runs the second; Python's zipfile, and so ckptconv, read the first."""
    import zipfile

    saved = io.BytesIO()
    torch.save({"w": torch.ones(2)}, saved)
    evil = call("posix", "system", "id", protocol=2)
    buffer = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(saved.getvalue())) as good, zipfile.ZipFile(buffer, "w") as archive:
        for info in good.infolist():
            archive.writestr(info.filename, good.read(info))
        archive.writestr("archive/DATA.PKL", evil)
    path = _write(tmp_path, "case.pt", buffer.getvalue())
    assert _torch_load_asks(path) == ["posix.system"]  # nothing runs: find_class is ours
    with pytest.raises(UnsafeCheckpointError) as caught:
        ckptconv.open(path)
    assert str(caught.value) == (
        f"{path!r} holds records named 'archive/data.pkl' and 'archive/DATA.PKL', one name to torch's reader "
        "(it ignores case), so refusing a file that can be read two ways (nothing was executed)"
    )
    assert ckptconv.scan(path).verdict == "unsafe"
