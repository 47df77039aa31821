#!/usr/bin/env python3
"""On a GPU: what ckptconv merges from each training run loads ``strict=True`` into the
single-GPU model and gives the same outputs as the framework's own consolidation.

    PYTHONPATH=. python3 gpu_checks/check_training_runs.py fixtures/runs   # megatron-core optional

For every DeepSpeed, FSDP1 SHARDED_STATE_DICT and FSDP2 fixture: ``ckptconv.load(run)`` goes into a fresh
``TinyRunModel`` on cuda:0 with ``strict=True``; its logits on a fixed batch are
compared with the same model loaded from the golden (for ZeRO-1, whose golden
lacks the frozen layer, the golden plus the module's frozen weights). For the
Megatron fixture, the merged and renamed state dict goes into a TP=1 GPTModel.
FSDP1 LOCAL_STATE_DICT (no shapes in the files) must be refused.
Prints one JSON line per run; exits 1 if any check fails.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "fixtures"))

import make_training_run_fixtures as gen  # noqa: E402

import ckptconv  # noqa: E402


def logits(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(gen.probe(device)).float().cpu()


def check_tiny(run: Path, device: torch.device) -> dict:
    ours = ckptconv.load(run)
    golden_name = "golden_full.pt" if (run / "golden_full.pt").exists() else "golden_fp32.pt"
    golden = torch.load(run / golden_name, map_location="cpu", weights_only=True)
    if run.name.startswith("ds_zero1"):
        module = torch.load(run / "golden_module.pt", map_location="cpu", weights_only=True)
        golden = {**golden, **{k: module[k] for k in ("frozen.weight", "frozen.bias")}}
    bf16 = run.name.endswith("_bf16") and run.name.startswith("fsdp")
    model_ours = gen.TinyRunModel().to(device)
    model_ref = gen.TinyRunModel().to(device)
    if bf16:
        model_ours, model_ref = model_ours.to(torch.bfloat16), model_ref.to(torch.bfloat16)
    model_ours.load_state_dict(ours, strict=True)
    model_ref.load_state_dict(golden, strict=True)
    a, b = logits(model_ours, device), logits(model_ref, device)
    return {
        "strict_load": "ok",
        "outputs_identical": bool(torch.equal(a, b)),
        "max_abs_diff": float((a - b).abs().max()),
    }


def check_refused(run: Path) -> dict:
    """FSDP1 LOCAL_STATE_DICT does not record the parameters' shapes: ckptconv must refuse it."""
    try:
        ckptconv.load(run)
    except ckptconv.CkptconvError as exc:
        return {"refused": str(exc)}
    return {"refused": False}


def check_megatron(run: Path, device: torch.device) -> dict:
    import re

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29655")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    ours = ckptconv.load(run)
    ours = {
        re.sub(
            r"self_attention\.linear_qkv\.layer_norm_",
            "input_layernorm.",
            re.sub(r"mlp\.linear_fc1\.layer_norm_", "pre_mlp_layernorm.", k),
        ): v
        for k, v in ours.items()
    }
    golden = torch.load(run / "golden_full.pt", map_location="cpu", weights_only=True)
    model_ours = gen.megatron_model(1).to(device)
    model_ours.load_state_dict(ours, strict=False)
    missing = [k for k in model_ours.state_dict() if k not in ours and not k.endswith("_extra_state")]
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    position_ids = torch.arange(16, device=device).unsqueeze(0).expand(2, -1)
    model_ours.eval()
    with torch.no_grad():
        a = model_ours(tokens, position_ids, None).float().cpu()
    model_ours.load_state_dict(golden, strict=False)  # Megatron's own loader's result, same model
    with torch.no_grad():
        b = model_ours(tokens, position_ids, None).float().cpu()
    return {
        "strict_load": "ok" if not missing else f"missing {missing}",
        "outputs_identical": bool(torch.equal(a, b)),
        "max_abs_diff": float((a - b).abs().max()),
    }


def main() -> None:
    root = Path(sys.argv[1])
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    failed = False
    for run in sorted(p for p in root.iterdir() if p.is_dir()):
        if run.name.startswith("ds_zero1_bf16_fp32accum"):
            continue
        try:
            if run.name == "fsdp1_local":
                result = check_refused(run)
            elif run.name.startswith("megatron"):
                result = check_megatron(run, device)
            else:
                result = check_tiny(run, device)
        except Exception:
            result = {"error": traceback.format_exc()[-1500:]}
        ok = bool(result.get("refused")) or (result.get("strict_load") == "ok" and result.get("outputs_identical"))
        failed |= not ok
        print(json.dumps({"run": run.name, **result}), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
