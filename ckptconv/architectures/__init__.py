"""Model architectures: one training framework's names mapped to a model library's, as tables of data.

:func:`to_hugging_face` maps a Megatron-Core model (``decoder.layers.N.self_attention.linear_qkv``
…) to the Hugging Face model a ``config.json`` describes, offline, with no Megatron installed;
:func:`to_megatron` runs the same tables backwards.
``operations.py`` is the vocabulary (rename, rows, chunk, QKV split, unstack, stack),
``families.py`` the tables, one per model family, ``mapping.py`` runs them.
"""

from __future__ import annotations

from ckptconv.architectures.families import FAMILIES
from ckptconv.architectures.mapping import expert_layout, to_hugging_face, to_megatron

__all__ = ["FAMILIES", "MEGATRON_FORMATS", "expert_layout", "to_hugging_face", "to_megatron"]

#: The formats whose names the tables map (``convert SRC DST/ --like hf_base_model/`` maps them first).
MEGATRON_FORMATS = frozenset({"megatron-torch-dist", "megatron-legacy"})
