"""The weights under the names of the model they go to, before anything else is done to them.

:func:`arrange` runs once per conversion, after the selection: a Megatron checkpoint is mapped to ``--like``'s
Hugging Face model (:func:`ckptconv.architectures.to_hugging_face`), a mixture of experts is moved to ``--layout``
(or to ``--like``'s layout: :mod:`layouts`), and names transformers spells two ways (``visual.*`` and
``model.visual.*``, ``model.*`` and ``model.language_model.*`` ...: its ``conversion_mapping.py`` renamings) are
spelled as ``--like``'s folder spells them (:func:`ckptconv.architectures.coverage.spelled_like`).
"""

from __future__ import annotations

import dataclasses

from ckptconv.architectures import MEGATRON_FORMATS
from ckptconv.architectures.coverage import Reference, spelled_like
from ckptconv.architectures.layouts import change_layout, layout_of
from ckptconv.architectures.mapping import to_hugging_face
from ckptconv.errors import TransformError
from ckptconv.reading.model_folder import model_folder, read_config
from ckptconv.selection.weights import Selection

__all__ = ["arrange"]


def arrange(fmt: str, selection: Selection, layout: str, source: str, like: Reference | None) -> Selection:
    """The selected weights under the names of the model they go to, with a note on what changed: a Megatron
    checkpoint mapped to ``like``'s model, experts in ``layout`` (``"keep"``: as ``like`` holds them, else as the
    source does), names transformers spells two ways spelled as ``like`` does.

    Raises:
        TransformError: see :func:`change_layout` and :func:`ckptconv.architectures.to_hugging_face`.
    """
    if layout not in ("keep", "fused", "per-expert"):  # options.LAYOUTS
        raise TransformError(f"layout must be one of keep, fused, per-expert, not {layout!r}")
    wanted = layout if layout != "keep" else layout_of(like.dtypes) if like is not None else None
    note = None
    if fmt in MEGATRON_FORMATS:
        if like is None:
            return selection
        experts = None if wanted in (None, "mixed") else wanted.replace("-", "_")
        weights = to_hugging_face(selection.weights, like.config, experts=experts, reference_names=list(like.dtypes))
        note = "mapped Megatron's names to the reference's"
    else:
        weights, notes = dict(selection.weights), []
        if wanted not in (None, "mixed"):
            folder = model_folder(source)
            config = like.config if like is not None else read_config(folder) if folder is not None else None
            if config is None:
                raise TransformError(f"--layout {layout} needs the model's config.json beside the source (or --like)")
            weights, moved = change_layout(weights, config, wanted)
            notes += [moved] if moved else []
        if like is not None:
            weights, renamed = spelled_like(weights, like)
            notes += [f"spelled {renamed} name(s) as the reference does (transformers' renamings)"] if renamed else []
        note = "; ".join(notes) or None
    if note is None:
        return selection
    return dataclasses.replace(selection, weights=weights, note="; ".join(filter(None, (selection.note, note))))
