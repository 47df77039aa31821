"""Code execution: every pickle route, in every container, is refused and never runs.

Each payload in :mod:`tests.hostile` creates a canary file when a real
unpickler runs it; the "live" tests prove that (in a subprocess, inside
tmp_path), so the refusals below are not vacuous. ckptconv's default mode
(stand-ins) must never create it; ``--trust`` does, as documented.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckptconv
from ckptconv.cli import cli
from ckptconv.errors import LoadError, MalformedCheckpointError, UnsafeCheckpointError, UnsupportedFormatError
from ckptconv.reading.unpickling.pickle_policy import classify_global
from ckptconv.reading.unpickling.unpickler import Unpickler

from .hostile import CANARY, CONTAINERS, NEEDS_REGISTRATION, PLATFORM, ROUTES, raw_pickle, zip_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def _write(tmp_path: Path, container: str, route: str) -> Path:
    suffix = ".pkl" if container.startswith("raw") else ".pt"
    path = tmp_path / f"evil{suffix}"
    path.write_bytes(CONTAINERS[container](ROUTES[route]))
    return path


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("route", ROUTES)
def test_no_route_runs_code_in_any_container(
    route: str, container: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    source = _write(tmp_path, container, route)
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    expected = UnsupportedFormatError if route in NEEDS_REGISTRATION else UnsafeCheckpointError
    with pytest.raises(expected):
        ckptconv.open(source)
    result = CliRunner().invoke(cli, ["convert", str(source), "out.safetensors"], catch_exceptions=False)
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("ckptconv: error: "), result.stderr
    assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [source.name]  # no output, no canary
    assert hashlib.sha256(source.read_bytes()).hexdigest() == digest


def _run_python(code: str, cwd: Path, timeout: float = 120) -> dict[str, bool]:
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


_LIVE_LOOP = """
import copyreg, contextlib, io, json, os, sys
from tests.hostile import CANARY, CONTAINERS, NEEDS_REGISTRATION, ROUTES
copyreg.add_extension("os", "system", 0xF0)  # what EXT1 needs to run code
live = {}
def run(name, load):
    os.makedirs(name, exist_ok=True)
    os.chdir(name)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            load()
    except BaseException:
        pass
    live[name] = os.path.exists(CANARY)
    os.chdir("..")
"""


def test_every_payload_is_live_under_pickle_loads(tmp_path: Path) -> None:
    code = (
        _LIVE_LOOP
        + """
import pickle
from tests.hostile import raw_pickle
for index, (route, body) in enumerate(ROUTES.items()):
    run(str(index), lambda: pickle.loads(raw_pickle(body)))
print(json.dumps({route: live[str(index)] for index, route in enumerate(ROUTES)}))
"""
    )
    live = _run_python(code, tmp_path)
    dead = [route for route, ran in live.items() if not ran and route not in PLATFORM]
    assert dead == []


def test_every_payload_is_live_under_torch_load_in_every_container(tmp_path: Path) -> None:
    """torch.load(weights_only=False), the usual "fix" for torch 2.6's refusals, runs them all."""
    code = (
        _LIVE_LOOP
        + """
import torch
names = {}
for c_index, (container, build) in enumerate(CONTAINERS.items()):
    for r_index, (route, body) in enumerate(ROUTES.items()):
        if route in NEEDS_REGISTRATION or container.startswith("raw"):
            continue
        data = build(body)
        name = f"{c_index}-{r_index}"
        names[name] = f"{container} / {route}"
        run(name, lambda: torch.load(io.BytesIO(data), weights_only=False))
print(json.dumps({names[name]: ran for name, ran in live.items()}))
"""
    )
    live = _run_python(code, tmp_path, timeout=300)
    dead = [case for case, ran in live.items() if not ran and case.split(" / ")[1] not in PLATFORM]
    assert dead == []
    assert len(live) == 4 * (len(ROUTES) - len(NEEDS_REGISTRATION))


def test_trust_runs_the_files_code_as_documented(tmp_path: Path) -> None:
    source = _write(tmp_path, "torch zip", "GLOBAL+REDUCE")
    code = f"""
import json, ckptconv
try:
    ckptconv.open({str(source)!r}, trust=True)
except ckptconv.LoadError:
    pass
import os
print(json.dumps({{"ran": os.path.exists({CANARY!r})}}))
"""
    assert _run_python(code, tmp_path) == {"ran": True}


