"""Write the seed corpus for the fuzz tests: small valid checkpoints of every format, and hostile ones.

Run from the repository root: ``python tests/fuzz/make_corpus.py``. The files are
committed under ``tests/fuzz/corpus/``; ``tests/test_fuzz.py`` mutates them and
also runs every one through the CLI.
"""

from __future__ import annotations

import io
import json
import pickle
import struct
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.hostile import CONTAINERS, ROUTES

CORPUS = Path(__file__).resolve().parent / "corpus"


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    big = torch.randn(4, 3)
    return {
        "module.w": big,
        "module.view": big[1:3, ::2],
        "module.tied": big,
        "i64": torch.arange(3),
        "bf16": torch.ones(2, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 2),
    }


def _saved(obj: object, **kwargs: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, **kwargs)  # type: ignore[arg-type]
    return buffer.getvalue()


def main() -> None:
    CORPUS.mkdir(exist_ok=True)
    for old in CORPUS.iterdir():
        old.unlink()
    files: dict[str, bytes] = {}
    state = _state()
    files["zip_state_dict.pt"] = _saved(state)
    files["zip_training.pth"] = _saved(
        {
            "epoch": 1,
            "state_dict": OrderedDict(state),
            "ema": {"w": torch.ones(2)},
            "rng": np.random.RandomState(0).get_state()[1][:4],
            "lr": [0.1, 1e-3],
        }
    )
    deflated = io.BytesIO()
    with (
        zipfile.ZipFile(io.BytesIO(files["zip_state_dict.pt"])) as old,
        zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as new,
    ):
        for info in old.infolist():
            new.writestr(info.filename, old.read(info))
    files["zip_deflated.pt"] = deflated.getvalue()
    files["legacy.pt"] = _saved(
        {"w": torch.arange(4.0), "v": torch.arange(4.0)[1:]}, _use_new_zipfile_serialization=False
    )
    files["numpy_p2.pkl"] = pickle.dumps({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(2, ">f8")}, 2)
    files["numpy_p5.pkl"] = pickle.dumps(
        {"model": {"w": np.arange(4, dtype=np.int64)}, "set": {1, 2}, "t": (1, "a")}, 5
    )
    header = json.dumps(
        {
            "__metadata__": {"format": "pt", "ckptconv.aliases": '{"b": "a"}'},
            "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
            "c": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]},
        }
    ).encode()
    files["aliases.safetensors"] = struct.pack("<Q", len(header)) + header + bytes(range(22))
    for route in ("GLOBAL+REDUCE", "NEWOBJ+BUILD __setstate__", "persistent id", "EXT1", "getattr chain"):
        slug = route.split("+")[0].split()[0].lower()
        for container, build in CONTAINERS.items():
            tag = container.replace(",", "").replace(" ", "_")
            suffix = ".pkl" if container.startswith("raw") else ".pt"
            files[f"hostile_{slug}_{tag}{suffix}"] = build(ROUTES[route])
    # Resource and crash regressions (see tests/test_limits.py, tests/test_unpickler.py).
    st_header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    files["limit_header_2_63.safetensors"] = struct.pack("<Q", 2**63) + st_header + bytes(4)
    files["limit_overlap.safetensors"] = (
        struct.pack("<Q", 116)
        + json.dumps(
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            }
        )
        .encode()
        .ljust(116)
        + bytes(12)
    )
    files["crash_deep_tuple_in_set.pkl"] = b"\x80\x02cbuiltins\nset\n(" + b")" + b"\x85" * 100_000 + b"l\x85R."
    files["limit_memoised_list_to_set.pkl"] = (
        b"\x80\x02(" + b"N" * 100_000 + b"l\x94cbuiltins\nset\n\x94" + b"h\x01h\x00\x85R0" * 20_000 + b"N."
    )
    for name, data in files.items():
        (CORPUS / name).write_bytes(data)
    print(f"wrote {len(files)} files, {sum(map(len, files.values()))} bytes, to {CORPUS}")


if __name__ == "__main__":
    main()
