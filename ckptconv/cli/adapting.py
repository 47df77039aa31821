"""The commands about PEFT adapters: merge-lora."""

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
                )
            ]
        },
    ),
)
def merge_lora(base: str, adapter: str, out: str, more_adapters: tuple[str, ...], **options: Any) -> None:
    """Merge a PEFT LoRA adapter into its base model, bit for bit as PEFT's merge_and_unload().

    BASE is a model folder (sharded or not, safetensors or .bin) or a checkpoint
    file; ADAPTER a PEFT adapter folder (adapter_config.json and
    adapter_model.safetensors or .bin); OUT a model folder (configs carried)
    or a file. LoRA, rsLoRA, DoRA, GPT-2's Conv1D (fan_in_fan_out), LoRA on
    embeddings, rank_pattern/alpha_pattern, modules_to_save and lora_bias are
    merged exactly as PEFT does on the CPU (needs torch); other settings are
    refused in one line. The merge streams one base tensor at a time, in the
    base's dtype; --dtype casts after it. The output records each adapter's
    sha256 and scaling.

    \b
    Example:
      ckptconv merge-lora llama/ my_adapter/ merged/
      ckptconv merge-lora llama/ my_adapter/ merged/ --dtype bf16 --max-shard-size 5GB
    """
    from ckptconv.adapters.merging import merge_lora as merge

    adapters = [adapter, *more_adapters]

    def run(src: str, dst: str, **how: Any) -> Any:
        return merge(src, adapters, dst, **how)

    run_conversion(base, out, [], options, run=run)
