"""Benchmark: merge-lora against PEFT's merge_and_unload() + save_pretrained(), side by side.

    python bench/bench_merge_lora.py                     # a 12-layer 2048-wide Llama in bf16 (~1.6 GB), r=16
    python bench/bench_merge_lora.py --layers 4 --runs 1

Builds a Llama base model folder (bf16, 1 GB shards) and a LoRA adapter on every linear layer (random A and B)
once, then times each approach, each in a fresh process: its wall time and peak RSS (GNU time). PEFT's is the
reference workflow: from_pretrained(base, dtype=bfloat16), PeftModel.from_pretrained, merge_and_unload(),
save_pretrained(out). Both outputs are then compared tensor by tensor (torch.equal).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable

BUILD = textwrap.dedent(
    """
    import sys, torch, transformers, peft
    layers, hidden, folder = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                      num_hidden_layers=layers, num_attention_heads=hidden // 128,
                                      num_key_value_heads=hidden // 128, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder + "/base", max_shard_size="1GB")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets))
    with torch.no_grad():
        for key, parameter in wrapped.named_parameters():
            if "lora_" in key:
                parameter.normal_(0, 0.02)
    wrapped.save_pretrained(folder + "/adapter")
    """
)

PEFT = textwrap.dedent(
    """
    import sys, torch, transformers, peft
    base, adapter, out = sys.argv[1:4]
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    merged = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(out, max_shard_size="1GB")
    """
)

CHECK = textwrap.dedent(
    """
    import sys, os, torch
    from safetensors.torch import load_file
    def read(folder):
        state = {}
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                state.update(load_file(os.path.join(folder, name)))
        return state
    a, b = read(sys.argv[1]), read(sys.argv[2])
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    print("identical", len(a), "tensors")
    """
)


def run(argv: list[str], cwd: Path) -> tuple[float, int]:
    """Wall seconds and peak RSS bytes of one run (GNU time: a child of this process would inherit its peak)."""
    rss_file = cwd / "rss.txt"
    os.sync()
    start = time.perf_counter()
    process = subprocess.run(
        ["/usr/bin/time", "-f", "%M", "-o", str(rss_file), *argv],
        check=False,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(HERE.parent)},
    )
    wall = time.perf_counter() - start
    if process.returncode != 0:
        raise SystemExit(f"{argv[:4]} failed: {process.stderr.decode()[-2000:]}")
    return wall, int(rss_file.read_text().split()[-1]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "ckptconv-bench-lora")
    args = parser.parse_args()
    if not shutil.which("time") and not os.path.exists("/usr/bin/time"):
        raise SystemExit("needs GNU time (/usr/bin/time) for the peak RSS")
    marker = args.dir / f"built-{args.layers}-{args.hidden}"
    if not marker.exists():
        shutil.rmtree(args.dir, ignore_errors=True)
        args.dir.mkdir(parents=True)
        subprocess.run([PYTHON, "-c", BUILD, str(args.layers), str(args.hidden), str(args.dir)], check=True)
        marker.touch()
    base, adapter = args.dir / "base", args.dir / "adapter"
    size = sum(path.stat().st_size for path in base.glob("*.safetensors"))
    cases = {
        "ckptconv merge-lora": [
            PYTHON,
            "-m",
            "ckptconv",
            "merge-lora",
            str(base),
            str(adapter),
            "OUT/",
            "-q",
            "--no-fsync",
            "--no-source-hash",
            "--max-shard-size",
            "1GB",
        ],
        "PEFT merge_and_unload + save_pretrained": [PYTHON, "-c", PEFT, str(base), str(adapter), "OUT"],
    }
    results: dict[str, list[tuple[float, int]]] = {name: [] for name in cases}
    for round_number in range(args.runs):
        for index, (name, argv) in enumerate(cases.items()):
            out = args.dir / f"out{index}"
            shutil.rmtree(out, ignore_errors=True)
            results[name].append(
                run([str(out) if a == "OUT" else str(out) + "/" if a == "OUT/" else a for a in argv], args.dir)
            )
            print(f"round {round_number + 1}: {name}: {results[name][-1][0]:.1f} s", file=sys.stderr)
    outputs = [str(args.dir / "out0"), str(args.dir / "out1")]
    check = subprocess.run([PYTHON, "-c", CHECK, *outputs], check=False, capture_output=True)
    verdict = check.stdout.decode().strip() or check.stderr.decode().strip().splitlines()[-1]
    print(f"base: {args.layers} layers, hidden {args.hidden}, {size / 2**30:.2f} GiB bf16; adapter r=16 on 7 linears")
    print(f"| approach | wall (median of {args.runs}) | peak RSS | RSS / base size |")
    print("|---|---|---|---|")
    for name, values in results.items():
        wall = statistics.median(v[0] for v in values)
        rss = max(v[1] for v in values)
        print(f"| {name} | {wall:.1f} s | {rss / 2**30:.2f} GiB | {rss / size:.2f} |")
    print(f"outputs: {verdict}")


if __name__ == "__main__":
    main()
