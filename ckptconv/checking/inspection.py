"""Inspect: what a checkpoint holds, without reading a single tensor byte.

:func:`inspect` reads only the file's structure (the pickle or the safetensors
header), so a checkpoint of any size is described in a fraction of a second.
The module is not called ``inspect`` so that it does not shadow the standard
library's.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptconv._paths import PathLike, as_path
from ckptconv._text import plural
from ckptconv.architectures import coverage
from ckptconv.architectures.layouts import layout_of
from ckptconv.dtypes import dtype_by_name
from ckptconv.errors import (
    CkptconvError,
    InvalidConfigError,
    SelectionError,
    TransformError,
    UnsupportedQuantizationError,
)
from ckptconv.loading import Checkpoint
from ckptconv.loading import open as open_checkpoint
from ckptconv.quantization import dequantize
from ckptconv.quantization.stage import declared_scheme
from ckptconv.reading.adapter_config import CONFIG_NAME as ADAPTER_CONFIG
from ckptconv.reading.adapter_config import WEIGHTS_NAMES as ADAPTER_WEIGHTS
from ckptconv.reading.adapter_config import read_config as read_adapter_config
from ckptconv.reading.model_folder import Model, resolve_model
from ckptconv.runtime.collector import collector_paused
from ckptconv.selection.state_dicts import as_tensor, is_module, part_text
from ckptconv.transforms.keys import wrapper_note
from ckptconv.values.standins import ForeignGlobal, ForeignObject, NumpyArray
from ckptconv.values.tensor import TensorRef

__all__ = ["CheckpointInfo", "ModelInfo", "TensorInfo", "inspect"]


#: Keys a :class:`TensorInfo` names among those sharing its storage (``shares_count`` counts them all).
MAX_SHARES_LISTED = 8


@dataclass(frozen=True, slots=True)  # one a tensor: no __dict__ each (issue #31)
class TensorInfo:
    """One tensor of the selected weights.

    Attributes:
        key: its name.
        dtype: element type.
        shape: sizes.
        nbytes: bytes it occupies when written.
        shares_with: other keys viewing the same storage (tied weights, views): the first
            :data:`MAX_SHARES_LISTED` of them, so that thousands of names for one storage
            cost thousands of rows, not millions of pairs.
        is_view: True when it covers only part of its storage (or is not contiguous).
        shares_count: how many other keys view the same storage in all.
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    shares_with: tuple[str, ...] = ()
    is_view: bool = False
    shares_count: int = 0


# How configs count a mixture of experts' experts: Mixtral, Qwen-MoE and OLMoE, DeepSeek, others.
_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class ModelInfo:
    """What model a folder is, as its config and its files say (no tensor read).

    Attributes:
        kind: ``"model folder"``, ``"training run"`` (training state beside the model), ``"adapter"`` or
            ``"model folders"`` (:class:`ckptconv.reading.model_folder.Model`).
        folder: the model folder.
        architecture: the config's ``architectures`` (``"LlamaForCausalLM"``), else its ``model_type``; ``""``.
        model_type: the config's ``model_type``, ``""`` when it has none.
        ties: the head and the embeddings: ``"tied (tie_word_embeddings: true)"`` ...; ``""`` when neither the
            config nor the weights say.
        experts: a mixture of experts' count of experts, as the config says (None for a dense model).
        quantization: the config's ``quantization_config.quant_method``, ``""`` when it declares none.
        training_state: ``"name (what)"`` for each file of training state beside the model (optimizer,
            scheduler, trainer state ...).
        parts: the model folders inside it.
        layout: its experts' layout and whether its weights cover its config's model (see
            :mod:`ckptconv.architectures.coverage`), ``""`` when it has no config.
    """

    kind: str
    folder: str
    architecture: str = ""
    model_type: str = ""
    ties: str = ""
    experts: int | None = None
    quantization: str = ""
    training_state: tuple[str, ...] = ()
    parts: tuple[str, ...] = ()
    layout: str = ""


# A config is untrusted: what inspect shows of it is bounded (a 16 MiB "model_type" is one short line).
_MAX_TEXT = 100


def _text(value: Any) -> str:
    if not isinstance(value, str):
        return ""
    return value if len(value) <= _MAX_TEXT else value[: _MAX_TEXT - 3] + "..."


