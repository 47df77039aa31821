"""Fuzzing the readers: mutated corpus files and random pickles only ever end in a CkptconvError.

A bounded smoke run happens in every test run (about a minute on two cores);
``CKPTCONV_FUZZ_EXAMPLES`` scales it for deeper local runs, and
``tests/fuzz/atheris_fuzz.py`` drives the same harness with atheris when it is
installed (see SECURITY.md for commands and numbers).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptconv.cli import cli

from .fuzz.harness import CORPUS, exercise, exercise_path, exercise_pickle
from .hostile import CANARY

SEEDS = sorted(CORPUS.iterdir())
EXAMPLES = int(os.environ.get("CKPTCONV_FUZZ_EXAMPLES", "5000"))
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="CKPTCONV_FUZZ_RANDOM" not in os.environ,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.parametrize("seed", SEEDS, ids=[p.name for p in SEEDS])
def test_every_corpus_file_through_the_cli(seed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    digest = hashlib.sha256(seed.read_bytes()).hexdigest()
    result = CliRunner().invoke(
        cli,
        ["convert", str(seed), "out.safetensors", "--select", "ema"]
        if seed.name == "zip_training.pth"
        else ["convert", str(seed), "out.safetensors"],
        catch_exceptions=False,
    )
    if seed.name.startswith(("hostile_", "limit_", "crash_")):
        assert result.exit_code == 1, result.output
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("ckptconv: error: ")
        assert list(tmp_path.iterdir()) == []
    else:
        assert result.exit_code == 0, result.output
    assert not (tmp_path / CANARY).exists()
    assert hashlib.sha256(seed.read_bytes()).hexdigest() == digest


_INTERESTING = [0, 1, 0x7F, 0x80, 0xFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 2**63 - 1, 2**63, 2**64 - 1]
mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 20), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 20)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 20), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("delete"), st.integers(0, 1 << 20), st.integers(1, 64)),
    st.tuples(st.just("int"), st.integers(0, 1 << 20), st.sampled_from(_INTERESTING), st.sampled_from([1, 2, 4, 8])),
    st.tuples(st.just("repeat"), st.integers(0, 1 << 20), st.integers(1, 32), st.integers(2, 64)),
)


def mutate(data: bytes, steps: list[tuple[object, ...]]) -> bytes:
    raw = bytearray(data)
    for step in steps:
        kind, position = step[0], int(step[1]) % (len(raw) + 1)  # type: ignore[call-overload]
        if kind == "flip" and position < len(raw):
            raw[position] ^= int(step[2])  # type: ignore[call-overload]
        elif kind == "truncate":
            del raw[max(position, 1) :]
        elif kind == "insert":
            raw[position:position] = step[2]  # type: ignore[index]
        elif kind == "delete":
            del raw[position : position + int(step[2])]  # type: ignore[call-overload]
        elif kind == "int":
            width = int(step[3])  # type: ignore[call-overload]
            raw[position : position + width] = (int(step[2]) % (1 << (8 * width))).to_bytes(width, "little")  # type: ignore[call-overload]
        elif kind == "repeat":
            piece = bytes(raw[position : position + int(step[2])])  # type: ignore[call-overload]
            raw[position:position] = piece * int(step[3])  # type: ignore[call-overload]
    return bytes(raw)


_FOLDER = Path(tempfile.mkdtemp(prefix="ckptconv-fuzz-"))
FUZZ_SEEDS = [p for p in SEEDS if p.stat().st_size < 64 << 10]


@FUZZ_SETTINGS
@given(st.sampled_from(FUZZ_SEEDS), st.lists(mutation, min_size=1, max_size=4))
def test_mutated_files_only_raise_ckptconv_errors(seed: Path, steps: list[tuple[object, ...]]) -> None:
    exercise(mutate(seed.read_bytes(), steps), _FOLDER)


_OPCODES = sorted(
    set(
        b"(.0125FGIJKLMNPQRSTUVXabcdeghijlmopqrstu}])\x80\x81\x82\x85\x86\x87\x88\x89\x8a\x8c\x8d\x8e"
        b"\x8f\x90\x91\x92\x93\x94\x95\x96"
    )
)
_ARGUMENTS = [
    b"",
    b"\x00",
    b"\x01\x00\x00\x00",
    b"\xff\xff\xff\xff",
    b"0\n",
    b"os\nsystem\n",
    b"torch\nFloatStorage\n",
    b"collections\nOrderedDict\n",
    b"torch._utils\n_rebuild_tensor_v2\n",
    b"argparse\nNamespace\n",
    b"builtins\nset\n",
    b"'a'\n",
    b"\x05hello",
    b"\x02\x00",
    b"\x08" + b"\x00" * 7,
]


@FUZZ_SETTINGS
@given(st.lists(st.tuples(st.sampled_from(_OPCODES), st.sampled_from(_ARGUMENTS)), max_size=40))
def test_random_pickles_only_raise_ckptconv_errors(program: list[tuple[int, bytes]]) -> None:
    exercise_pickle(b"\x80\x02" + b"".join(bytes([op]) + argument for op, argument in program) + b".")


# Folder formats: a DCP .metadata pickle and a sharded index, mutated in a copy of a real checkpoint.
FOLDER_SETTINGS = settings(FUZZ_SETTINGS, max_examples=max(EXAMPLES // 10, 50))
_GPU = Path(__file__).resolve().parent.parent / "fixtures" / "gpu"


@FOLDER_SETTINGS
@given(st.lists(mutation, min_size=1, max_size=4))
def test_mutated_dcp_metadata_only_raises_ckptconv_errors(steps: list[tuple[object, ...]]) -> None:
    import shutil

    folder = _FOLDER / "dcp"
    if not folder.exists():
        shutil.copytree(_GPU / "fsdp2_dcp", folder)
    (folder / ".metadata").write_bytes(mutate((_GPU / "fsdp2_dcp" / ".metadata").read_bytes(), steps))
    exercise_path(folder, _FOLDER)


@FOLDER_SETTINGS
@given(st.lists(mutation, min_size=1, max_size=4))
def test_mutated_shard_index_only_raises_ckptconv_errors(steps: list[tuple[object, ...]]) -> None:
    import shutil

    folder = _FOLDER / "sharded"
    if not folder.exists():
        shutil.copytree(_GPU / "hf_sharded_safetensors", folder)
    index = "model.safetensors.index.json"
    (folder / index).write_bytes(mutate((_GPU / "hf_sharded_safetensors" / index).read_bytes(), steps))
    exercise_path(folder, _FOLDER)
