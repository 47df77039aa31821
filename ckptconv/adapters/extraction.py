"""``extract_lora()``: a PEFT adapter folder out of a training checkpoint of a PEFT-wrapped model.

A training run saves the wrapped model's whole state dict (``torch.save(model.state_dict())``, Lightning's
``state_dict``, a Trainer checkpoint): the base's frozen weights (``...q_proj.base_layer.weight``) beside the
adapter's (``...q_proj.lora_A.default.weight``), under whatever the run added before PEFT's
``base_model.model.`` (Lightning's ``model.``, DDP's ``module.``, ``_orig_mod.``) or inside it (FSDP's
``_fsdp_wrapped_module.``, removed as ``--canonical`` removes it). The adapter's tensors are taken
out, named as ``PeftModel.save_pretrained`` names them (``get_peft_model_state_dict``: the adapter's name
removed, ``lora_magnitude_vector.weight`` as ``lora_magnitude_vector``, a module to save's copy under the
module's own name), and written with an ``adapter_config.json`` whose ``r``, ``rank_pattern``, ``use_dora``,
``lora_bias``, ``target_modules`` and ``modules_to_save`` come from the tensors. ``lora_alpha`` (and rsLoRA)
are not in the tensors: they come from an ``adapter_config.json`` beside the run, or ``alpha=``; with
neither, extraction is refused. The values are copied as they are, bit for bit.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from ckptconv._paths import PathLike, as_path
from ckptconv._text import plural, short_repr
from ckptconv.adapters.plan import PREFIX, group_tensors, plan_merge
from ckptconv.errors import TransformError
from ckptconv.loading import open as open_checkpoint
from ckptconv.reading.adapter_config import CONFIG_NAME, WEIGHTS_NAMES, AdapterConfig, parse_config
from ckptconv.reading.adapter_config import read_config as read_adapter_config
from ckptconv.reading.model_folder import model_folder
from ckptconv.reading.model_folder import read_config as read_model_config
from ckptconv.transforms.keys import canonicalize
from ckptconv.values.tensor import TensorRef
from ckptconv.writing import write_policy
from ckptconv.writing.atomic import atomic_output
from ckptconv.writing.writer import save

__all__ = ["ExtractionReport", "extract_lora"]

# A LoRA tensor in a wrapped model's state dict: the module, the role, the adapter's name, the rest.
_LORA = re.compile(
    r"^(?P<module>.+)\.(?P<role>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
    r"\.(?P<adapter>[^.]+)(?P<rest>(?:\.weight|\.bias)?)$"
)
_SAVED = re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<rest>.+)$")


@dataclass(frozen=True)
class ExtractionReport:
    """What :func:`extract_lora` wrote.

    Attributes:
        destination: the adapter folder.
        files: the files written.
        adapter: the adapter's name in the run (``"default"``).
        modules: the modules with a LoRA.
        tensors: tensors written.
        config: the ``adapter_config.json`` written.
        notes: what the user should hear.
    """

    destination: str
    files: tuple[str, ...]
    adapter: str
    modules: int
    tensors: int
    config: Mapping[str, object]
    notes: tuple[str, ...] = ()


def _adapter_tensors(
    weights: Mapping[str, TensorRef], adapter: str | None, where: str
) -> tuple[str, dict[str, TensorRef], list[str]]:
    """The adapter's name, its tensors under the names PEFT saves them with, and its modules to save."""
    found: dict[str, dict[str, TensorRef]] = {}
    saved_modules: dict[str, set[str]] = {}
    wrappers: set[str] = set()
    for key, ref in weights.items():
        lora, saved = _LORA.match(key), _SAVED.match(key)
        if lora is not None:
            role, rest = lora["role"], lora["rest"]
            rest = "" if role in ("lora_magnitude_vector", "lora_embedding_A", "lora_embedding_B") else rest
            module, name = lora["module"], lora["adapter"]
            saved_key = f"{module}.{role}{rest}"
        elif saved is not None:
            module, name, saved_key = saved["module"], saved["adapter"], f"{saved['module']}.{saved['rest']}"
            if PREFIX in module:
                saved_modules.setdefault(name, set()).add(module[module.find(PREFIX) + len(PREFIX) :])
        else:
            continue
        at = saved_key.find(PREFIX)
        if at < 0:
            raise TransformError(
                f"{where}: LoRA tensor {short_repr(key)} is not under PEFT's {PREFIX!r}; ckptconv extracts adapters "
                "of models wrapped by get_peft_model"
            )
        wrappers.add(saved_key[:at])
        found.setdefault(name, {})[saved_key[at:]] = ref
    if not found:
        raise TransformError(f"{where} holds no LoRA tensor (keys with .lora_A.<adapter>.weight); nothing to extract")
    if len(wrappers) > 1:
        shown = ", ".join(repr(w) for w in sorted(wrappers))
        raise TransformError(f"{where}: the LoRA tensors sit under different prefixes ({shown}); which model is it?")
    if adapter is None:
        if len(found) > 1:
            names = ", ".join(sorted(found))
            raise TransformError(f"{where} holds several adapters ({names}); pass --adapter-name to pick one")
        adapter = next(iter(found))
    if adapter not in found:
        raise TransformError(f"{where} holds no adapter {adapter!r} (it holds {', '.join(sorted(found))})")
    return adapter, found[adapter], sorted(saved_modules.get(adapter, ()))


