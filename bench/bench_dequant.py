"""Dequantizing an fp8 block-scaled folder to bf16: ckptconv against a plain cast and against transformers.

Builds (or reuses) a DeepSeek-V3-layout model folder of ``--gib`` GiB of float8_e4m3fn weights with a
float32 ``weight_scale_inv`` per 128x128 block, as a Llama ``config.json`` with
``quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}`` declares it, and a second
folder with the same bytes as plain float8 (no scales, no declaration). Then, each in a fresh process,
side by side, ``--runs`` rounds in a shuffled order:

* ``ckptconv dequant``: ``ckptconv convert fp8/ out/ --dtype bf16 --no-fsync`` (dequantized exactly);
* ``ckptconv plain cast``: ``ckptconv convert plain/ out/ --dtype bf16 --no-fsync`` (the same bytes cast);
* ``transformers``: ``AutoModelForCausalLM.from_pretrained(fp8, quantization_config=FineGrainedFP8Config(
  dequantize=True))`` then ``save_pretrained`` (the path users take today), unless ``--no-transformers``.

Prints wall time and peak RSS (``ru_maxrss`` of the child) per approach, medians, and the ratios the
issue asks for; checks that ckptconv's output equals transformers' dequantization, tensor by tensor.

    python bench/bench_dequant.py --gib 4 --runs 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HIDDEN = 4096
INTERMEDIATE = 11008


def build(root: Path, gib: float) -> tuple[Path, Path]:
    import torch
    from safetensors.torch import save_file

    fp8, plain = root / "fp8", root / "plain"
    if (fp8 / "config.json").exists() and (plain / "config.json").exists():
        return fp8, plain
    per_layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE  # q, k, v, o + gate, up, down: one byte each
    layers = max(1, round(gib * (1 << 30) / per_layer))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 1024,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    generator = torch.Generator().manual_seed(0)
    for folder in (fp8, plain):
        folder.mkdir(parents=True, exist_ok=True)
    weight_map_fp8: dict[str, str] = {}
    weight_map_plain: dict[str, str] = {}
    shapes = {
        "self_attn.q_proj": (HIDDEN, HIDDEN),
        "self_attn.k_proj": (HIDDEN, HIDDEN),
        "self_attn.v_proj": (HIDDEN, HIDDEN),
        "self_attn.o_proj": (HIDDEN, HIDDEN),
        "mlp.gate_proj": (INTERMEDIATE, HIDDEN),
        "mlp.up_proj": (INTERMEDIATE, HIDDEN),
        "mlp.down_proj": (HIDDEN, INTERMEDIATE),
    }
    for layer in range(layers):
        quantized: dict[str, torch.Tensor] = {}
        cast: dict[str, torch.Tensor] = {}
        for module, (rows, cols) in shapes.items():
            name = f"model.layers.{layer}.{module}"
            weight = (torch.randn(rows, cols, generator=generator) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
            scale = torch.rand(-(-rows // 128), -(-cols // 128), generator=generator) / 1000
            quantized[f"{name}.weight"] = weight
            quantized[f"{name}.weight_scale_inv"] = scale
            cast[f"{name}.weight"] = weight
        for norm in ("input_layernorm", "post_attention_layernorm"):
            quantized[f"model.layers.{layer}.{norm}.weight"] = cast[f"model.layers.{layer}.{norm}.weight"] = torch.ones(
                HIDDEN, dtype=torch.bfloat16
            )
        shard = f"model-{layer + 1:05d}-of-{layers + 1:05d}.safetensors"
        save_file(quantized, str(fp8 / shard))
        save_file(cast, str(plain / shard))
        weight_map_fp8.update(dict.fromkeys(quantized, shard))
        weight_map_plain.update(dict.fromkeys(cast, shard))
    last = f"model-{layers + 1:05d}-of-{layers + 1:05d}.safetensors"
    rest = {
        "model.embed_tokens.weight": torch.randn(1024, HIDDEN, generator=generator).to(torch.bfloat16),
        "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(1024, HIDDEN, generator=generator).to(torch.bfloat16),
    }
    for folder, weight_map in ((fp8, weight_map_fp8), (plain, weight_map_plain)):
        save_file(rest, str(folder / last))
        weight_map.update(dict.fromkeys(rest, last))
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    fp8_config = dict(config)
    fp8_config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.embed_tokens"],
    }
    (fp8 / "config.json").write_text(json.dumps(fp8_config))
    (plain / "config.json").write_text(json.dumps(config))
    return fp8, plain


TRANSFORMERS = """
import sys, torch
from transformers import AutoModelForCausalLM, FineGrainedFP8Config
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], quantization_config=FineGrainedFP8Config(dequantize=True),
                                             dtype=torch.bfloat16, device_map="cpu")
