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
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptconv._text import short_repr
from ckptconv.errors import MalformedCheckpointError
from ckptconv.reading import read_policy
from ckptconv.reading.detection import is_checkpoint_file, training_state_of
from ckptconv.reading.formats._base import json_object
from ckptconv.suffixes import INDEX_SUFFIXES

__all__ = [
    "CONFIG_NAME",
    "MAX_CARRIED_BYTES",
    "MAX_CONFIG_BYTES",
    "Inventory",
    "inventory",
    "model_folder",
    "read_config",
]

CONFIG_NAME = "config.json"
#: A model's config.json is kilobytes; a hundred times the largest real one is still refused past this.
MAX_CONFIG_BYTES = 16 << 20
#: The largest file carried beside the weights: a tokenizer.json is tens of megabytes. A larger one is left out,
#: with a note naming it.
MAX_CARRIED_BYTES = 1 << 30

# Files a model folder holds that ckptconv knows: carried without a note. Anything else is carried verbatim too,
# and named in a note (ckptconv cannot tell whether the conversion changed what it describes).
_KNOWN = re.compile(
    r"""(^|/)(
        (generation_|preprocessor_|processor_|image_processor_|video_preprocessor_|feature_extractor_|adapter_|
         scheduler_|sentence_bert_|config_sentence_transformers|tokenizer_|special_tokens_map|added_tokens|
         model_index|modules|audio_processor_)?config\.json
      | (tokenizer|vocab|merges|spiece|sentencepiece|special_tokens_map|added_tokens|chat_template|
         modules|model_index|preprocessor|processor)[^/]*
      | [^/]*\.(md|py|jinja|txt|model|tiktoken)
      | LICEN[CS]E[^/]* | NOTICE[^/]* | USE_POLICY[^/]*
    )$""",
    re.VERBOSE,
)
# Weights in formats ckptconv does not convert (flax, TensorFlow, ONNX, GGUF, Core ML, rust-bert): left out with a
# note, so the output never holds weights that disagree with the converted ones.
_OTHER_FORMATS = (".msgpack", ".h5", ".onnx", ".onnx_data", ".gguf", ".tflite", ".ot", ".mlmodel", ".index.json")
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
    """

    folder: str
    carried: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    training_state: tuple[tuple[str, str], ...] = ()
    other_weights: tuple[str, ...] = ()
    too_large: tuple[str, ...] = ()

    def path(self, name: str) -> str:
        """The file ``name`` (one of :attr:`carried`) names, checked by the read policy (inside the folder)."""
        return read_policy.member(self.folder, name, source=self.folder, what="model file")


def _walk(folder: str) -> Iterable[str]:
    """Every regular file's relative name under ``folder``, hidden ones and links to folders apart; a link that
    leads out of the folder is refused by the read policy."""
    for root, folders, files in os.walk(folder, followlinks=False):
        folders[:] = sorted(name for name in folders if not name.startswith("."))
        for name in sorted(files):
            if name.startswith("."):
                continue
            path = os.path.join(root, name)
            info = read_policy.check_file(path, folder=folder)  # links out, FIFOs, devices: refused
            if stat.S_ISREG(info.st_mode):
                yield os.path.relpath(path, folder).replace(os.sep, "/")


def inventory(folder: str, weights: Iterable[str]) -> Inventory:
    """What ``folder`` holds besides ``weights`` (the files the conversion reads: the weights file, or the index
    and its shards), sorted into what to carry and what to leave out.

    Raises:
        LoadError: a file is a link leading out of the folder, a FIFO or a device.
    """
    read = {os.path.realpath(path) for path in weights}
    carried: list[str] = []
    unknown: list[str] = []
    training: list[tuple[str, str]] = []
    other: list[str] = []
    large: list[str] = []
    for name in _walk(folder):
        path = os.path.join(folder, *name.split("/"))
        if os.path.realpath(path) in read:
            continue
        base = name.rsplit("/", 1)[-1]
        if base in _TRAINING_JSON:
            training.append((name, "trainer state"))
            continue
        if base.lower().endswith(_OTHER_FORMATS):
            other.append(name)
            continue
        if is_checkpoint_file(path):
            what = training_state_of(path)
            (training.append((name, what)) if what is not None else other.append(name))
            continue
        if os.stat(path).st_size > MAX_CARRIED_BYTES:
            large.append(name)
            continue
        carried.append(name)
        if not _KNOWN.search(name):
            unknown.append(name)
    return Inventory(folder, tuple(carried), tuple(unknown), tuple(training), tuple(other), tuple(large))


def model_folder(source: str) -> str | None:
    """The model folder ``source`` names: itself when it is a folder, the folder of an index given by its
    file; None for a single weights file (whose folder is not part of what was given)."""
    if os.path.isdir(source):
        return source
    if source.endswith(INDEX_SUFFIXES):
        return os.path.dirname(source) or "."
    return None


def read_config(folder: str) -> Mapping[str, Any] | None:
    """``folder``'s ``config.json`` as a JSON object, or None when the folder has none.

    Raises:
        LoadError: the file is a link out of the folder, not a regular file, or unreadable.
        MalformedCheckpointError: it is not a JSON object, or is larger than :data:`MAX_CONFIG_BYTES`.
    """
    path = os.path.join(folder, CONFIG_NAME)
    if not os.path.lexists(path):
        return None
    data = read_policy.read_limited(path, limit=MAX_CONFIG_BYTES, folder=folder, what="model config")
    try:
        config = json_object(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise MalformedCheckpointError(
            f"{path!r} is not a model config: it is not JSON ({type(error).__name__}); fix or remove it", path=path
        ) from None
    if not isinstance(config, dict):
        raise MalformedCheckpointError(
            f"{path!r} is not a model config: it holds {short_repr(config)}, not a JSON object", path=path
        )
    return config
