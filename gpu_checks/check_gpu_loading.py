"""Proof on real GPUs that converted checkpoints load where users need them.

Run on a machine with two CUDA GPUs, from the repository root:

    PYTHONPATH=. python gpu_checks/check_gpu_loading.py

It converts the GPU-saved fixtures (DataParallel, DDP, torch.compile, FSDP1,
FSDP2, Lightning, timm-style EMA) with ckptconv and loads each result, with
``strict=True``, into

* a plain model on one GPU,
* ``nn.DataParallel`` over both GPUs,
* ``DistributedDataParallel`` in two processes over NCCL,

through ``ckptconv.load_into``; then compares every forward pass with the
model loaded the old way (``torch.load(weights_only=False)`` of the original
file, keys renamed by hand). It also checks ``device="cuda:1"`` and
``device="auto"``, and that ``CUDA_VISIBLE_DEVICES`` is honoured.
Every line of output is one check; the exit code is the number of failures.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
sys.path.insert(0, str(FIXTURES))
sys.path.insert(0, str(ROOT))

from ckptconv_fixture_models import TinyCNN, TinyLM  # noqa: E402 - after sys.path names fixtures/

import ckptconv  # noqa: E402 - after sys.path names this checkout

torch.backends.cudnn.deterministic = True
torch.backends.cudnn.benchmark = False

# fixture -> (model factory, where the weights are, prefix to strip by hand for the reference)
CASES: dict[str, tuple[Callable[[], nn.Module], str | None, str]] = {
    "dataparallel_state_dict.pkl": (TinyCNN, None, "module."),
    "ddp_rank0.pt": (TinyCNN, None, "module."),
    "compiled_state_dict.pt": (TinyCNN, None, "_orig_mod."),
    "compiled_over_dataparallel.pt": (TinyCNN, None, "_orig_mod.module."),
    "dataparallel_over_compiled.pt": (TinyCNN, None, "module._orig_mod."),
    "lightning.ckpt": (TinyCNN, "state_dict", "model."),
    "timm_style_ema.pth.tar": (TinyCNN, "state_dict_ema", ""),
    "fsdp1_full_state_dict.pt": (lambda: TinyLM(tie_weights=False), None, ""),
    "fsdp2_full_state_dict.pt": (lambda: TinyLM(vocab_size=65, tie_weights=False), None, ""),
}

failures: list[str] = []  # the checks that failed


def check(name: str, ok: bool, detail: str = "") -> None:
    if not ok:
        failures.append(name)
    print(f"{'PASS' if ok else 'FAIL'}  {name}" + (f"  ({detail})" if detail else ""), flush=True)


def reference_model(fixture: str, device: str) -> nn.Module:
    """The model loaded the old way: torch.load of the trusted original, keys renamed by hand."""
    factory, where, prefix = CASES[fixture]
    obj = torch.load(FIXTURES / "gpu" / fixture, map_location="cpu", weights_only=False)
    state = obj[where] if where else obj
    state = {k[len(prefix) :] if prefix and k.startswith(prefix) else k: v for k, v in state.items()}
    model = factory()
    model.load_state_dict(state, strict=True)
    return model.to(device).eval()


def sample_input(model: nn.Module, device: str) -> torch.Tensor:
    torch.manual_seed(1)
    if isinstance(model, TinyCNN) or isinstance(getattr(model, "module", None), TinyCNN):
        return torch.randn(8, 3, 16, 16, device=device)
    return torch.randint(0, 64, (8, 16), device=device)


def same_outputs(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, str]:
    if torch.equal(a, b):
        return True, "outputs bit-identical"
    diff = (a.double() - b.double()).abs().max().item()
    return diff <= 1e-5, f"max abs difference {diff:.3g}"


def converted(fixture: str, folder: Path) -> Path:
    """The fixture converted by ckptconv: canonical names, safetensors."""
    _, where, _ = CASES[fixture]
    out = folder / (fixture.split(".", maxsplit=1)[0] + ".safetensors")
    if not out.exists():
        transforms: list[Any] = [ckptconv.Canonicalize()]
        if fixture == "lightning.ckpt":
            transforms.append(ckptconv.StripPrefix("model"))
        ckptconv.convert(FIXTURES / "gpu" / fixture, out, select=where, transforms=transforms, verify=True)
    return out


def single_and_dataparallel(folder: Path) -> None:
    for fixture in CASES:
        try:
            path = converted(fixture, folder)
            factory = CASES[fixture][0]
            reference = reference_model(fixture, "cuda:0")
            x = sample_input(reference, "cuda:0")
            with torch.no_grad():
                expected = reference(x)

            plain = factory().to("cuda:0").eval()
            report = ckptconv.load_into(plain, path, strict=True, device="auto")
            with torch.no_grad():
                ok, detail = same_outputs(plain(x), expected)
            check(f"{fixture} -> single GPU model (load_into strict, device=auto)", report.ok and ok, detail)

            dp = nn.DataParallel(factory().to("cuda:0"), device_ids=[0, 1]).eval()
            report = ckptconv.load_into(dp, path, strict=True)
            with torch.no_grad():
                ok, detail = same_outputs(dp(x), expected)
            check(f"{fixture} -> DataParallel over cuda:0,1 ({'; '.join(report.plan)})", report.ok and ok, detail)

            # The original, wrapped file straight into the plain model too (keys fitted on load).
            direct = factory().to("cuda:0").eval()
            report = ckptconv.load_into(direct, FIXTURES / "gpu" / fixture, select=CASES[fixture][1])
            with torch.no_grad():
                ok, detail = same_outputs(direct(x), expected)
            check(
                f"{fixture} (original file) -> single GPU ({'; '.join(report.plan) or 'no change'})",
                report.ok and ok,
                detail,
            )
        except Exception:
            check(f"{fixture}", False, traceback.format_exc(limit=3).replace("\n", " | "))


DDP_WORKER = r"""
import os, sys, torch, torch.distributed as dist, torch.nn as nn
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])
import ckptconv
from ckptconv_fixture_models import TinyCNN, TinyLM
torch.backends.cudnn.deterministic = True
rank = int(os.environ["RANK"]); torch.cuda.set_device(rank)
dist.init_process_group("nccl")
path, kind, expected_path = sys.argv[3], sys.argv[4], sys.argv[5]
factory = {
    "cnn": TinyCNN,
    "lm64": lambda: TinyLM(tie_weights=False),
    "lm65": lambda: TinyLM(vocab_size=65, tie_weights=False),
}[kind]
model = nn.parallel.DistributedDataParallel(factory().to(rank), device_ids=[rank]).eval()
report = ckptconv.load_into(model, path, strict=True, device="auto")
torch.manual_seed(1)
x = torch.randn(8, 3, 16, 16, device=rank) if kind == "cnn" else torch.randint(0, 64, (8, 16), device=rank)
with torch.no_grad():
    out = model(x)