model.save_pretrained(sys.argv[2])
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--root", default="/tmp/bench_dequant")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(f"seed {seed}")
    root = Path(args.root) / f"{args.gib:g}gib"
    fp8, plain = build(root, args.gib)
    # One folder per approach: the check below reads the dequantized output, whichever ran last.
    out, cast_out = root / "out", root / "cast_out"
    approaches = {
        "ckptconv dequant": (
            ["convert", str(fp8), str(out) + "/", "--dtype", "bf16", "--no-fsync", "--overwrite", "-q"],
            None,
        ),
        "ckptconv plain cast": (
            ["convert", str(plain), str(cast_out) + "/", "--dtype", "bf16", "--no-fsync", "--overwrite", "-q"],
            None,
        ),
    }
    if not args.no_transformers:
        approaches["transformers"] = ([str(fp8), str(root / "hf_out")], TRANSFORMERS)
    times: dict[str, list[float]] = {name: [] for name in approaches}
    peaks: dict[str, list[int]] = {name: [] for name in approaches}
    rng = random.Random(seed)
    for _ in range(args.runs):
        order = list(approaches)
        rng.shuffle(order)
        for name in order:
            argv, code = approaches[name]
            # A wrapper per run reports its child's peak (RUSAGE_CHILDREN here would be the largest child so far).
            wrapper = [
                sys.executable,
                "-c",
                "import resource,subprocess,sys;subprocess.run(sys.argv[1:],check=True,"
                "stdout=subprocess.DEVNULL);print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)",
            ]
            command = [sys.executable, "-m", "ckptconv", *argv] if code is None else [sys.executable, "-c", code, *argv]
            started = time.perf_counter()
            result = subprocess.run([*wrapper, *command], check=True, capture_output=True, text=True)
            times[name].append(time.perf_counter() - started)
            peaks[name].append(int(result.stdout.split()[-1]))
    gib = sum(f.stat().st_size for f in fp8.glob("*.safetensors")) / (1 << 30)
    print(f"fp8 folder: {gib:.2f} GiB on disk; {args.runs} runs each, fresh processes, warm page cache")
    print(f"{'approach':<22} {'median s':>9} {'best s':>8} {'peak RSS MiB':>13}")
    for name in approaches:
        median, best, peak = statistics.median(times[name]), min(times[name]), max(peaks[name]) / 1024
        print(f"{name:<22} {median:>9.2f} {best:>8.2f} {peak:>13.0f}")
    dequant, cast = statistics.median(times["ckptconv dequant"]), statistics.median(times["ckptconv plain cast"])
    print(f"dequant / plain cast: {dequant / cast:.2f}x (target <= 2x)")
    if "transformers" in times:
        hf = statistics.median(times["transformers"])
        print(f"transformers / dequant: {hf / dequant:.1f}x faster (target >= 10x)")
        share = max(peaks["transformers"]) / max(peaks["ckptconv dequant"])
        print(f"peak memory dequant / transformers: 1/{share:.0f} (target <= 1/20)")
        check(root / "hf_out", out)


def check(reference: Path, ours: Path) -> None:
    """ckptconv's dequantized tensors equal transformers' own, bit for bit."""
    import torch
    from safetensors import safe_open

    theirs: dict[str, Path] = {}
    for shard in reference.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as file:
            theirs.update(dict.fromkeys(file.keys(), shard))
    compared = 0
    for shard in ours.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as file:
            for key in file.keys():  # noqa: SIM118 - safe_open is no dict
                if key in theirs:
                    with safe_open(str(theirs[key]), "pt") as other:
                        a, b = file.get_tensor(key), other.get_tensor(key)
                    assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), key
                    compared += 1
    print(f"checked: {compared} tensors bit-equal to transformers' dequantization")


if __name__ == "__main__":
    main()
