"""Coverage: does a model folder's weights feed every parameter its config's model has, and nothing else?

The expected parameters come from the config: transformers' own model built on the meta device when
transformers is installed (no weights made, nothing imported from the folder, never
``trust_remote_code``), else ckptconv's Megatron family tables (:func:`families.expected`), else no
check (a note says so). The written names are brought to the model's in-memory form first: experts to
the fused layout (:mod:`layouts`' tables), then transformers' own renamings for the model (its
``conversion_mapping.py``: ``block_sparse_moe`` -> ``mlp``, prefix moves such as ``visual.*`` ->
``model.visual.*``, the base-model prefix). Tied parameters (``tie_word_embeddings``) count as fed when
one of their names is.
"""

from __future__ import annotations

import functools
import importlib
import json
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

from ckptconv.architectures import families, layouts
from ckptconv.architectures.mapping import bounded_list, run_table
from ckptconv.dtypes import DTYPES
from ckptconv.errors import InvalidConfigError, TransformError
from ckptconv.reading.model_folder import read_config
from ckptconv.reading.sources import computed_tensor
from ckptconv.values.tensor import TensorRef

__all__ = ["Expected", "Reference", "check", "expected", "spelled_like"]

#: a quantization's companions beside a weight (a quantized folder's model is built unquantized) ...
_SCALES = re.compile(r"(_scale_inv|_scale|_zero_point|weight_shape|_scales|weight_global_scale)$")
#: ... and the packed forms that stand for a weight (mxfp4's ``gate_up_proj_blocks``, compressed-tensors' packing)
_PACKED = re.compile(r"(_blocks|_packed)$")


class Reference(Protocol):
    """The model folder the output takes after (``--like``): its config and its weights' names."""

    @property
    def config(self) -> Mapping[str, Any]: ...

    @property
    def dtypes(self) -> Mapping[str, Any]: ...


class Expected:
    """The parameters a config's model has: their shapes, the groups of names tied together, how a written name
    becomes one of them (``rename``), and the names a checkpoint may hold that the model leaves alone (``stale``:
    transformers' ``_keys_to_ignore_on_load_unexpected``, and the model's buffers saved by older versions, such
    as a layer's ``rotary_emb.inv_freq`` or ``position_ids``) or lack (``optional``)."""

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        tied: list[set[str]],
        rename: Callable[[str], str],
        by: str,
        stale: Callable[[str], bool] = lambda name: False,
        optional: Callable[[str], bool] = lambda name: False,
    ) -> None:
        self.shapes, self.tied, self.rename, self.by = shapes, tied, rename, by
        self.stale, self.optional = stale, optional


def _from_transformers(config: Mapping[str, Any]) -> Expected | None:
    try:
        torch = importlib.import_module("torch")
        transformers = importlib.import_module("transformers")
        loading = importlib.import_module("transformers.core_model_loading")
        mapping = importlib.import_module("transformers.conversion_mapping")
    except ImportError:
        return None
    fields = {k: v for k, v in config.items() if k not in ("auto_map", "quantization_config") and k != "_name_or_path"}
    quiet = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()  # its remarks on the config are not ours to print
    # transformers raises anything at all for a config it cannot build; then it cannot say what the model has.
    try:
        built = transformers.AutoConfig.for_model(**fields)
        names = config.get("architectures") or []
        model_class = getattr(transformers, str(names[0]), None) if isinstance(names, list) and names else None
        if not (isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel)):
            model_class = transformers.AutoModelForCausalLM
        with torch.device("meta"):
            model = model_class.from_config(built) if hasattr(model_class, "from_config") else model_class(built)
        conversions = mapping.get_model_conversion_mapping(model)
    except Exception:  # see above: any failure means "cannot tell", said in a note
        return None
    finally:
        transformers.utils.logging.set_verbosity(quiet)
    state = model.state_dict()
    shapes = {name: tuple(int(n) for n in tensor.shape) for name, tensor in state.items()}
    by_param: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(param), set()).add(name)
    tied = [names for names in by_param.values() if len(names) > 1]
    renamings = [c for c in conversions if isinstance(c, loading.WeightRenaming)]
    prefix = getattr(model, "base_model_prefix", None) or None

    def rename(name: str) -> str:
        renamed, _ = loading.rename_source_key(name, renamings, [], prefix, state)
        return str(renamed)

    unexpected = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    absent = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or []]
    # buffers it keeps unsaved (rotary_emb.inv_freq), by their last name, never one a saved tensor has ("bias")
    saved = {name.rpartition(".")[2] for name in state}
    buffers = {name.rpartition(".")[2] for name, _ in model.named_buffers() if name not in state} - saved

    def stale(name: str) -> bool:
        return name.rpartition(".")[2] in buffers or any(p.search(name) for p in unexpected)

    def optional(name: str) -> bool:
        return any(p.search(name) for p in absent)

    return Expected(shapes, tied, rename, f"transformers {transformers.__version__}", stale, optional)