expected = torch.load(expected_path, map_location=f"cuda:{rank}")
ok = report.ok and (torch.equal(out, expected) or (out.double() - expected.double()).abs().max().item() <= 1e-5)
flags = torch.tensor([int(ok)], device=rank)
dist.all_reduce(flags)
if rank == 0:
    print("DDPRESULT", int(flags.item()), "; ".join(report.plan), flush=True)
dist.destroy_process_group()
"""


def distributed(folder: Path) -> None:
    worker = folder / "ddp_worker.py"
    worker.write_text(DDP_WORKER)
    for fixture in CASES:
        try:
            path = converted(fixture, folder)
            kind = "cnn" if CASES[fixture][0] is TinyCNN else ("lm65" if "fsdp2" in fixture else "lm64")
            reference = reference_model(fixture, "cuda:0")
            x = sample_input(reference, "cuda:0")
            with torch.no_grad():
                expected = reference(x)
            expected_path = folder / "expected.pt"
            torch.save(expected.cpu(), expected_path)
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "WORLD_SIZE": "2"}
            processes = [
                subprocess.Popen(
                    [sys.executable, str(worker), str(ROOT), str(FIXTURES), str(path), kind, str(expected_path)],
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for rank in range(2)
            ]
            outputs = [p.communicate(timeout=240) for p in processes]
            line = next((text for text in outputs[0][0].splitlines() if text.startswith("DDPRESULT")), "")
            ok = line.split()[1:2] == ["2"] and all(p.returncode == 0 for p in processes)
            detail = " ".join(line.split()[2:]) or outputs[0][1][-300:].replace("\n", " | ")
            check(f"{fixture} -> DDP, 2 processes, NCCL (both ranks' outputs match)", ok, detail)
        except Exception:
            check(f"{fixture} DDP", False, traceback.format_exc(limit=3).replace("\n", " | "))


def devices(folder: Path) -> None:
    path = converted("fsdp2_full_state_dict.pt", folder)
    cpu = ckptconv.load(path)
    on1 = ckptconv.load(path, device="cuda:1")
    check(
        "load(device='cuda:1') puts every tensor on cuda:1",
        all(t.device == torch.device("cuda:1") for t in on1.values()),
    )
    check("load(device='cuda:1') equals the CPU load bit for bit", all(torch.equal(on1[k].cpu(), cpu[k]) for k in cpu))
    hog = torch.empty(int(20e9), dtype=torch.uint8, device="cuda:0")  # make cuda:1 the emptier GPU
    auto = ckptconv.load(path, device="auto")
    check(
        "device='auto' picks the GPU with the most free memory (cuda:1 while cuda:0 holds 20 GB)",
        {str(t.device) for t in auto.values()} == {"cuda:1"},
    )
    del hog
    torch.cuda.empty_cache()
    listing = subprocess.run(
        [sys.executable, "-m", "ckptconv", "inspect", "--devices"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    print(listing.stdout.rstrip())
    check("ckptconv inspect --devices lists two GPUs", listing.stdout.count("cuda:") == 2)
    hidden = subprocess.run(
        [sys.executable, "-m", "ckptconv", "inspect", "--devices"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "1"},
        check=False,
    )
    print(hidden.stdout.rstrip())
    check(
        "with CUDA_VISIBLE_DEVICES=1 the one visible GPU is cuda:0 = physical 1",
        hidden.stdout.startswith("cuda:0  physical 1"),
    )
    out = folder / "roundtrip.pt"
    ckptconv.save(on1, out)
    loaded = torch.load(out, weights_only=True)
    check("saving GPU tensors writes a CPU-tagged file", all(t.device.type == "cpu" for t in loaded.values()))


def main() -> int:
    print(f"torch {torch.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        single_and_dataparallel(folder)
        distributed(folder)
        devices(folder)
    print(f"{len(failures)} failures", flush=True)
    return len(failures)


if __name__ == "__main__":
    sys.exit(main())