SCANNER_BYPASSES = [
    # from picklescan / fickling bypass reports and torch weights_only advisories
    ("pydoc", "pipepager"),
    ("pydoc", "locate"),
    ("uuid", "_get_command_stdout"),
    ("_osx_support", "_read_output"),
    ("_aix_support", "_read_cmd_output"),
    ("torch.utils.collect_env", "run"),
    ("cProfile", "run"),
    ("timeit", "timeit"),
    ("pty", "spawn"),
    ("code", "InteractiveInterpreter.runsource"),
    ("runpy", "_run_code"),
    ("pip", "main"),
    ("pip._internal.cli.main", "main"),
    ("venv", "create"),
    ("ensurepip", "_run_pip"),
    ("idlelib.pyshell", "ModifiedInterpreter.runcode"),
    ("lib2to3.pgen2.pgen", "ParserGenerator"),
    ("trace", "Trace.run"),
    ("bdb", "Bdb.run"),
    ("doctest", "debug_script"),
    ("asyncio", "create_subprocess_shell"),
    ("distutils.file_util", "write_file"),
    ("torch._inductor.codecache", "compile_file"),
    ("torch.fx.experimental.symbolic_shapes", "ShapeEnv.evaluate_guards_expression"),
    ("torch.jit.unsupported_tensor_ops", "execWrapper"),
    ("torch.serialization", "load"),
    ("torch.utils.data.datapipes.utils.decoder", "basichandlers"),
    ("torch.utils.bottleneck.__main__", "run_cprofile"),
    ("_pickle", "Unpickler"),
    ("platform", "_syscmd_file"),
    ("webbrowser", "open"),
    ("numpy.f2py", "compile"),
    ("builtins", "getattr"),
    ("builtins", "__import__"),
    ("operator", "methodcaller"),
    ("shutil", "copyfile"),
    ("_io", "FileIO"),
    ("tempfile", "mktemp"),
    ("cgitb", "handler"),
    ("test.support.script_helper", "assert_python_ok"),
]


@pytest.mark.parametrize("module, name", SCANNER_BYPASSES)
def test_globals_that_fooled_scanners_are_refused(module: str, name: str) -> None:
    assert classify_global(module, name) == "dangerous"
    with pytest.raises(UnsafeCheckpointError):
        Unpickler(raw_pickle(f"c{module}\n{name}\n".encode() + b")R"), source="x").load()


@pytest.mark.parametrize(
    "members",
    [
        {"archive/constants.pkl": b"\x80\x02)."},
        {"archive/code/__torch__.py": b"def forward(self): pass\n"},
        {"archive/constants.pkl": b"\x80\x02).", "archive/code/__torch__/m.py": b""},
    ],
    ids=["constants.pkl", "code/", "both"],
)
def test_torchscript_archives_are_refused(members: dict[str, bytes], tmp_path: Path) -> None:
    # CVE-2025-32434: torch.load(weights_only=True) handed TorchScript archives to
    # torch.jit.load, past the weights-only unpickler. ckptconv never loads TorchScript.
    source = tmp_path / "script.pt"
    source.write_bytes(zip_checkpoint(lambda original: original, extra=members))
    with zipfile.ZipFile(source) as archive:
        root = archive.namelist()[0].split("/")[0]
    renamed = tmp_path / "renamed.pt"
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(renamed, "w") as new:
        for info in old.infolist():  # same root folder as data.pkl, whatever torch named it
            new.writestr(info.filename.replace("archive/", f"{root}/", 1), old.read(info))
    with pytest.raises(UnsupportedFormatError, match="TorchScript"):
        ckptconv.open(renamed)


@pytest.mark.parametrize(
    "body",
    [
        b"]N" + b"(" + b"NN" + b"u",  # SETITEMS on a list
        b"(NNt" + b"NNs",  # SETITEM on a tuple
        b"cargparse\nNamespace\n\x85" + b"NNs",  # SETITEM on a tuple holding a class
        b"N]u",  # SETITEMS without MARK
    ],
)
def test_setitems_on_non_dicts_is_refused(body: bytes) -> None:
    # CVE-2026-24747: torch's weights_only unpickler corrupted memory on SETITEM(S)
    # applied to non-dicts.
    with pytest.raises(MalformedCheckpointError):
        Unpickler(raw_pickle(body), source="x").load()


def test_storage_larger_than_its_record_is_refused(tmp_path: Path) -> None:
    # CVE-2026-24747's second half: a storage numel that disagrees with the record.
    def grow(original: bytes) -> bytes:
        return original.replace(b"K\x04t", b"M\x00\x10t", 1)  # numel 4 -> 4096

    source = tmp_path / "grown.pt"
    source.write_bytes(zip_checkpoint(grow))
    with pytest.raises(LoadError, match=r"holds 16 bytes but data\.pkl expects 16384"):
        ckptconv.open(source)