def _ties(config: Mapping[str, Any], weights: Mapping[str, TensorRef]) -> str:
    """What the config and the weights say of the head and the input embeddings: ``"tied (tie_word_embeddings:
    true, no lm_head.weight stored)"``; ``""`` when neither says anything."""
    declared = config.get("tie_word_embeddings")
    said = [f"tie_word_embeddings: {str(declared).lower()}"] if isinstance(declared, bool) else []
    head = weights.get(_HEAD)
    shared = None
    if head is not None:
        shared = next((key for key, ref in weights.items() if key != _HEAD and ref.storage is head.storage), None)
        said.append(f"{_HEAD} shares storage with {shared}" if shared else f"{_HEAD} stored")
    elif declared is True and weights:
        said.append(f"no {_HEAD} stored")
    if not said:
        return ""
    return f"{'tied' if declared is True or shared is not None else 'untied'} ({', '.join(said)})"


def _experts(config: Mapping[str, Any]) -> int | None:
    for scope in (config, config.get("text_config")):
        if isinstance(scope, Mapping):
            for name in _EXPERT_FIELDS:
                value = scope.get(name)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return None


def model_info(model: Model, weights: Mapping[str, TensorRef]) -> ModelInfo:
    """``model`` described for :func:`inspect` (``weights``: its selected weights, for the ties)."""
    config = model.config or {}
    architectures = config.get("architectures")
    names = (
        [_text(name) for name in architectures[:4] if isinstance(name, str)] if isinstance(architectures, list) else []
    )
    architecture = ", ".join(names) + (" ..." if isinstance(architectures, list) and len(architectures) > 4 else "")
    quantization = config.get("quantization_config")
    return ModelInfo(
        kind=model.kind,
        folder=model.folder,
        architecture=architecture or _text(config.get("model_type")),
        model_type=_text(config.get("model_type")),
        ties=_ties(config, weights) if not model.adapter else "",
        experts=_experts(config),
        quantization=_text(quantization.get("quant_method")) if isinstance(quantization, Mapping) else "",
        training_state=tuple(f"{name} ({what})" for name, what in model.training_state),
        parts=model.parts,
        layout=_layout(model, weights),
    )


