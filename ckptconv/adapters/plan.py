"""Which base tensor gets which part of an adapter: the plan of a merge, from names and shapes alone.

A PEFT adapter file (``get_peft_model_state_dict``) names its tensors after the model's modules under
``base_model.model.``:

- ``M.lora_A.weight`` (r, in), ``M.lora_B.weight`` (out, r) and, with ``lora_bias``, ``M.lora_B.bias``:
  a LoRA on the linear (or GPT-2 ``Conv1D``) module ``M``, merged into ``M.weight`` (and ``M.bias``);
- ``M.lora_magnitude_vector`` (out): DoRA's magnitude for that module;
- ``M.lora_embedding_A`` (r, num_embeddings), ``M.lora_embedding_B`` (dim, r): a LoRA on the embedding ``M``;
- ``M.base_layer.weight``: the base layer's own weight, which PEFT loads into the base before it merges
  (it saves the embeddings it adapted, in case their vocabulary was resized);
- any other tensor: a parameter of one of ``modules_to_save``, which replaces the base's wholesale.

:func:`plan_merge` matches those with the base state dict's keys and shapes and returns one
:class:`TensorPlan` per base tensor that changes. Nothing here reads a tensor's bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from ckptconv._text import short_repr
from ckptconv.dtypes import DType
from ckptconv.errors import TransformError
from ckptconv.reading.adapter_config import AdapterConfig
from ckptconv.values.tensor import TensorRef

__all__ = ["PREFIX", "AdapterTensors", "TensorPlan", "group_tensors", "plan_merge"]

#: PeftModel's names: its base_model (the LoraModel) holds the model as ``model``.
PREFIX = "base_model.model."

# The base dtypes PEFT merges a LoRA into on the CPU (float8 and integer bases are quantized: dequantize them).
_FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})

# transformers' Conv1D modules (weight stored as (in, out)), by model type and module name: PEFT merges these
# transposed (fan_in_fan_out), whatever adapter_config.json says. Where a weight is square only the model's
# architecture tells the two apart.
_CONV1D = {
    "gpt2": frozenset({"c_attn", "q_attn", "c_proj", "c_fc"}),
    "decision_transformer": frozenset({"c_attn", "q_attn", "c_proj", "c_fc"}),
    "imagegpt": frozenset({"c_attn", "q_attn", "c_proj", "c_fc"}),
    "openai-gpt": frozenset({"c_attn", "c_proj", "c_fc"}),
    "clvp": frozenset({"c_fc", "c_proj"}),
}


@dataclass(frozen=True)
class AdapterTensors:
    """An adapter's tensors by role, under the model's module names (the ``base_model.model.`` prefix gone).

    Attributes:
        linear: module -> ``{"A", "B", "bias"?, "magnitude"?}``.
        embedding: module -> ``{"A", "B"}``.
        base_layers: base key -> the value PEFT loads into it before merging.
        saved: base key -> a ``modules_to_save`` parameter's value.
        parameters: with ``target_parameters``, module -> the LoRAs on its parameters, outermost wrapper first
            (PEFT nests one ``ParamWrapper`` per parameter: ``M.lora_A``, ``M.base_layer.lora_A`` ...).
    """

    linear: Mapping[str, Mapping[str, TensorRef]]
    embedding: Mapping[str, Mapping[str, TensorRef]]
    base_layers: Mapping[str, TensorRef]
    saved: Mapping[str, TensorRef]
    parameters: Mapping[str, tuple[Mapping[str, TensorRef], ...]] = dataclasses.field(default_factory=dict)


_ROLES = (
    (".lora_A.weight", "linear", "A"),
    (".lora_B.weight", "linear", "B"),
    (".lora_B.bias", "linear", "bias"),
    (".lora_magnitude_vector", "linear", "magnitude"),
    (".lora_embedding_A", "embedding", "A"),
    (".lora_embedding_B", "embedding", "B"),
)


def group_tensors(tensors: Mapping[str, TensorRef], config: AdapterConfig, where: str) -> AdapterTensors:
    """The adapter file's tensors, grouped by module and role.

    Raises:
        TransformError: a key without PEFT's prefix, or one that is neither a LoRA tensor, a base layer's, nor a
            parameter of a module to save.
    """
    linear: dict[str, dict[str, TensorRef]] = {}
    embedding: dict[str, dict[str, TensorRef]] = {}
    base_layers: dict[str, TensorRef] = {}
    saved: dict[str, TensorRef] = {}
    for key, ref in tensors.items():
        if not key.startswith(PREFIX):
            raise TransformError(
                f"{where}: tensor {short_repr(key)} does not start with {PREFIX!r}, as PEFT's adapter files do; "
                "if this is a training checkpoint, run ckptconv extract-lora on it first"
            )
        name = key[len(PREFIX) :]
        for suffix, kind, role in _ROLES:
            if name.endswith(suffix):
                module = name[: -len(suffix)]
                (linear if kind == "linear" else embedding).setdefault(module, {})[role] = ref
                break
        else:
            module, _, parameter = name.rpartition(".")
            if module.endswith(".base_layer"):
                base_layers[f"{module[: -len('.base_layer')]}.{parameter}"] = ref
            elif config.saves(module):
                saved[name] = ref
            else:
                raise TransformError(
                    f"{where}: tensor {short_repr(key)} is neither a LoRA weight nor part of modules_to_save "
                    f"({', '.join(config.modules_to_save) or 'none'}); ckptconv does not know how PEFT loads it"
                )
    for module in [m for m in linear if m in embedding and set(linear[m]) == {"magnitude"}]:
        embedding[module]["magnitude"] = linear.pop(module)["magnitude"]  # DoRA on an embedding
    parameters = _parameter_loras(linear, config, where) if config.target_parameters else {}
    for module, roles in {**linear, **embedding}.items():
        missing = [role for role in ("A", "B") if role not in roles]
        if missing:
            raise TransformError(f"{where}: module {short_repr(module)} has no lora_{missing[0]} tensor")
    for module, roles in linear.items():
        if ("magnitude" in roles) != config.use_dora:
            said = "sets" if config.use_dora else "does not set"
            raise TransformError(
                f"{where}: module {short_repr(module)} {'lacks' if config.use_dora else 'has'} a DoRA magnitude "
                f"vector while the config {said} use_dora"
            )
        if "bias" in roles and not config.lora_bias:
            raise TransformError(f"{where}: module {short_repr(module)} has a lora_B bias but lora_bias is false")
    for module, roles in embedding.items():
        if ("magnitude" in roles) != config.use_dora:
            raise TransformError(
                f"{where}: embedding {short_repr(module)}'s DoRA magnitude vector does not agree with use_dora"
            )
    return AdapterTensors(linear, embedding, base_layers, saved, parameters)


def _parameter_loras(
    linear: dict[str, dict[str, TensorRef]], config: AdapterConfig, where: str
) -> dict[str, tuple[Mapping[str, TensorRef], ...]]:
    """The LoRAs of ``target_parameters`` taken out of ``linear``: by module, outermost wrapper first."""
    targets = {name.rpartition(".")[0] for name in config.target_parameters}
    found: dict[str, dict[int, Mapping[str, TensorRef]]] = {}
    for name in list(linear):
        module, depth = name, 0
        while module.endswith(".base_layer"):
            module, depth = module[: -len(".base_layer")], depth + 1
        if any(module == target or module.endswith("." + target) for target in targets):
            found.setdefault(module, {})[depth] = linear.pop(name)
    for module, depths in found.items():
        if sorted(depths) != list(range(len(depths))):
            raise TransformError(f"{where}: the parameter LoRAs of {short_repr(module)} skip a wrapper level")
        if any(set(roles) != {"A", "B"} for roles in depths.values()):
            raise TransformError(f"{where}: a parameter LoRA of {short_repr(module)} is not one lora_A and one lora_B")
    return {module: tuple(depths[d] for d in range(len(depths))) for module, depths in found.items()}


@dataclass(frozen=True)
class TensorPlan:
    """What one base tensor becomes.

    Attributes:
        kind: ``"linear"`` (delta added in place, in the delta's dtype), ``"dora"``, ``"experts"``, ``"conv"``,
            ``"embedding"`` (delta cast to the base dtype, then added), ``"dora-embedding"``, ``"bias"``
            (``lora_B.bias * scaling`` added), ``"replace"`` (a module to save's value, cast to the base dtype).
        inputs: the tensors the result is computed from, by role: ``weight`` the base's, or ``loaded`` the
            value PEFT loads into the base layer first (then cast to ``dtype``); ``A``, ``B``, ``magnitude``.
        dtype: the base tensor's dtype, which the result keeps.
        scaling: the adapter's scaling for the module.
        fan_in_fan_out: the base weight is stored (in, out), as GPT-2's Conv1D.
        module: the module's name in the model.
        experts: ``"experts"`` (a LoRA on a 3-D parameter, ``target_parameters``): how many experts it stacks.
        swapped: ``"experts"``: the parameter is (experts, out, in) (PEFT swaps in and out), not (experts, in, out).
        parts: ``"cat-linear"``, ``"cat-embedding"`` (weighted adapters): ``(i, weight, scaling)`` of each adapter
            whose ``A<i>``, ``B<i>`` are inputs, in order; ``rank``: the combined adapter's rank.
    """

    kind: str
    inputs: Mapping[str, TensorRef]
    dtype: DType
    scaling: float = 1.0
    fan_in_fan_out: bool = False
    module: str = ""
    experts: int = 0
    swapped: bool = False
    parts: tuple[tuple[str, float, float], ...] = ()
    rank: int = 0


def _float(ref: TensorRef, key: str, where: str) -> None:
    if ref.out_dtype.name not in _FLOATS:
        raise TransformError(
            f"{where}: base tensor {short_repr(key)} is {ref.out_dtype.name}; LoRA merges into float16, bfloat16 "
            "or float32 weights (pass --dtype bf16 to dequantize a quantized base first)"
        )


def _fan_in_fan_out(
    module: str, shape: tuple[int, ...], a: TensorRef, b: TensorRef, model_type: str, where: str
) -> bool | None:
    """True when the module is a Conv1D (weight (in, out)), as PEFT decides from the module's class; None when
    neither the shape nor the architecture tells."""
    out_features, in_features = b.shape[0], a.shape[1]
    if len(shape) != 2 or {tuple(shape)} & {(out_features, in_features), (in_features, out_features)} == set():
        raise TransformError(
            f"{where}: module {short_repr(module)}'s LoRA is ({out_features} x r) @ (r x {in_features}), which does "
            f"not fit its base weight of shape {tuple(shape)}"
        )
    if out_features != in_features:
        return tuple(shape) == (in_features, out_features)
    if not model_type:
        return None  # a square weight of a base without config.json: Conv1D and Linear look alike
    return module.rpartition(".")[2] in _CONV1D.get(model_type, frozenset())


def _conv_plan(
    module: str, weight: TensorRef, roles: Mapping[str, TensorRef], r: int, config: AdapterConfig, where: str
) -> TensorPlan:
    """A LoRA on a Conv1d or Conv2d of one group (PEFT refuses to merge grouped convolutions)."""
    a, b, shape = roles["A"], roles["B"], tuple(weight.shape)
    kernel = tuple(a.shape[2:])
    if (
        len(shape) not in (3, 4)
        or len(a.shape) != len(shape)
        or tuple(b.shape) != (shape[0], r, *(1,) * len(kernel))
        or a.shape[0] != r
        or shape[2:] != kernel
        or "magnitude" in roles
    ):
        raise TransformError(
            f"{where}: module {short_repr(module)}'s LoRA (lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}) is not a "
            f"rank-{r} LoRA of its {shape} convolution that ckptconv merges (Conv1d or Conv2d, no DoRA)"
        )
    if shape[1] != a.shape[1]:
        raise TransformError(
            f"{where}: module {short_repr(module)} is a grouped convolution, which PEFT does not merge either"
        )
    return TensorPlan(
        "conv", {"weight": weight, "A": a, "B": b}, weight.out_dtype, config.scaling(module), False, module
    )


def _weight(plans: Mapping[str, TensorPlan], key: str, weight: TensorRef) -> dict[str, TensorRef]:
    """The weight a LoRA is merged into: the base's, or the base layer's value the adapter holds."""
    return {"loaded": plans[key].inputs["loaded"]} if key in plans else {"weight": weight}


def plan_merge(
    state: Mapping[str, TensorRef], adapter: AdapterTensors, config: AdapterConfig, *, model_type: str, where: str
) -> dict[str, TensorPlan]:
    """The plan: each base key that changes, and how.

    Args:
        state: the base's state dict (names and shapes; nothing is read).
        adapter: the adapter's tensors (:func:`group_tensors`).
        config: the adapter's config.
        model_type: the base's ``config.json`` ``model_type`` ("" without one): tells a square Conv1D weight
            from a Linear one.
        where: the adapter, for messages.

    Raises:
        TransformError: a module the base does not hold, shapes or a rank that do not fit, a non-float base.
    """
    plans: dict[str, TensorPlan] = {}
    square: list[str] = []  # square weights of a base whose architecture is unknown
    conv1d = False

    def base(key: str) -> TensorRef:
        ref = state.get(key)
        if ref is None:
            raise TransformError(
                f"{where}: the adapter changes {short_repr(key)}, which the base does not hold (a tied weight, or "
                "another model's adapter?); nothing was written"
            )
        _float(ref, key, where)
        return ref

    def plan_bias(module: str, lora_bias: TensorRef) -> None:
        """The module's bias plus its lora_B bias (PEFT's ``lora_bias``), after the module's weight plan."""
        bias_key = f"{module}.bias"
        bias = base(bias_key)
        if tuple(lora_bias.shape) != tuple(bias.shape):
            raise TransformError(f"{where}: module {short_repr(module)}'s lora_B bias does not fit its bias")
        inputs = {**_weight(plans, bias_key, bias), "B": lora_bias}
        plans[bias_key] = TensorPlan("bias", inputs, bias.out_dtype, config.scaling(module), module=module)

    for key, value in {**adapter.base_layers, **adapter.saved}.items():
        ref = base(key)
        if tuple(value.shape) != tuple(ref.shape):
            raise TransformError(
                f"{where}: {short_repr(key)} is {tuple(value.shape)} in the adapter and {tuple(ref.shape)} in the "
                "base; PEFT cannot load it either"
            )
        plans[key] = TensorPlan("replace", {"loaded": value}, ref.out_dtype)
    for module, roles in adapter.linear.items():
        key = f"{module}.weight"
        weight = base(key)
        a, b = roles["A"], roles["B"]
        r = config.rank(module)
        if len(a.shape) > 2:  # a convolution's LoRA: A a conv (in -> r, the kernel), B a 1x1 conv (r -> out)
            plans[key] = _conv_plan(module, weight, roles, r, config, where)
            if "bias" in roles:
                plan_bias(module, roles["bias"])
            continue
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != r or b.shape[1] != r:
            raise TransformError(
                f"{where}: module {short_repr(module)}'s lora_A is {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                f"which is not a rank-{r} LoRA (r or rank_pattern in the config)"
            )
        told = _fan_in_fan_out(module, tuple(weight.shape), a, b, model_type, where)
        if told is None:
            square.append(module)
        fifo = bool(told)
        conv1d |= fifo
        inputs = {**_weight(plans, key, weight), "A": a, "B": b}
        if "magnitude" in roles:
            if tuple(roles["magnitude"].shape) != (b.shape[0],):
                raise TransformError(f"{where}: module {short_repr(module)}'s DoRA magnitude is not {b.shape[0]} long")
            inputs["magnitude"] = roles["magnitude"]
        kind = "dora" if "magnitude" in roles else "linear"
        plans[key] = TensorPlan(kind, inputs, weight.out_dtype, config.scaling(module), fifo, module)
        if "bias" in roles:
            plan_bias(module, roles["bias"])
    for module, roles in adapter.embedding.items():
        key = f"{module}.weight"
        weight = base(key)
        a, b = roles["A"], roles["B"]
        r = config.rank(module)
        if (
            len(a.shape) != 2
            or len(b.shape) != 2
            or a.shape[0] != r
            or b.shape[1] != r
            or tuple(weight.shape) != (a.shape[1], b.shape[0])
        ):
            raise TransformError(
                f"{where}: embedding {short_repr(module)}'s lora_embedding_A is {tuple(a.shape)} and "
                f"lora_embedding_B {tuple(b.shape)}, which does not fit a rank-{r} LoRA of its {tuple(weight.shape)} "
                "weight"
            )
        inputs = {**_weight(plans, key, weight), "A": a, "B": b}
        kind = "embedding"
        if "magnitude" in roles:
            if tuple(roles["magnitude"].shape) != (b.shape[0],):
                raise TransformError(
                    f"{where}: embedding {short_repr(module)}'s DoRA magnitude is not {b.shape[0]} long"
                )
            inputs["magnitude"], kind = roles["magnitude"], "dora-embedding"
        plans[key] = TensorPlan(kind, inputs, weight.out_dtype, config.scaling(module), True, module)
    for module, loras in adapter.parameters.items():
        plans.update(plan_parameters(state, module, loras, config, model_type=model_type, where=where))
    if not plans:
        raise TransformError(f"{where}: the adapter holds no LoRA tensor; nothing to merge")
    if square and (conv1d or config.fan_in_fan_out):
        # PEFT transposes Conv1D modules' deltas and not Linear ones; only the architecture tells them apart here.
        raise TransformError(
            f"{where}: the base has Conv1D weights (stored in x out: fan_in_fan_out), and {short_repr(square[0])}'s "
            "is square, so its shape does not say which it is; give the base as its model folder (with config.json)"
        )
    return plans


# transformers' expert modules whose fused parameters are stored (experts, in, out) (``is_transposed = True``); the
# others store (experts, out, in), which PEFT's ParamWrapper merges with in and out swapped. Where a parameter is
# square only the model's architecture tells the two apart.
_TRANSPOSED_EXPERTS = frozenset({"gpt_oss", "ergo", "aria", "openai_privacy_filter"})


def plan_parameters(
    state: Mapping[str, TensorRef],
    module: str,
    loras: tuple[Mapping[str, TensorRef], ...],
    config: AdapterConfig,
    *,
    model_type: str,
    where: str,
) -> dict[str, TensorPlan]:
    """The plans of the LoRAs PEFT's ``ParamWrapper`` puts on ``module``'s 3-D parameters (``target_parameters``).

    PEFT nests one wrapper per parameter, in an order the file does not record, so each LoRA is matched with the
    one targeted parameter of the base whose shape it fits; a LoRA that fits two is refused.
    """
    names = [
        f"{module}.{name.rpartition('.')[2]}"
        for name in config.target_parameters
        if module == name.rpartition(".")[0] or module.endswith("." + name.rpartition(".")[0])
    ]
    present = [key for key in dict.fromkeys(names) if key in state]
    if not present:
        raise TransformError(
            f"{where}: the adapter changes {short_repr(names[0] if names else module)}, which the base does not hold "
            "as one tensor (transformers may fuse the experts as it loads them); ckptconv merges a LoRA on "
            "parameters only into a base file that holds the parameter itself"
        )
    plans: dict[str, TensorPlan] = {}
    for depth, roles in enumerate(loras):
        a, b = roles["A"], roles["B"]
        fits = [(key, swapped) for key in present for swapped in _orientations(state[key], a, b, model_type)]
        keys = {key for key, _ in fits}
        if len(keys) != 1 or len(fits) != 1:
            shown = ", ".join(present)
            raise TransformError(
                f"{where}: the parameter LoRA of {short_repr(module)} at wrapper depth {depth} (lora_A "
                f"{tuple(a.shape)}, lora_B {tuple(b.shape)}) fits {len(fits)} of its targeted parameters ({shown}); "
                "ckptconv cannot tell which PEFT wrapped"
            )
        (key, swapped), weight = fits[0], state[fits[0][0]]
        _float(weight, key, where)
        experts, r = weight.shape[0], config.rank(key)
        if key in plans or a.shape[0] != r * experts or config.lora_bias or config.use_dora:
            raise TransformError(
                f"{where}: {short_repr(key)}'s LoRA is not one rank-{r} LoRA over {experts} experts as PEFT makes them"
            )
        plans[key] = TensorPlan(
            "experts",
            {"weight": weight, "A": a, "B": b},
            weight.out_dtype,
            config.scaling(key),
            False,
            key,
            experts=experts,
            swapped=swapped,
        )
    return plans


def _orientations(weight: TensorRef, a: TensorRef, b: TensorRef, model_type: str) -> list[bool]:
    """How a parameter LoRA (A (r*E, in), B (out, r*E)) fits a 3-D parameter: ``[False]`` as (E, in, out),
    ``[True]`` as (E, out, in) (swapped), both when square and the architecture does not say, none when it does not."""
    if len(weight.shape) != 3 or len(a.shape) != 2 or len(b.shape) != 2:
        return []
    in_features, out_features = a.shape[1], b.shape[0]
    found = [
        swapped
        for swapped, shape in ((False, (in_features, out_features)), (True, (out_features, in_features)))
        if tuple(weight.shape[1:]) == shape
    ]
    if len(found) == 2 and model_type:
        return [model_type not in _TRANSPOSED_EXPERTS]
    return found
