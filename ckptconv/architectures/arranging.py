"""The weights under the names of the model they go to: the first transform step of a conversion that needs one.

:func:`arranged` puts an :class:`Arrange` step first in the conversion's pipeline when the weights need it: a
Megatron checkpoint is mapped to ``--like``'s Hugging Face model (:func:`ckptconv.architectures.to_hugging_face`), a
mixture of experts is moved to ``--layout`` (or to ``--like``'s layout: :mod:`layouts`), and names transformers
spells two ways (``visual.*`` and ``model.visual.*``, ``model.*`` and ``model.language_model.*`` ...: its
``conversion_mapping.py`` renamings) are spelled as ``--like``'s folder spells them
(:func:`ckptconv.architectures.coverage.spelled_like`). Being a step of the pipeline, it runs after a quantized
checkpoint is dequantized (so ``--dtype bf16 --layout fused`` stacks the dequantized experts), it is recorded in
the provenance, and ``--verify=torch`` runs it again on what the independent reader gives. With ``--to megatron`` a
Hugging Face model's weights are mapped to Megatron-Core's names instead (:func:`ckptconv.architectures.to_megatron`,
its config from beside the source or ``--like``), layer by layer as ckptconv reads a ``torch_dist`` folder back; the
writer stacks the layers (:mod:`ckptconv.writing.torch_dist`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from ckptconv.architectures import MEGATRON_FORMATS
from ckptconv.architectures.coverage import Reference, spelled_like
from ckptconv.architectures.layouts import change_layout, layout_of
from ckptconv.architectures.mapping import to_hugging_face, to_megatron
from ckptconv.errors import TransformError
from ckptconv.reading.model_folder import model_folder, read_config
from ckptconv.selection.weights import Selection
from ckptconv.transforms.keys import Pipeline, StepReport
from ckptconv.values.tensor import TensorRef

__all__ = ["Arrange", "arrange", "arranged"]


class _Options(Protocol):
    """What :func:`arranged` asks of :class:`~ckptconv.options.ConversionOptions` (a layer above this one)."""

    @property
    def layout(self) -> str: ...

    @property
    def transforms(self) -> Pipeline: ...

    @property
    def to(self) -> str | None: ...

    @property
    def padded_vocab_size(self) -> int | None: ...


Options = TypeVar("Options", bound=_Options)


def arrange(
    fmt: str,
    weights: Mapping[str, TensorRef],
    layout: str,
    source: str,
    like: Reference | None,
    *,
    to: str | None = None,
    padded_vocab_size: int | None = None,
) -> tuple[dict[str, TensorRef], str | None]:
    """The weights under the names of the model they go to, and a note on what changed (None: nothing): a Megatron
    checkpoint mapped to ``like``'s model, experts in ``layout`` (``"keep"``: as ``like`` holds them, else as the
    source does), names transformers spells two ways spelled as ``like`` does.

    Raises:
        TransformError: see :func:`change_layout` and :func:`ckptconv.architectures.to_hugging_face`.
    """
    if layout not in ("keep", "fused", "per-expert"):  # options.LAYOUTS
        raise TransformError(f"layout must be one of keep, fused, per-expert, not {layout!r}")
    megatron_out = (to or "").lower() == "megatron"
    if padded_vocab_size is not None and not megatron_out:
        raise TransformError("--padded-vocab-size pads Megatron's vocabulary: give it with --to megatron")
    if megatron_out:
        return _to_megatron(fmt, weights, layout, source, like, padded_vocab_size)
    wanted = layout if layout != "keep" else layout_of(like.dtypes) if like is not None else None
    if fmt in MEGATRON_FORMATS:
        if like is None:
            return dict(weights), None
        experts = None if wanted in (None, "mixed") else str(wanted).replace("-", "_")
        mapped = to_hugging_face(weights, like.config, experts=experts, reference_names=list(like.dtypes))
        return mapped, "mapped Megatron's names to the reference's"
    moved, notes = dict(weights), []
    if wanted not in (None, "mixed"):
        folder = model_folder(source)
        config = like.config if like is not None else read_config(folder) if folder is not None else None
        if config is None:
            raise TransformError(f"--layout {layout} needs the model's config.json beside the source (or --like)")
        moved, note = change_layout(moved, config, str(wanted))
        notes += [note] if note else []
    if like is not None:
        moved, renamed = spelled_like(moved, like)
        notes += [f"spelled {renamed} name(s) as the reference does (transformers' renamings)"] if renamed else []
    return moved, "; ".join(notes) or None


def _to_megatron(
    fmt: str,
    weights: Mapping[str, TensorRef],
    layout: str,
    source: str,
    like: Reference | None,
    padded_vocab_size: int | None,
) -> tuple[dict[str, TensorRef], str | None]:
    """``--to megatron``: a Hugging Face model's weights under Megatron-Core's names; a Megatron source as it is."""
    if layout != "keep":
        raise TransformError(
            f"--layout {layout} arranges a Hugging Face model's experts; leave it out with --to megatron"
        )
    if fmt in MEGATRON_FORMATS:
        if padded_vocab_size is not None:
            raise TransformError("--padded-vocab-size pads a Hugging Face model's vocabulary; the source is Megatron's")
        return dict(weights), None
    folder = model_folder(source)
    config = like.config if like is not None else read_config(folder) if folder is not None else None
    if config is None:
        raise TransformError("--to megatron needs the model's config.json beside the source (or --like)")
    mapped = to_megatron(weights, config, padded_vocab_size=padded_vocab_size)
    return mapped, "mapped the Hugging Face names to Megatron-Core's"


@dataclass(frozen=True)
class Arrange:
    """The step that runs :func:`arrange` (a :class:`~ckptconv.transforms.keys.Transform`)."""

    fmt: str
    layout: str
    source: str
    like: Reference | None = field(default=None, compare=False, hash=False)
    to: str | None = None
    padded_vocab_size: int | None = None

    def apply(self, state: Mapping[str, TensorRef]) -> tuple[dict[str, TensorRef], StepReport]:
        result, note = arrange(
            self.fmt, state, self.layout, self.source, self.like, to=self.to, padded_vocab_size=self.padded_vocab_size
        )
        kept = sum(1 for name, ref in result.items() if state.get(name) is ref)
        return result, StepReport(self.describe(), len(result) - kept, kept, notes=(note,) if note else ())

    def describe(self) -> str:
        if (self.to or "").lower() == "megatron":
            padded = f", vocabulary padded to {self.padded_vocab_size} rows" if self.padded_vocab_size else ""
            return f"arrange names and experts as Megatron-Core saves them{padded}"
        layout = "as the reference's" if self.layout == "keep" else self.layout
        return f"arrange names and experts for the model out (layout: {layout})"


def arranged(options: Options, selection: Selection, fmt: str, source: str, like: Reference | None) -> Options:
    """``options`` (a :class:`~ckptconv.options.ConversionOptions`) with an :class:`Arrange` step first when the
    selected weights need one, else unchanged."""
    try:
        _, note = arrange(
            fmt,
            selection.weights,
            options.layout,
            source,
            like,
            to=options.to,
            padded_vocab_size=options.padded_vocab_size,
        )
    except TransformError:
        note = "refused as the source is: the step says why, after any dequantization"
    if note is None:
        return options
    step = Arrange(fmt, options.layout, source, like, options.to, options.padded_vocab_size)
    pipeline = Pipeline.of((step, *options.transforms.steps))
    return dataclasses.replace(options, transforms=pipeline)  # type: ignore[type-var]
