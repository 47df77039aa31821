"""Files that are no checkpoint format ckptconv knows: one sentence saying so, the same from detection and
from the plain-pickle reader (whose first byte only suggested an old-protocol pickle).

A text file (a README, a config.json, a YAML or CSV file given as SRC) is said to be text, with its kind
when the name or the content makes it plain, and what to give instead; anything else shows its first bytes.
"""

from __future__ import annotations

import codecs
import json
import os

from ckptconv.errors import UnsupportedFormatError

__all__ = ["TEXT_PROBE_BYTES", "not_a_checkpoint"]

#: How much of a file is looked at to call it text.
TEXT_PROBE_BYTES = 4096

# What a text file's suffix says it is.
_TEXT_KINDS = {
    ".json": "JSON",
    ".jsonl": "JSON lines",
    ".yaml": "YAML",
    ".yml": "YAML",
    ".toml": "TOML",
    ".csv": "CSV",
    ".tsv": "TSV",
    ".md": "Markdown",
    ".rst": "reStructuredText",
    ".txt": "",
    ".py": "Python source",
    ".ini": "INI",
    ".cfg": "INI",
}

# Keys of a Hugging Face model's config.json (transformers' PretrainedConfig, diffusers' components).
_CONFIG_KEYS = ("architectures", "model_type", "_class_name", "_name_or_path")


def _text(head: bytes) -> str | None:
    """``head`` as text, or None when it is not text: text decodes as UTF-8 (a character cut at the end of
    the probe allowed), holds no NUL byte, and at least 95% of its characters are printable or white space."""
    if not head or b"\x00" in head:
        return None
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < TEXT_PROBE_BYTES)
    except UnicodeDecodeError:
        return None
    text = text.removeprefix("\ufeff")
    shown = sum(char.isprintable() or char in "\t\n\r\f\v" for char in text)
    return text if text and shown >= 0.95 * len(text) else None


def _kind(path: str, text: str, whole: bool) -> tuple[str, bool]:
    """What the text is (``"JSON"``), and whether it is a model's config.json."""
    kind = _TEXT_KINDS.get(os.path.splitext(path)[1].lower(), "")
    if text.lstrip()[:1] in ("{", "[") and kind in ("", "JSON"):
        try:
            document = json.loads(text) if whole else None
        except ValueError:
            document = None
        if document is not None or kind == "JSON":
            config = isinstance(document, dict) and any(key in document for key in _CONFIG_KEYS)
            return "JSON", config or os.path.basename(path) == "config.json"
    return kind, False


def not_a_checkpoint(path: str, head: bytes, size: int) -> UnsupportedFormatError:
    """The error for a file of no format ckptconv knows: text said to be text, other bytes shown in hex.

    Args:
        path: the file, as the user named it.
        head: its first :data:`TEXT_PROBE_BYTES` bytes (or all of it, when shorter).
        size: its size in bytes.
    """
    text = _text(head[:TEXT_PROBE_BYTES])
    if text is None:
        return UnsupportedFormatError(
            f"{path!r} is not a checkpoint format ckptconv knows (it starts with bytes {head[:8].hex(' ')}); "
            "expected a torch.save file, a pickle or safetensors",
            path=path,
        )
    kind, config = _kind(path, text, whole=size <= len(head))
    what = f"a text file ({kind})" if kind else "a text file"
    if config:
        folder = os.path.dirname(path) or "."
        return UnsupportedFormatError(
            f"{path!r} is {what}, a model's config, not its weights; give the model folder that holds it "
            f"({os.path.join(folder, '')!r}) to read the weights beside it",
            path=path,
        )
    return UnsupportedFormatError(
        f"{path!r} is {what}, not a checkpoint; give a checkpoint file (torch.save, pickle or safetensors) "
        "or the folder that holds one",
        path=path,
    )