@dataclass(frozen=True)
class CheckpointInfo:
    """A description of a checkpoint file.

    Attributes:
        path, format, size: the file.
        saved_devices: devices its tensors were saved from.
        foreign_globals: classes that became inert stand-ins, with object counts.
        metadata: the file's string metadata.
        outline: ``(key, description)`` for each top-level entry.
        selected: where the model weights are (``""`` = the whole file), None if not found.
        selection_note: the selection's remark (EMA alternatives, ...).
        selection_error: why no weights could be selected, if so.
        alternatives: other places holding weights.
        tensors: the selected weights.
        parameters: total elements in the selected weights.
        tensor_bytes: total bytes of the selected weights.
        dtypes: how many selected tensors have each dtype.
        total_tensors: tensors anywhere in the file (optimizer state included).
        quantization: the quantization scheme the checkpoint declares or gives away, and what
            dequantizing would write, or why it is refused; ``""`` for an unquantized checkpoint.
        model: what model a folder (or its index) is (:class:`ModelInfo`); None for a single file.
        notes: what the user should hear (a wrapper prefix on every key, and the flag that removes it).
        adapter: for a PEFT adapter (``adapter_config.json`` beside the weights): its type, r, alpha, targets
            and base model, or why ``merge-lora`` refuses it; ``""`` otherwise.
    """

    path: str
    format: str
    size: int
    saved_devices: tuple[str, ...]
    foreign_globals: Mapping[str, int]
    metadata: Mapping[str, str]
    outline: tuple[tuple[str, str], ...]
    selected: str | None
    selection_note: str
    selection_error: str
    alternatives: tuple[str, ...]
    tensors: tuple[TensorInfo, ...] = field(repr=False)
    parameters: int
    tensor_bytes: int
    dtypes: Mapping[str, int]
    total_tensors: int
    quantization: str = ""
    model: ModelInfo | None = None
    notes: tuple[str, ...] = ()
    adapter: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (what ``ckptconv inspect --json`` prints)."""
        data = asdict(self)
        data["outline"] = [{"key": key, "value": text} for key, text in self.outline]
        data["tensors"] = [
            {**asdict(info), "shape": list(info.shape), "shares_with": list(info.shares_with)} for info in self.tensors
        ]
        data["saved_devices"] = list(self.saved_devices)
        data["alternatives"] = list(self.alternatives)
        data["notes"] = list(self.notes)
        if self.model is not None:
            data["model"] = {
                **asdict(self.model),
                "training_state": list(self.model.training_state),
                "parts": list(self.model.parts),
            }
        return data


def describe_value(value: Any) -> str:
    """A short human description of one entry of a checkpoint."""
    tensor = as_tensor(value)
    if tensor is not None:
        kind = "numpy array" if tensor.origin == "numpy" else "tensor"
        return f"{kind} {tensor.dtype.name}{list(tensor.shape)}"
    if isinstance(value, NumpyArray):
        return f"numpy array {value.dtype.descr if value.dtype else '?'}{list(value.shape)}"
    if is_module(value):
        return f"model {value.qualname} (pickled module)"
    if isinstance(value, ForeignObject):
        return f"{value.qualname} (stand-in)"
    if isinstance(value, ForeignGlobal):
        return f"reference to {value.qualname} (stand-in)"
    if isinstance(value, Mapping):
        tensors = sum(1 for item in value.values() if as_tensor(item) is not None)
        if tensors and tensors == len(value):
            return f"state dict of {tensors} tensors"
        extra = f", {tensors} tensors" if tensors else ""
        return f"{type(value).__name__} of {len(value)} entries{extra}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)} items"
    if isinstance(value, (str, bytes)):
        text = repr(value)
        return text if len(text) <= 60 else text[:57] + "..."
    if value is None or isinstance(value, (bool, int, float, complex)):
        return part_text(value)
    return type(value).__name__


def _outline(tree: Any) -> tuple[tuple[str, str], ...]:
    if isinstance(tree, Mapping) and not (as_tensor(next(iter(tree.values()), None)) is not None):
        return tuple((part_text(key), describe_value(value)) for key, value in list(tree.items())[:200])
    if isinstance(tree, ForeignObject) and not is_module(tree):
        return tuple((part_text(key), describe_value(value)) for key, value in list(tree.attributes().items())[:200])
    return (("", describe_value(tree)),)


def _shared_storages(weights: Mapping[str, TensorRef]) -> dict[int, list[str]]:
    """The keys of each storage more than one key views, by the storage's id: a list for those
    only, not one for every tensor."""
    first: dict[int, str] = {}
    shared: dict[int, list[str]] = {}
    for key, ref in weights.items():
        owner = first.setdefault(id(ref.storage), key)
        if owner != key:
            shared.setdefault(id(ref.storage), [owner]).append(key)
    return shared


def _others(group: list[str], key: str) -> tuple[str, ...]:
    """The first :data:`MAX_SHARES_LISTED` keys of ``group`` other than ``key`` (keys are unique)."""
    return tuple(other for other in group[: MAX_SHARES_LISTED + 1] if other != key)[:MAX_SHARES_LISTED]


def inspect(path: PathLike, *, select: str | None = None, trust: bool = False) -> CheckpointInfo:
    """Describe a checkpoint: format, devices, stand-ins, where the weights are, every tensor.

    Reads no tensor data. Never fails because the weights are ambiguous: the
    reason is reported in ``selection_error`` instead.

    Args:
        path: any checkpoint :func:`ckptconv.open` reads.
        select: where the weights are; searched when None.
        trust: see :func:`ckptconv.open`. Dangerous.

    Raises:
        LoadError: the file cannot be read.

    Example:
        >>> info = ckptconv.inspect("train.pth")  # doctest: +SKIP
        >>> info.selected, info.parameters        # doctest: +SKIP
        ('state_dict', 11689512)
    """
    with collector_paused():  # an object or more per tensor: see ckptconv.runtime.collector
        return _inspect(path, select=select, trust=trust)


def _inspect(path: PathLike, *, select: str | None, trust: bool) -> CheckpointInfo:
    checkpoint = open_checkpoint(path, trust=trust)
    selected: str | None = None
    note = error = ""
    alternatives: tuple[str, ...] = ()
    weights: dict[str, TensorRef] = {}
    try:
        selection = checkpoint.select(select)
    except SelectionError as failure:
        error = failure.reason  # without "run `ckptconv inspect`": this is its output
        alternatives = failure.candidates
    else:
        selected, note, alternatives, weights = (
            selection.where,
            selection.note,
            selection.alternatives,
            selection.weights,
        )

    shared = _shared_storages(weights)
    alone: list[str] = []
    tensors = tuple(
        TensorInfo(
            key,
            ref.out_dtype.name,
            ref.shape,
            ref.nbytes,
            _others(group, key) if (group := shared.get(id(ref.storage), alone)) else (),
            not ref.is_whole_storage,
            max(len(group) - 1, 0),
        )
        for key, ref in weights.items()
    )
    return CheckpointInfo(
        path=checkpoint.path,
        format=checkpoint.format,
        size=checkpoint.size,
        saved_devices=tuple(sorted(checkpoint.saved_devices)),
        foreign_globals=dict(checkpoint.foreign_globals),
        metadata=dict(checkpoint.metadata),
        outline=_outline(checkpoint.tree),
        selected=selected,
        selection_note=note,
        selection_error=error,
        alternatives=alternatives,
        tensors=tensors,
        parameters=sum(ref.numel for ref in weights.values()),
        tensor_bytes=sum(ref.nbytes for ref in weights.values()),
        dtypes=dict(Counter(ref.out_dtype.name for ref in weights.values())),
        total_tensors=sum(1 for _ in checkpoint.tensors()),
        quantization=_quantization(path, checkpoint, weights),
        model=model_info(model, weights) if (model := resolve_model(as_path(path), strict=False)) else None,
        notes=tuple(filter(None, [wrapper_note(weights)])),
        adapter=_adapter(as_path(path)),
    )


def _layout(model: Model, weights: Mapping[str, TensorRef]) -> str:
    """A model folder's expert layout and coverage of its config, in one line; ``""`` for anything else."""
    if model.adapter or not weights or model.config is None:
        return ""
    layout = layout_of(weights)
    said = {None: "", "fused": "experts fused; ", "per-expert": "experts one per expert; "}.get(
        layout, "experts mixed; "
    )
    try:
        found = coverage.check(weights, model.folder, allow_missing=True)
    except CkptconvError as error:
        return f"{said}coverage not checked: {error}"
    return said + (found[0] if found else "covers its config's model")