def _found_config(run: str) -> AdapterConfig | None:
    folder = run if os.path.isdir(run) else os.path.dirname(os.path.abspath(run))
    return read_adapter_config(folder) if os.path.lexists(os.path.join(folder, CONFIG_NAME)) else None


def _targets(modules: list[str], base: Mapping[str, TensorRef]) -> list[str]:
    """``target_modules``: the modules' last names when PEFT would target exactly these modules of the base with
    them (name, or name ending in ``.`` + target), their full names otherwise."""
    leaves = sorted({module.rpartition(".")[2] for module in modules})
    matched = {
        key[: -len(".weight")]
        for key in base
        if key.endswith(".weight") and key[: -len(".weight")].rpartition(".")[2] in leaves
    }
    return leaves if matched == set(modules) else sorted(modules)


def _unwrapped(module: str) -> str:
    while module.endswith(".base_layer"):
        module = module[: -len(".base_layer")]
    return module


def _lora_a(tensors: Mapping[str, TensorRef], module: str) -> TensorRef:
    linear = f"{PREFIX}{module}.lora_A.weight"
    return tensors[linear] if linear in tensors else tensors[f"{PREFIX}{module}.lora_embedding_A"]


def _escaped(module: str) -> str:
    return module.replace(".", "\\.")


def extract_lora(
    run: PathLike,
    destination: PathLike,
    *,
    base: PathLike,
    alpha: float | None = None,
    use_rslora: bool | None = None,
    adapter_name: str | None = None,
    select: str | None = None,
    overwrite: bool = False,
    fsync: bool = True,
) -> ExtractionReport:
    """Write the LoRA adapter held in a training checkpoint as a PEFT adapter folder.

    Args:
        run: a training checkpoint of a PEFT-wrapped model (any format :func:`ckptconv.open` reads).
        destination: the adapter folder to write (``adapter_model.safetensors``, ``adapter_config.json``).
        base: the base model (folder or file): the adapter's modules are checked against its tensors, and
            ``target_modules`` is derived from its names.
        alpha: ``lora_alpha``; needed unless an ``adapter_config.json`` lies beside ``run`` (then it must agree).
        use_rslora: rsLoRA scaling; from that config when None (False without one).
        adapter_name: which adapter, when the run holds several.
        select: where the weights are in the checkpoint (as ``--select``).
        overwrite: replace an existing adapter folder's files.
        fsync: as for :func:`ckptconv.convert`.

    Returns:
        An :class:`ExtractionReport`.

    Raises:
        TransformError: no LoRA tensors, several adapters, no alpha, tensors that do not fit the base.
        LoadError, WriteError: as for :func:`ckptconv.convert`.

    Example:
        >>> ckptconv.extract_lora("last.ckpt", "adapter/", base="llama/", alpha=16)  # doctest: +SKIP
    """
    run, destination, base = as_path(run), as_path(destination), as_path(base)
    checkpoint = open_checkpoint(run)
    # FSDP's and activation checkpointing's wrappers sit inside the module path; torch.compile's and DDP's before it.
    weights, _ = canonicalize(checkpoint.select(select).weights)
    adapter, tensors, saved = _adapter_tensors(weights, adapter_name, repr(run))
    found = _found_config(run)
    if found is not None and alpha is not None and alpha != found.lora_alpha:
        raise TransformError(
            f"--alpha {alpha:g} and the {CONFIG_NAME} beside {run!r} (lora_alpha {found.lora_alpha:g}) disagree; "
            "give one"
        )
    if alpha is not None:
        lora_alpha: float = alpha
    elif found is not None:
        lora_alpha = found.lora_alpha
    else:
        raise TransformError(
            f"{run!r} does not say the adapter's lora_alpha (it is not in the tensors, and no {CONFIG_NAME} lies "
            "beside it); pass --alpha"
        )
    rslora = use_rslora if use_rslora is not None else (found.use_rslora if found is not None else False)
    modules = sorted({key[len(PREFIX) :].rsplit(".lora_", 1)[0] for key in tensors if ".lora_" in key})
    # LoRAs on parameters (target_parameters: PEFT's nested ParamWrappers, M.lora_A, M.base_layer.lora_A ...):
    # which parameters they are is not in the tensors, only in the run's config.
    parameters = found.target_parameters if found is not None else ()
    owners = {name.rpartition(".")[0] for name in parameters}
    wrapped = [m for m in modules if any(_unwrapped(m) == o or _unwrapped(m).endswith("." + o) for o in owners)]
    if not parameters and any(module.endswith(".base_layer") for module in modules):
        raise TransformError(
            f"{run!r} holds LoRAs on parameters (target_parameters); put the run's {CONFIG_NAME} beside it, which "
            "names them"
        )
    modules = [module for module in modules if module not in wrapped]
    ranks = {module: _lora_a(tensors, module).shape[0] for module in modules}
    # With parameter LoRAs only, r is the run's config's (checked against the tensors below).
    fallback = found.r if found is not None else 0
    r = Counter(ranks.values()).most_common(1)[0][0] if ranks else fallback
    base_weights = open_checkpoint(base).select().weights
    base_folder = model_folder(base)
    base_config = read_model_config(base_folder) if base_folder is not None else None
    config: dict[str, object] = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": lora_alpha,
        "use_rslora": rslora,
        "use_dora": any(key.endswith(".lora_magnitude_vector") for key in tensors),
        "lora_bias": any(key.endswith(".lora_B.bias") for key in tensors),
        "target_modules": _targets(modules, base_weights) if modules else [],
        "target_parameters": list(parameters) or None,
        "rank_pattern": {_escaped(module): rank for module, rank in ranks.items() if rank != r},
        "alpha_pattern": {},
        "modules_to_save": saved or None,
        "fan_in_fan_out": False,
        "base_model_name_or_path": os.path.abspath(base),
        "task_type": None,
        "bias": "none",
        "inference_mode": True,
    }
    if found is not None and (found.rank_pattern or found.alpha_pattern):
        raise TransformError(
            f"the {CONFIG_NAME} beside {run!r} has rank or alpha patterns; ckptconv extracts uniform-alpha adapters"
        )
    parsed = parse_config(config, f"the config for {destination!r}")
    model_type = base_config.get("model_type", "") if base_config is not None else ""
    plans = plan_merge(
        base_weights, group_tensors(tensors, parsed, repr(run)), parsed, model_type=str(model_type), where=repr(run)
    )
    if any(plan.fan_in_fan_out and plan.kind != "embedding" for plan in plans.values()):
        config["fan_in_fan_out"] = True
    for module, rank in ranks.items():  # the patterns give every module its rank back
        if parsed.rank(module) != rank:
            raise TransformError(f"rank_pattern would give {module!r} rank {parsed.rank(module)}, not {rank}")
    made = write_policy.missing_folders(destination, folder_output=True)
    write_policy.make_folders(os.path.abspath(destination))
    weights_file = os.path.join(destination, WEIGHTS_NAMES[0])
    written: list[str] = []
    try:
        report = save(
            dict(sorted(tensors.items())),
            weights_file,
            overwrite=overwrite,
            metadata={"format": "pt"},
            inputs=checkpoint.files or (checkpoint.path,),
            fsync=fsync,
        )
        written += report.files
        target = os.path.join(destination, CONFIG_NAME)
        with atomic_output(target, overwrite=overwrite, fsync=fsync) as output:
            output.write(json.dumps(config, indent=2, sort_keys=True).encode("utf-8") + b"\n")
        written.append(os.path.abspath(target))
    except BaseException:
        write_policy.remove_written(written, made)
        raise
    counted = plural(len(modules), "module") + (f" and {plural(len(wrapped), 'parameter')}" if wrapped else "")
    notes = (f"extracted adapter {adapter!r}: {counted}, r={r}, lora_alpha={lora_alpha:g}",)
    return ExtractionReport(
        os.path.abspath(destination), tuple(written), adapter, len(modules), len(tensors), config, notes
    )
