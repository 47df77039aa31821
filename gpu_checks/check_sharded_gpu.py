"""Proof on real GPUs that ckptconv's sharded and DCP outputs load in the tools that read them.

Run on a machine with two CUDA GPUs (and transformers installed), from the repository root:

    PYTHONPATH=. python gpu_checks/check_sharded_gpu.py

* transformers: the tiny GPT-2 in fixtures/gpu/hf_sharded_safetensors (written by
  ``save_pretrained``) is merged into one file, resharded, and written as ``.bin``
  shards by ckptconv; ``from_pretrained`` loads each on cuda:0 and its logits
  must equal those of the original folder.
* DCP: the FSDP2 fixture is converted to a DCP folder by ckptconv, then a real
  two-process FSDP2 job (NCCL) loads it with ``torch.distributed.checkpoint.load``
  into a sharded model; its outputs must equal the unsharded reference's.

Every line is one check; the exit code is the number of failures.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
sys.path.insert(0, str(ROOT))

import ckptconv  # noqa: E402 - after sys.path names this checkout

failures: list[str] = []  # the checks that failed
DEVICE = os.environ.get("CHECK_DEVICE", "cuda:0")  # "cpu" for a dry run of the transformers checks


def check(name: str, ok: bool, detail: str = "") -> None:
    if not ok:
        failures.append(name)
    print(f"{'PASS' if ok else 'FAIL'}  {name}" + (f"  ({detail})" if detail else ""), flush=True)


def transformers_checks(scratch: Path) -> None:
    from transformers import AutoModelForCausalLM

    original = FIXTURES / "gpu" / "hf_sharded_safetensors"
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (2, 16), device=DEVICE)
    reference = AutoModelForCausalLM.from_pretrained(original).to(DEVICE).eval()
    with torch.no_grad():
        expected = reference(tokens).logits

    layouts = {
        "merged into one model.safetensors": {"destination": "merged/"},
        "resharded at 20KB (safetensors + index)": {"destination": "reshard/", "max_shard_size": 20_000},
        "as pytorch_model-*.bin shards + index": {"destination": "bin/", "max_shard_size": 30_000, "to": "pt"},
        "via a canonical .pt, then written as a folder": {"destination": "roundtrip/", "canonical": True},
    }
    for name, options in layouts.items():
        try:
            folder = scratch / options.pop("destination")  # type: ignore[arg-type]
            source: Path = original
            if options.pop("canonical", False):
                middle = scratch / "canonical.pt"
                ckptconv.convert(original, middle, transforms=[ckptconv.Canonicalize()])
                source = middle
            report = ckptconv.convert(source, str(folder) + "/", verify=True, **options)  # type: ignore[arg-type]
            shutil.copy(original / "config.json", folder / "config.json")
            model = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=options.get("to") != "pt")
            model = model.to(DEVICE).eval()
            with torch.no_grad():
                logits = model(tokens).logits
            files = ", ".join(Path(f).name for f in report.files[:3]) + (" ..." if len(report.files) > 3 else "")
            check(f"transformers from_pretrained: {name}", torch.equal(logits, expected), files)
        except Exception:
            check(f"transformers from_pretrained: {name}", False, traceback.format_exc(limit=4).replace("\n", " | "))


FSDP_WORKER = r"""
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from ckptconv_fixture_models import TinyLM
rank = int(os.environ["RANK"])
gpu = os.environ.get("CHECK_DEVICE", "cuda:0") != "cpu"
if gpu:
    torch.cuda.set_device(rank)
dist.init_process_group("nccl" if gpu else "gloo")
device = torch.device(f"cuda:{rank}" if gpu else "cpu")
model = TinyLM(vocab_size=65, tie_weights=False).to(device)
fully_shard(model.block); fully_shard(model)
state = get_model_state_dict(model)
dcp.load(state, checkpoint_id=sys.argv[3])
set_model_state_dict(model, state)
reference = TinyLM(vocab_size=65, tie_weights=False)
reference.load_state_dict(torch.load(sys.argv[4], map_location="cpu", weights_only=True))
reference = reference.to(device).eval()
model.eval()
torch.manual_seed(1)
tokens = torch.randint(0, 65, (4, 16), device=device)
with torch.no_grad():
    out, expected = model(tokens), reference(tokens)
sharded = sum(1 for v in state.values() if type(v).__name__ == "DTensor")
ok = torch.tensor([int(torch.equal(out, expected))], device=device)
dist.all_reduce(ok)
if rank == 0:
    print("FSDPRESULT", int(ok.item()), sharded, flush=True)
dist.destroy_process_group()
"""


def dcp_checks(scratch: Path) -> None:
    sources = {
        "FSDP2 full state dict -> ckptconv DCP": FIXTURES / "gpu" / "fsdp2_full_state_dict.pt",
        "FSDP2's own DCP folder -> safetensors -> ckptconv DCP": FIXTURES / "gpu" / "fsdp2_dcp",
    }
    worker = scratch / "fsdp_worker.py"
    worker.write_text(FSDP_WORKER)
    reference = FIXTURES / "gpu" / "fsdp2_full_state_dict.pt"
    for index, (name, source) in enumerate(sources.items()):
        try:
            single = source
            if source.is_dir():
                single = scratch / f"middle{index}.safetensors"
                ckptconv.convert(source, single)
            out = scratch / f"dcp{index}"
            ckptconv.convert(single, out, to="dcp", verify=True)
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29611 + index), "WORLD_SIZE": "2"}
            processes = [
                subprocess.Popen(
                    [sys.executable, str(worker), str(ROOT), str(FIXTURES), str(out), str(reference)],
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for rank in range(2)
            ]
            outputs = [p.communicate(timeout=300) for p in processes]
            line = next((text for text in outputs[0][0].splitlines() if text.startswith("FSDPRESULT")), "")
            ok = line.split()[1:2] == ["2"] and all(p.returncode == 0 for p in processes)
            detail = (
                f"{line.split()[2]} DTensor parameters loaded on 2 ranks, outputs equal"
                if ok
                else (outputs[0][1] + outputs[1][1])[-600:].replace("\n", " | ")
            )
            check(f"torch.distributed.checkpoint.load into FSDP2 on 2 GPUs: {name}", ok, detail)
        except Exception:
            check(name, False, traceback.format_exc(limit=4).replace("\n", " | "))


def main() -> int:
    gpus = torch.cuda.device_count()
    print(f"torch {torch.__version__}, {gpus} x {torch.cuda.get_device_name(0) if gpus else 'no GPU'}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        transformers_checks(Path(scratch))
        if gpus >= 2 or DEVICE == "cpu":
            dcp_checks(Path(scratch))
    print(f"{len(failures)} failures", flush=True)
    return len(failures)


if __name__ == "__main__":
    sys.exit(main())
