"""What every format reader returns, and helpers they share."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Union

from ckptconv._text import short_repr
from ckptconv.errors import MalformedCheckpointError, UnsupportedFormatError
from ckptconv.values.standins import ForeignGlobal, StorageType

if TYPE_CHECKING:
    from ckptconv.values.tensor import TensorRef

__all__ = ["Deferred", "MetadataValue", "ReadResult", "metadata_text", "split_aliases"]


@dataclass(frozen=True)
class ReadResult:
    """A file's content as a reader found it; :func:`ckptconv.open` wraps it in a Checkpoint.

    Attributes:
        format: the format's name (``"torch-zip"``, ``"torch-legacy"``, ``"safetensors"``, ``"pickle"``,
            ``"sharded"``, ``"dcp"``).
        tree: the object the file holds, with :class:`~ckptconv.values.tensor.TensorRef` for tensors
            and stand-ins for foreign objects.
        foreign_globals: stand-in globals found, with how many objects each built.
        saved_devices: devices the storages were saved from (``"cuda:1"``).
        metadata: string metadata carried by the format (safetensors ``__metadata__``).
        files: every file the checkpoint consists of (index and shards, ``.metadata``
            and chunk files); empty for a single file.
        notes: what the reader found the user should know (records saved without their data).
    """

    format: str
    tree: Any
    foreign_globals: Counter[str] = field(default_factory=Counter)
    saved_devices: frozenset[str] = frozenset()
    metadata: dict[str, str] = field(default_factory=dict)
    files: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Deferred:
    """A metadata value known only once the tensors are written (the source's sha256, say).

    Writers reserve ``length`` characters for it and call :func:`metadata_text` at the end.
    """

    length: int
    resolve: Callable[[], str]

    @property
    def placeholder(self) -> str:
        return "0" * self.length


MetadataValue = Union[str, Deferred]


def metadata_text(value: MetadataValue) -> str:
    """The final text of a metadata value."""
    if isinstance(value, Deferred):
        text = value.resolve()
        if len(text) != value.length or not text.isascii():
            raise AssertionError(f"deferred metadata resolved to {text!r}, not {value.length} ASCII characters")
        return text
    return value


def is_utf8(text: str) -> bool:
    """True when ``text`` can be written as UTF-8 (it holds no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict, refusing a key named twice (Python's json keeps the last, other
    readers the first) and strings that are not Unicode: Python's json takes ``"\\ud800"`` (half a
    surrogate pair) as a string, where the safetensors library refuses it and no UTF-8 file can hold it.

    Raises:
        ValueError: either, as json.loads raises for what is not JSON.
    """
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        for text in (key, value):
            if isinstance(text, str) and not is_utf8(text):
                raise ValueError(f"the string {text!r} holds a lone surrogate escape, which is not Unicode")
        result[key] = value
    return result


def json_object(text: str) -> Any:
    """``json.loads`` as the safetensors library parses a header, for every JSON file of a checkpoint
    (safetensors headers, their aliases, shard indexes): see :func:`unique_pairs`.

    Raises:
        ValueError: the text is not such JSON.
        RecursionError: it nests too deep.
    """
    return json.loads(text, object_pairs_hook=unique_pairs)


def json_bytes(value: Any, **options: Any) -> bytes:
    """``value`` as UTF-8 JSON; strings holding lone surrogates (from names that are not UTF-8)
    fall back to JSON's ``\\uXXXX`` escapes, which ``json.loads`` reads back exactly."""
    try:
        return json.dumps(value, ensure_ascii=False, **options).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value, ensure_ascii=True, **options).encode("ascii")


def pickle_location(value: Any, source: str) -> str:
    """A storage's saved location tag (``"cuda:1"``) from a persistent id."""
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not isinstance(value, str) or len(value) > 64:
        raise MalformedCheckpointError(
            f"{source!r} names a storage location {short_repr(value)} that is not a device; the file is damaged",
            path=source,
        )
    return value


def text_storage_reference(path: str, pid: Any, what: str) -> UnsupportedFormatError | None:
    """The refusal for a storage reference pickled as text, as ``torch.save(..., pickle_protocol=0)``
    writes them (``"('storage', <class 'torch.FloatStorage'>, '0', 'cpu', 3)"``): torch.load cannot read
    them back either, whether ``weights_only`` or not (its loader asserts the id is a tuple). None for
    any other reference. ``what``: ``"torch"`` or ``"legacy torch"``."""
    if isinstance(pid, str) and pid.startswith("('storage', "):
        return UnsupportedFormatError(
            f"{path!r} is a {what} checkpoint saved with pickle protocol 0, whose storage references are text "
            "that neither torch.load nor ckptconv reads back; save it again with the default protocol",
            path=path,
        )
    return None


def check_storage_type(path: str, storage_type: Any, damaged: Callable[[str, str], Exception]) -> StorageType:
    """``storage_type`` if it is a storage class ckptconv knows.

    A ``torch.*Storage`` class it does not know (a dtype newer than ckptconv) is
    not damage: the refusal says so. Anything else in that place is damage.

    Raises:
        UnsupportedFormatError: a torch storage class of a dtype ckptconv does not know.
        Exception: from ``damaged(path, detail)`` for anything else.
    """
    if isinstance(storage_type, StorageType):
        return storage_type
    if (
        isinstance(storage_type, ForeignGlobal)
        and storage_type.module.split(".")[0] == "torch"
        and storage_type.name.endswith("Storage")
    ):
        raise UnsupportedFormatError(
            f"{path!r} holds storages of type {storage_type.qualname}, whose dtype ckptconv does not know; "
            "convert that tensor to a common dtype with torch, or use a newer ckptconv",
            path=path,
        )
    raise damaged(path, f"a storage has type {short_repr(storage_type)}")


def check_same_storage_type(
    path: str, key: str, first: tuple[StorageType, int], again: tuple[StorageType, int]
) -> None:
    """Refuse a storage referred to with two types or sizes.

    torch.save never writes that ("Cannot save multiple tensors or storages that
    view the same data as different types"), and torch.load would give every
    tensor the first reference's dtype: an int32 view of a float storage comes
    back as floats. Either reading is a guess, so neither is made.
    """
    if first == again:
        return

    def describe(kind: StorageType, numel: int) -> str:
        return f"{'untyped' if kind.untyped else kind.dtype.name} x {numel}"

    raise MalformedCheckpointError(
        f"{path!r} is damaged: storage {key!r} is referred to as {describe(*first)} and as "
        f"{describe(*again)}; torch.save never writes that and readers disagree on its values",
        path=path,
    )


def split_aliases(entries: Sequence[tuple[str, TensorRef]]) -> tuple[list[tuple[str, TensorRef]], dict[str, str]]:
    """Tied tensors, stored once: ``(entries to store, {alias: stored key})``.

    Keys that hold the same tensor (the same view of the same storage, as tied
    embeddings do) are stored under the first key; the others become aliases of it.
    """
    stored: dict[TensorRef, str] = {}
    unique: list[tuple[str, TensorRef]] = []
    aliases: dict[str, str] = {}
    for key, ref in entries:
        if ref in stored:
            aliases[key] = stored[ref]
        else:
            stored[ref] = key
            unique.append((key, ref))
    return unique, aliases
