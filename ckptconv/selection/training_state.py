"""Training state told apart from model weights by what a file holds, never by its name.

A training run saves the model beside what resumes its training: the optimizer's state
(``torch.optim.Optimizer.state_dict()``: ``state`` and ``param_groups``), the learning-rate
scheduler's, a ``GradScaler``'s, the random number generators' and the trainer's arguments
(HF Trainer's ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``, ``training_args.bin``;
accelerate's ``optimizer.bin``, ``scheduler.bin``, ``random_states_0.pkl``). None of it is
weights: :func:`training_state` names what such a tree is, so that a conversion says so in one
line and a batch or a model folder leaves it out, instead of failing on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptconv.values.standins import ForeignObject

__all__ = ["training_state"]

# The keys of a torch LR scheduler's state_dict() that no state dict of weights has.
_SCHEDULER_KEYS = frozenset({"base_lrs", "last_epoch", "_step_count", "_last_lr"})
# GradScaler.state_dict().
_SCALER_KEYS = frozenset({"scale", "growth_factor", "backoff_factor", "growth_interval"})
# HF Trainer's rng_state.pth and accelerate's random_states_N.pkl.
_RNG_KEYS = frozenset(
    {
        "python",
        "numpy",
        "cpu",
        "cuda",
        "mps",
        "xpu",
        "npu",
        "hpu",
        "mlu",
        "musa",
        "step",
        "random_state",
        "numpy_random_seed",
        "torch_manual_seed",
        "torch_cuda_manual_seed",
        "torch_xpu_manual_seed",
        "torch_npu_manual_seed",
        "torch_mlu_manual_seed",
        "torch_musa_manual_seed",
        "xm_seed",
    }
)
_RNG_MARKERS = frozenset({"python", "random_state", "numpy_random_seed", "torch_manual_seed"})
# What an optimizer keeps per parameter, by the names torch.optim gives it.
_MOMENTS = (
    (("exp_avg", "exp_avg_sq"), "Adam moments"),
    (("momentum_buffer",), "momentum buffers"),
    (("square_avg",), "RMSprop averages"),
    (("sum",), "Adagrad sums"),
)


def _string_keys(tree: Any) -> set[str] | None:
    if not isinstance(tree, Mapping) or not tree or not all(isinstance(key, str) for key in tree):
        return None
    return set(tree)


def _optimizer(tree: Mapping[str, Any]) -> str:
    state = tree.get("state")
    names: set[str] = set()
    if isinstance(state, Mapping):
        for entry in list(state.values())[:64]:
            if isinstance(entry, Mapping):
                names |= {key for key in entry if isinstance(key, str)}
    kept = next((what for keys, what in _MOMENTS if set(keys) <= names), None)
    return f"optimizer state ({kept})" if kept else "optimizer state"


def training_state(tree: Any) -> str | None:
    """What training state ``tree`` (a file's whole content) is, such as ``"optimizer state (Adam moments)"``;
    None when it is anything else (weights, or a training checkpoint that holds weights among its state)."""
    if isinstance(tree, ForeignObject):
        name = tree.qualname.rsplit(".", 1)[-1]
        return f"training arguments ({tree.qualname})" if name.endswith("TrainingArguments") else None
    keys = _string_keys(tree)
    if keys is None:
        return None
    if {"state", "param_groups"} <= keys and len(keys) <= 4:
        return _optimizer(tree)
    if len(keys & _SCHEDULER_KEYS) >= 2 and "state_dict" not in keys:
        return "learning-rate scheduler state"
    if keys >= _SCALER_KEYS:
        return "gradient scaler state"
    if keys <= _RNG_KEYS and keys & _RNG_MARKERS:
        return "random number generator state"
    return None
