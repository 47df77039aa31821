"""Model folders: the folder a checkpoint's weights came in, and the configuration it declares.

A Hugging Face model folder holds its weights (one file, or an index and shards) beside a
``config.json`` that says what model they are, and how they were quantized. The configuration
is read only where the checkpoint *is* the folder (a folder or its ``*.index.json`` was given):
a single file given on its own is converted for what it holds, and never looks beside itself.

:func:`inventory` lists what else such a folder holds, for a conversion that hands the user a model
folder back: the files to carry (configs, generation config, tokenizer and processor files, chat
templates, PEFT's ``adapter_config.json``, model cards, ``*.py`` remote code, which is read as bytes and
never imported), the training state a training run saved beside the model (recognised by content:
:func:`ckptconv.reading.detection.training_state_of`), and weights in other formats. Hidden files and
folders (``.git``, ``.cache``, ``.gitattributes``) are not part of a model and are not listed.

A folder of model folders declares its parts: sentence-transformers' ``modules.json`` (``2_Dense/``, with
weights of its own, beside the transformer at the top) and diffusers' ``model_index.json`` (``unet/``,
``vae/``, ``text_encoder/``). :func:`components` lists those that hold weights, each converted as a model
folder of its own; the inventory of the folder above leaves them to that conversion. Any other subfolder
that holds weights (a training run's ``checkpoint-500/`` beside the model it saved) is left out whole.

:func:`resolve_model` turns a source into a :class:`Model` once: what it is (a model folder, a training run's
folder, an adapter, a folder of model folders), its configuration and the files its weights are in. ``convert``,
``batch`` (a model folder in a zoo is one item, converted as ``convert`` converts it), ``inspect`` and ``--like``
ask it rather than looking beside the weights again.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ckptconv._text import short_repr
from ckptconv.errors import CkptconvError, InvalidConfigError, MalformedCheckpointError
from ckptconv.reading import read_policy
from ckptconv.reading.detection import checkpoint_files, is_checkpoint_file, is_unsafe, resolve, training_state_of
from ckptconv.reading.model_config import MAX_CONFIG_BYTES, ModelConfig, parse_config_text, parse_model_config
from ckptconv.suffixes import INDEX_SUFFIXES

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "CONFIG_NAME",
    "DECLARATIONS",
    "FRAMEWORK_FORMATS",
    "MAX_CARRIED_BYTES",
    "MAX_CONFIG_BYTES",
    "Inventory",
    "Model",
    "components",
    "holds_weights",
    "inventory",
    "model_folder",
    "read_config",
    "resolve_model",
]

CONFIG_NAME = "config.json"
ADAPTER_CONFIG_NAME = "adapter_config.json"
#: What a :class:`Model` is.
MODEL_FOLDER, TRAINING_RUN, ADAPTER, MODEL_FOLDERS = "model folder", "training run", "adapter", "model folders"
#: Folders of a training framework's own layout: their weights are no Hugging Face model folder's.
FRAMEWORK_FORMATS = ("dcp", "megatron-torch-dist", "deepspeed", "rank-shards")
#: The files that declare a folder of model folders: sentence-transformers' modules and diffusers' components.
MODULES_NAME = "modules.json"
MODEL_INDEX_NAME = "model_index.json"
DECLARATIONS = (MODULES_NAME, MODEL_INDEX_NAME)
# A module folder's name: one plain component, inside the folder that declares it.
_PLAIN_NAME = re.compile(r"^(?!\.\.?$)[^/\\\x00]+$")
#: The largest file carried beside the weights: a tokenizer.json is tens of megabytes. A larger one is left out,
#: with a note naming it.
MAX_CARRIED_BYTES = 1 << 30

# Files a model folder holds that ckptconv knows: carried without a note. Anything else is carried verbatim too,
# and named in a note (ckptconv cannot tell whether the conversion changed what it describes).
_KNOWN = re.compile(
    r"""(^|/)(
        (generation_|preprocessor_|processor_|image_processor_|video_preprocessor_|feature_extractor_|adapter_|
         scheduler_|sentence_bert_|tokenizer_|audio_processor_)?config\.json
      | config_sentence_transformers\.json
      | (tokenizer|vocab|merges|spiece|sentencepiece|special_tokens_map|added_tokens|chat_template|
         modules|model_index|preprocessor|processor)[^/]*
      | [^/]*\.(md|py|jinja|txt|model|tiktoken)
      | LICEN[CS]E[^/]* | NOTICE[^/]* | USE_POLICY[^/]*
    )$""",
    re.VERBOSE,
)
# Weights in formats ckptconv does not convert (flax, TensorFlow, ONNX, GGUF, Core ML, rust-bert): left out with a
# note, so the output never holds weights that disagree with the converted ones.
_OTHER_FORMATS = (".msgpack", ".h5", ".onnx", ".onnx_data", ".gguf", ".tflite", ".ot", ".mlmodel")
# JSON a training run writes beside the model (HF Trainer's log history): training state by what it is.
_TRAINING_JSON = ("trainer_state.json",)


@dataclass(frozen=True)
class Inventory:
    """What a model folder holds besides the weights a conversion reads.

    Attributes:
        folder: the model folder.
        carried: files to copy to a folder output, relative ``/``-separated names, sorted.
        unknown: those of ``carried`` ckptconv does not interpret (copied verbatim, named in a note).
        training_state: ``(name, what)`` for each file of training state, left out.
        other_weights: weights in other formats, or other checkpoints (in subfolders too), left out.
        too_large: files over :data:`MAX_CARRIED_BYTES`, left out.
        other_folders: subfolders that hold weights and are no component (``checkpoint-500/``), left out whole.
        unsafe: checkpoints refused as unsafe (they name code-running callables), left out and never converted.
    """

    folder: str
    carried: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    training_state: tuple[tuple[str, str], ...] = ()
    other_weights: tuple[str, ...] = ()
    too_large: tuple[str, ...] = ()
    other_folders: tuple[str, ...] = ()
    unsafe: tuple[str, ...] = ()

    def path(self, name: str) -> str:
        """The file ``name`` (one of :attr:`carried`) names, checked by the read policy (inside the folder)."""
        return read_policy.member(self.folder, name, source=self.folder, what="model file")


def _walk(folder: str) -> Iterable[str]:
    """Every regular file's relative name under ``folder``, hidden ones apart, in ``os.walk``'s order (a folder's
    files, then its subfolders). A link to a folder inside ``folder`` is followed (its files are carried under the
    link's name, as transformers reads them); a link that leads out of the folder, to a file or a folder, is refused
    by the read policy, as is a link to a folder that holds it (a loop)."""

    def visit(path: str, relative: str, ancestors: frozenset[str]) -> Iterator[str]:
        subfolders: list[tuple[str, str]] = []
        for name in sorted(os.listdir(path)):
            if name.startswith("."):
                continue
            entry = os.path.join(path, name)
            if os.path.isdir(entry):
                if os.path.islink(entry):
                    if not read_policy.within(entry, folder):
                        raise MalformedCheckpointError(
                            f"{entry!r} is a link that leads outside the checkpoint folder {folder!r}; ckptconv reads "
                            "only files inside it (copy the folder in instead of linking it)",
                            path=entry,
                        )
                    if os.path.realpath(entry) in ancestors:
                        raise MalformedCheckpointError(
                            f"{entry!r} is a link to a folder that holds it (a loop); remove the link", path=entry
                        )
                subfolders.append((entry, f"{relative}{name}/"))
                continue
            info = read_policy.check_file(entry, folder=folder)  # links out, FIFOs, devices: refused
            if stat.S_ISREG(info.st_mode):
                yield f"{relative}{name}"
        for entry, name in subfolders:
            yield from visit(entry, name, ancestors | {os.path.realpath(entry)})

    return visit(folder, "", frozenset({os.path.realpath(folder)}))


def _read_json(folder: str, name: str) -> Any:
    path = os.path.join(folder, name)
    if not os.path.lexists(path):
        return None
    data = read_policy.read_limited(path, limit=MAX_CONFIG_BYTES, folder=folder, what=name)
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise MalformedCheckpointError(f"{path!r} is not JSON; fix or remove it", path=path) from None


def _declared(folder: str) -> list[object]:
    """The subfolder names ``modules.json`` or ``model_index.json`` declare (unchecked)."""
    modules = _read_json(folder, MODULES_NAME)
    names: list[object] = []
    if isinstance(modules, list):
        names += [module.get("path") for module in modules if isinstance(module, dict) and module.get("path")]
    index = _read_json(folder, MODEL_INDEX_NAME)
    if isinstance(index, dict):
        names += [name for name, value in index.items() if not str(name).startswith("_") and isinstance(value, list)]
    return names


def holds_weights(folder: str) -> bool:
    """True when ``folder`` holds a weights file at its top (training state apart)."""
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.startswith(".") or not os.path.isfile(path) or name.lower().endswith(_OTHER_FORMATS):
            continue
        if name.endswith(INDEX_SUFFIXES) or (is_checkpoint_file(path) and training_state_of(path) is None):
            return True
    return False


def components(folder: str) -> tuple[str, ...]:
    """The model folders inside ``folder`` that its ``modules.json`` (sentence-transformers) or ``model_index.json``
    (diffusers) declares and that hold weights: plain names of real folders inside it, in declared order.

    Raises:
        MalformedCheckpointError: a declaration is not JSON, or names a folder outside ``folder`` or a link.
    """
    found: list[str] = []
    for name in _declared(folder):
        if not isinstance(name, str) or not _PLAIN_NAME.match(name.strip("/")):
            raise MalformedCheckpointError(
                f"{folder!r} declares the module folder {short_repr(name)}, which is not a folder inside it",
                path=folder,
            )
        path = os.path.join(folder, name.strip("/"))
        if os.path.islink(path):
            raise MalformedCheckpointError(
                f"{path!r} is a link; ckptconv converts only module folders that are inside {folder!r}", path=path
            )
        if os.path.isdir(path) and name.strip("/") not in found and holds_weights(path):
            found.append(name.strip("/"))
    return tuple(found)


def inventory(folder: str, weights: Iterable[str], parts: Iterable[str] = ()) -> Inventory:
    """What ``folder`` holds besides ``weights`` (the files the conversion reads: the weights file, or the index
    and its shards) and its ``parts`` (:func:`components`, converted on their own), sorted into what to carry
    and what to leave out.

    Raises:
        LoadError: a file is a link leading out of the folder, a FIFO or a device.
    """
    read = {os.path.realpath(path) for path in weights}
    carried: list[str] = []
    unknown: list[str] = []
    training: list[tuple[str, str]] = []
    other: list[str] = []
    unsafe: list[str] = []
    large: list[str] = []
    skip = {f"{part}/" for part in parts}
    for name in _walk(folder):
        path = os.path.join(folder, *name.split("/"))
        if os.path.realpath(path) in read or any(name.startswith(part) for part in skip):
            continue
        base = name.rsplit("/", 1)[-1]
        if base in _TRAINING_JSON:
            training.append((name, "trainer state"))
            continue
        if base.lower().endswith(_OTHER_FORMATS) or base.endswith(INDEX_SUFFIXES):
            other.append(name)
            continue
        if is_checkpoint_file(path):
            what = training_state_of(path)
            if what is not None:
                training.append((name, what))
            else:  # weights, unless the file is unsafe: that is never offered as weights to convert
                (unsafe if is_unsafe(path) else other).append(name)
            continue
        if os.stat(path).st_size > MAX_CARRIED_BYTES:
            large.append(name)
            continue
        carried.append(name)
        if not _KNOWN.search(name):
            unknown.append(name)
    # A subfolder with weights that is no component (checkpoint-500/ beside the model a Trainer saved) is another
    # model: none of its files describes the weights converted here.
    others = sorted({name.split("/", 1)[0] + "/" for name in other if "/" in name})

    def kept(names: list[str]) -> tuple[str, ...]:
        return tuple(name for name in names if not any(name.startswith(folder) for folder in others))

    training_kept = tuple(item for item in training if not any(item[0].startswith(f) for f in others))
    return Inventory(
        folder, kept(carried), kept(unknown), training_kept, kept(other), kept(large), tuple(others), tuple(unsafe)
    )


def model_folder(source: str) -> str | None:
    """The model folder ``source`` names: itself when it is a folder, the folder of an index given by its
    file; None for a single weights file (whose folder is not part of what was given)."""
    if os.path.isdir(source):
        return source
    if source.endswith(INDEX_SUFFIXES):
        return os.path.dirname(source) or "."
    return None


def read_config(folder: str) -> ModelConfig | None:
    """``folder``'s ``config.json`` parsed through the config schema (:mod:`ckptconv.reading.model_config`), or
    None when the folder has none.

    Raises:
        LoadError: the file is a link out of the folder, not a regular file, or unreadable.
        InvalidConfigError: it is not a JSON object, is larger than :data:`MAX_CONFIG_BYTES`, or a field ckptconv
            reads has the wrong type or is out of range.
    """
    path = os.path.join(folder, CONFIG_NAME)
    if not os.path.lexists(path):
        return None
    try:
        data = read_policy.read_limited(path, limit=MAX_CONFIG_BYTES, folder=folder, what="model config")
    except MalformedCheckpointError:  # over the size cap: the config is what is wrong
        raise InvalidConfigError(
            f"{path!r} is not a model config: it is larger than {MAX_CONFIG_BYTES:,} bytes; fix or remove it", path=path
        ) from None
    return parse_model_config(parse_config_text(data, path), path=path)


@dataclass(frozen=True)
class Model:
    """A model as a source gives it, resolved once (:func:`resolve_model`).

    Attributes:
        folder: the model folder.
        format: the format of the weights at its top (``""`` when only its parts hold weights).
        weights: the files those weights are in (the file, or the index and its shards), absolute.
        parts: the model folders inside it (:func:`components`), converted each as a model folder of its own.
        config: its ``config.json`` (``adapter_config.json`` for an adapter), or None when it has none.
        adapter: its weights are a PEFT adapter's (``adapter_config.json``, no ``config.json``).
    """

    folder: str
    format: str
    weights: tuple[str, ...]
    parts: tuple[str, ...] = ()
    config: Mapping[str, Any] | None = field(default=None, compare=False)
    adapter: bool = False

    @cached_property
    def inventory(self) -> Inventory:
        """What the folder holds besides the weights and its parts (read on first use: it opens the pickles beside
        the weights to tell training state from weights)."""
        return inventory(self.folder, self.weights, self.parts)

    @property
    def training_state(self) -> tuple[tuple[str, str], ...]:
        """``(name, what)`` for each file of training state beside the weights (optimizer, scheduler ...)."""
        return self.inventory.training_state

    @property
    def kind(self) -> str:
        """:data:`MODEL_FOLDERS` (``modules.json`` or ``model_index.json`` declaring model folders inside it),
        :data:`ADAPTER` (PEFT's ``adapter_config.json`` beside its weights), :data:`TRAINING_RUN` (training state
        beside the model: HF Trainer's ``checkpoint-500/``; asks :attr:`inventory`) or :data:`MODEL_FOLDER`."""
        if self.parts:
            return MODEL_FOLDERS
        if self.adapter:
            return ADAPTER
        return TRAINING_RUN if self.training_state else MODEL_FOLDER


def resolve_model(source: str, *, strict: bool = True) -> Model | None:
    """The model ``source`` names: a model folder, a training run's, an adapter's, a folder of model folders (or
    the ``*.index.json`` of one); None for a single weights file, and for a training framework's own folders
    (DCP, DeepSpeed, per-rank files: :data:`FRAMEWORK_FORMATS`).

    Args:
        source: a path.
        strict: when False, a folder that declares no model (no ``config.json``, ``adapter_config.json`` or
            declared parts), whose config is not a JSON object, or whose weights do not resolve to one checkpoint
            is None too, and nothing is raised (``batch`` then takes its files one by one).

    Raises:
        LoadError: (``strict``) the folder's weights cannot be resolved: several checkpoints, none, a link out.
        MalformedCheckpointError: (``strict``) its ``config.json`` is not a JSON object.
    """
    folder = model_folder(source)
    if folder is None:
        return None
    try:
        config: Mapping[str, Any] | None
        try:
            config, invalid = read_config(folder), False
        except InvalidConfigError:
            # Still a model folder: batch makes it one item, whose conversion refuses the config in one line
            # (taken file by file, its weights would be converted past the config that describes them).
            if strict:
                raise
            config, invalid = None, True
        parts = components(folder)
        adapter = config is None and not invalid and os.path.isfile(os.path.join(folder, ADAPTER_CONFIG_NAME))
        if not strict and config is None and not parts and not adapter and not invalid:
            return None
        if adapter:
            config = _read_json(folder, ADAPTER_CONFIG_NAME)
            config = config if isinstance(config, dict) else None
        found, weights = "", tuple[str, ...]()
        if not parts or holds_weights(folder):
            found, path = resolve(source)
            if found in FRAMEWORK_FORMATS:
                return None
            weights = tuple(os.path.abspath(name) for name in checkpoint_files(path))
        return Model(folder, found, weights, parts, config, adapter)
    except (CkptconvError, OSError):
        if strict:
            raise
        return None
