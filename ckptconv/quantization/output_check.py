"""The last check on every output, whatever path wrote it: quantized tensors stay whole and declared.

Two calls, where every writer passes: :func:`check_state` from :func:`ckptconv.writing.writer.write_state`
(every file and folder ckptconv writes, ``save()`` included), :func:`check_config` from
:func:`ckptconv.writing.model_files.rewritten_config` (every ``config.json`` it writes). They refuse:

* an orphan: a scale, zero point, global scale or shape with no weight beside it (``X.weight_scale``
  without ``X.weight`` or ``X.weight_packed``, ``X.weight_scale_inv`` without ``X.weight``, quanto's
  ``X._scale`` without ``X._data``, MXFP4 ``X_scales`` without ``X_blocks``), or a packed weight with no
  scale: a loader would leave the layer at its random initialisation, or read the codes as values;
* a ``config.json`` whose ``quantization_config`` does not say what the tensors are: quantized tensors
  (a weight with its companions) written under a config that declares none (a loader reads float8 codes
  or packed integers as plain weights), or a declaration kept over tensors of which none is quantized
  (an activation or kv-cache scale counts: a config may quantize only those).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptconv.errors import UnsupportedQuantizationError
from ckptconv.quantization.evidence import companions, partner_missing
from ckptconv.values.tensor import TensorRef

__all__ = ["check_config", "check_state"]

_DECLARING = ("quantization_config", "compression_config")
# Activation and kv-cache scales: a declaration that quantizes only activations or the kv cache has these alone.
_ACTIVATION_SCALES = frozenset(
    {"input_scale", "output_scale", "activation_scale", "k_scale", "v_scale", "input_global_scale", "input_zero_point"}
)


def check_state(state: Mapping[str, TensorRef]) -> None:
    """Refuse an output with a quantization companion whose weight is not beside it (or a weight whose scale is not).

    Raises:
        UnsupportedQuantizationError: one line naming the orphan and what it lacks.
    """
    for key, ref in state.items():
        missing = partner_missing(key, state)
        if missing is None and key.endswith("_scales") and ref.dtype.name == "uint8":
            blocks = key[: -len("_scales")] + "_blocks"
            missing = None if blocks in state else blocks
        if missing is not None:
            raise UnsupportedQuantizationError(
                f"the output would hold {key!r} without {missing!r} beside it: a quantization companion with "
                "nothing to scale (or a quantized weight without its scale); nothing was written",
                scheme="output",
                key=key,
            )


def check_config(config: Mapping[str, Any], state: Mapping[str, TensorRef]) -> None:
    """Refuse a ``config.json`` whose ``quantization_config`` is there exactly when no quantized tensor is.

    Raises:
        UnsupportedQuantizationError: one line naming the tensor (or its absence) and the config.
    """
    declared = next((key for key in _DECLARING if isinstance(config.get(key), Mapping) and config.get(key)), None)
    found = companions(state)
    if found and declared is None:
        first = min(found, key=lambda companion: companion.key)
        raise UnsupportedQuantizationError(
            f"the output's config.json would declare no quantization_config, but {first.key!r} ({first.what}) "
            "stays quantized; a loader would read its codes as weights: pass --dtype bf16 to dequantize them",
            scheme=first.method,
            key=first.key,
        )
    if declared is not None and not found and not any(key.rpartition(".")[2] in _ACTIVATION_SCALES for key in state):
        raise UnsupportedQuantizationError(
            f"the output's config.json would keep its {declared}, but no quantized tensor remains (no scale, "
            "packed weight or zero point); a loader would expect quantized layers: convert the quantized "
            "weights with --dtype to dequantize them",
            scheme="output",
        )