def expected(config: Mapping[str, Any]) -> Expected | None:
    """What the config's model has (see the module's docstring), or None when neither transformers nor a
    ckptconv table knows the model."""
    return _expected(json.dumps(config, sort_keys=True, default=str))


@functools.lru_cache(maxsize=4)  # asked for the same config by the spelling and the check of one conversion
def _expected(text: str) -> Expected | None:
    config = json.loads(text)
    found = _from_transformers(config)
    if found is not None:
        return found
    if config.get("model_type") in families.FAMILIES:
        tied = bool(config.get("tie_word_embeddings", False))
        return Expected(families.expected(config, "fused", tied), [], lambda name: name, "ckptconv's tables")
    return None


#: a config that gives none of these describes no model (transformers would fill in its defaults: a 7B llama)
_SIZES = ("hidden_size", "num_hidden_layers", "d_model", "n_embd", "n_layer", "num_layers", "dim")

_SHAPES_ONLY = next(dtype for dtype in DTYPES if dtype.name == "float32")


def _per_expert(shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The model's parameters with its fused experts one per expert, as :mod:`layouts` moves them (shapes only)."""
    refs = {name: computed_tensor(name, _unread, {}, _SHAPES_ONLY, shape) for name, shape in shapes.items()}
    moved = run_table(layouts.table(model_type, "per-expert"), refs, config, strict=False, what="expert")
    return {name: ref.shape for name, ref in moved.items()}


def _unread(arrays: Mapping[str, Any]) -> Any:
    raise AssertionError("coverage reads no tensor")  # pragma: no cover - never called: only shapes are asked


def _companion(name: str, names: Collection[str]) -> bool:
    """True for a quantization's scale (zero point, shape) beside the weight it belongs to."""
    found = _SCALES.search(name)
    if found is None:
        return False
    stem = name[: found.start()]
    return any(base in names for base in (stem, stem + "weight", stem.rpartition(".")[0] + ".weight"))


# A count of modules in a config (layers, experts, heads), at any depth (a vision or text sub-config too).
_COUNT_NAME = re.compile(r"layers|experts|heads", re.IGNORECASE)


def _check_counts(config: Mapping[str, Any], state: Mapping[str, TensorRef], where: str = "") -> None:
    """Refuse a count the tensors cannot hold (each layer, expert or head is at least one row of one tensor)
    before the config's model is built: ``num_hidden_layers: 1000000000`` would build a billion modules.

    Raises:
        InvalidConfigError: naming the field and the bound.
    """
    rows = sum(ref.shape[0] if ref.shape else 1 for ref in state.values())
    for key, value in config.items():
        name = f"{where}{key}"
        if isinstance(value, Mapping):
            _check_counts(value, state, f"{name}.")
        elif isinstance(value, int) and not isinstance(value, bool) and _COUNT_NAME.search(key) and value > rows:
            raise InvalidConfigError(
                f"config.json is not a valid model config: {name} is {value}, more than the {rows} rows the "
                "tensors hold; fix the field or give a config that matches the weights",
                field=name,
            )


def check(state: Mapping[str, TensorRef], model: Reference | str | None, *, allow_missing: bool) -> list[str]:
    """Refuse, in one line, a model folder whose weights miss a parameter of ``model``'s config's model (a
    ``--like`` reference, or the source's folder), have one it lacks, or one of another shape; ``allow_missing``:
    return those as notes instead. A note also says when nothing could be checked.

    Raises:
        TransformError: the first missing, unexpected and mis-shaped names, and how to write anyway.
    """
    config = read_config(model) if isinstance(model, str) else model.config if model is not None else None
    if config is None:
        return []
    if not isinstance(config.get("model_type"), str):
        return ["coverage not checked: config.json names no model_type (not a transformers model)"]
    if not any(key in config for key in _SIZES) and not isinstance(config.get("text_config"), dict):
        return [f"coverage not checked: config.json gives no model sizes ({', '.join(_SIZES[:2])} …)"]
    _check_counts(config, state)
    want = expected(config)
    if want is None:
        return [
            f"coverage not checked: neither transformers nor ckptconv knows model_type {config.get('model_type')!r}"
        ]
    declared = "quantization_config" in config
    unpacked = {(_PACKED.sub("", name) if declared else name): ref for name, ref in state.items()}
    companions = {name for name in unpacked if _companion(name, unpacked)}
    weights = {name: ref for name, ref in unpacked.items() if name not in companions}
    quantized = declared or bool(companions)
    shapes = dict(want.shapes)
    model_type = str(config.get("model_type"))
    if model_type in layouts.PER_EXPERT_TO_FUSED and layouts.layout_of(weights) == "per-expert":
        shapes = _per_expert(shapes, config, model_type)
    expect = {want.rename(name): shape for name, shape in shapes.items()}
    have = {want.rename(name): tuple(ref.shape) for name, ref in weights.items()}
    if have and not set(have) & set(expect):  # toy folders: a config beside weights it does not describe
        return [
            f"coverage not checked: none of the {len(have)} tensors is a parameter of the config's {model_type} "
            f"model ({want.by}), so its config.json does not describe them"
        ]
    fed = set(have)
    for names in want.tied:
        if names & fed:
            fed |= names
    missing = [name for name in expect if name not in fed and not want.optional(name)]
    unexpected = [name for name in have if name not in expect and not want.stale(name)]
    wrong = [
        f"{name} {list(shape)} (config: {list(expect[name])})"
        for name, shape in have.items()
        if name in expect and shape != expect[name] and not quantized
    ]
    problems = [
        f"{label} {bounded_list(names)}"
        for label, names in (
            ("lacks", missing),
            ("has what the model has no place for:", unexpected),
            ("has the wrong shape:", wrong),
        )
        if names
    ]
    if not problems:
        return []
    text = f"the weights do not make the config's {model_type} model ({want.by}): it " + "; it ".join(problems)
    if not allow_missing:
        raise TransformError(text + "; pass --allow-missing to write it anyway")
    return [text]


def spelled_like(weights: Mapping[str, TensorRef], like: Reference) -> tuple[dict[str, TensorRef], int]:
    """``weights`` with each name the reference spells otherwise, for the same parameter of its config's model
    (transformers' renamings: ``visual.*`` / ``model.visual.*``), spelled as the reference does; and how many.

    Raises:
        TransformError: two names would become one.
    """
    if set(weights) <= set(like.dtypes):
        return dict(weights), 0
    want = expected(like.config)
    if want is None:
        return dict(weights), 0
    theirs: dict[str, str] = {}
    for name in like.dtypes:
        theirs.setdefault(want.rename(name), name)
    out: dict[str, TensorRef] = {}
    renamed = 0
    for name, ref in weights.items():
        target = name if name in like.dtypes else theirs.get(want.rename(name), name)
        if target in out:
            raise TransformError(f"two tensors would both be spelled {target!r} as the reference spells it")
        renamed += target != name
        out[target] = ref
    return out, renamed