def _adapter(path: str) -> str:
    """What a PEFT adapter folder's ``adapter_config.json`` says (its tensors are listed as any checkpoint's)."""
    if os.path.isdir(path):
        folder = path
    elif os.path.basename(path) in ADAPTER_WEIGHTS:  # the adapter's own weights file, given by name
        folder = os.path.dirname(path) or "."
    else:
        return ""
    if not os.path.lexists(os.path.join(folder, ADAPTER_CONFIG)):
        return ""
    try:
        config = read_adapter_config(folder)
    except TransformError as error:
        return f"PEFT adapter that merge-lora refuses: {error}"
    kind = "DoRA" if config.use_dora else "rsLoRA" if config.use_rslora else "LoRA"
    parts = [f"{kind}, r={config.r}, alpha={config.lora_alpha:g}"]
    if config.rank_pattern or config.alpha_pattern:
        parts.append(f"{plural(len(config.rank_pattern) + len(config.alpha_pattern), 'pattern')} for r/alpha")
    parts.append(f"targets {', '.join(config.target_modules) or '(from the tensors)'}")
    if config.modules_to_save:
        parts.append(f"modules_to_save {', '.join(config.modules_to_save)}")
    parts.append(f"base model {config.base_model or '(not named)'}")
    return "; ".join(parts)


def _quantization(path: PathLike, checkpoint: Checkpoint, weights: Mapping[str, TensorRef]) -> str:
    """The scheme and what ``--dtype`` would write (the names only: no byte is read), or why it is refused."""
    try:
        scheme = declared_scheme(as_path(path), checkpoint.format, checkpoint.metadata, weights)
        if scheme is None:
            return ""
        bfloat16 = dtype_by_name("bfloat16")
        plan = dequantize(weights, scheme, bfloat16) if bfloat16 is not None else dict(weights)
    except UnsupportedQuantizationError as error:
        return f"refused: {error}"
    except InvalidConfigError as error:  # the weights are still described; the config is named as invalid
        return f"unknown, the config is invalid: {error}"
    changed = sum(1 for key, ref in plan.items() if weights.get(key) is not ref)
    left_out = len(weights) - len(plan)
    return (
        f"{scheme}: --dtype bf16, fp16 or fp32 dequantizes {plural(changed, 'weight')} exactly and leaves out "
        f"{plural(left_out, 'scale, zero point or shape tensor', 'scale, zero point and shape tensors')}"
    )
