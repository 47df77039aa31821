"""The commands about PEFT adapters: merge-lora, extract-lora."""

from __future__ import annotations

from typing import Any

import click

from ckptconv.cli.converting import run_conversion
from ckptconv.cli.failures import Command
from ckptconv.cli.option_sets import compose, sections


@click.command("merge-lora", cls=Command)
@compose(
    click.argument("base", type=click.Path(dir_okay=True)),
    click.argument("adapter", type=click.Path(dir_okay=True)),
    click.argument("out", type=click.Path(dir_okay=True)),
    sections(
        "merge-lora",
        {
            "Adapter": [
                click.option(
                    "--adapter",
                    "more_adapters",
                    multiple=True,
                    metavar="ADAPTER",
                    help="Another adapter folder, merged after ADAPTER, into its result (as PEFT merges several "
                    "active adapters, one after another). Repeatable.",
                ),
                click.option(
                    "--weight",
                    "weights",
                    multiple=True,
                    type=float,
                    metavar="W",
                    help="One weight per adapter, in order: the adapters are combined as PEFT's "
                    "add_weighted_adapter(..., combination_type='cat') does, and that adapter is merged. Repeatable.",
                ),
            ]
        },
    ),
)
def merge_lora(
    base: str, adapter: str, out: str, more_adapters: tuple[str, ...], weights: tuple[float, ...], **options: Any
) -> None:
    """Merge a PEFT LoRA adapter into its base model, bit for bit as PEFT's merge_and_unload().

    BASE is a model folder (sharded or not, safetensors or .bin) or a checkpoint
    file; ADAPTER a PEFT adapter folder (adapter_config.json and
    adapter_model.safetensors or .bin); OUT a model folder (configs carried)
    or a file. LoRA, rsLoRA, DoRA, GPT-2's Conv1D (fan_in_fan_out), LoRA and
    DoRA on embeddings, LoRA on convolutions, rank_pattern/alpha_pattern,
    modules_to_save, lora_bias and target_parameters on fused experts the
    base file holds are merged exactly as PEFT does on the CPU (needs
    torch); other settings are
    refused in one line. The merge streams one base tensor at a time, in the
    base's dtype; --dtype casts after it. The output records each adapter's
    sha256 and scaling.

    \b
    Example:
      ckptconv merge-lora llama/ my_adapter/ merged/
      ckptconv merge-lora llama/ my_adapter/ merged/ --dtype bf16 --max-shard-size 5GB
      ckptconv merge-lora llama/ a/ merged/ --adapter b/ --weight 0.7 --weight 0.3
    """
    from ckptconv.adapters.merging import merge_lora as merge

    adapters = [adapter, *more_adapters]

    def run(src: str, dst: str, **how: Any) -> Any:
        return merge(src, adapters, dst, weights=list(weights) if weights else None, **how)

    run_conversion(base, out, [], options, run=run)


@click.command("extract-lora", cls=Command)
@click.argument("run", type=click.Path(dir_okay=True))
@click.argument("out", type=click.Path(dir_okay=True))
@click.option(
    "--base", required=True, metavar="BASE", help="The base model (folder or file) the adapter was trained on."
)
@click.option(
    "--alpha",
    type=click.FloatRange(min=0, min_open=True),
    help="lora_alpha (not in the tensors): needed unless an adapter_config.json lies beside RUN.",
)
@click.option("--rslora", is_flag=True, default=None, help="The adapter was trained with rsLoRA (alpha / sqrt(r)).")
@click.option("--adapter-name", metavar="NAME", help="Which adapter, when RUN holds several (e.g. 'default').")
@click.option("--select", metavar="PATH", help="Where the weights are in RUN (searched when omitted).")
@click.option("--overwrite", is_flag=True, help="Replace OUT's adapter files if they exist.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
def extract_lora(
    run: str,
    out: str,
    base: str,
    alpha: float | None,
    rslora: bool | None,
    adapter_name: str | None,
    select: str | None,
    overwrite: bool,
    quiet: bool,
) -> None:
    """Write the LoRA adapter inside a training checkpoint as a PEFT adapter folder.

    RUN is a checkpoint of a model wrapped by PEFT's get_peft_model (torch.save,
    Lightning, a Trainer checkpoint; any wrapper prefixes); OUT gets
    adapter_model.safetensors and adapter_config.json, which
    PeftModel.from_pretrained loads. r, rank_pattern, DoRA, lora_bias,
    target_modules and modules_to_save come from the tensors; lora_alpha from
    an adapter_config.json beside RUN, or --alpha.

    \b
    Example:
      ckptconv extract-lora last.ckpt adapter/ --base llama/ --alpha 16
    """
    from ckptconv.adapters.extraction import extract_lora as extract
    from ckptconv.cli.terminal import say

    report = extract(
        run,
        out,
        base=base,
        alpha=alpha,
        use_rslora=rslora,
        adapter_name=adapter_name,
        select=select,
        overwrite=overwrite,
    )
    for note in report.notes:
        say(quiet, f"note: {note}")
    say(quiet, f"wrote {report.destination} ({report.tensors} tensors, adapter_config.json)")
