"""The pickle machine: same data as pickle.loads, stand-ins for foreign classes, nothing ever run."""

from __future__ import annotations

import argparse
import collections
import pickle
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptconv.errors import MalformedCheckpointError, UnsafeCheckpointError, UnsupportedFormatError
from ckptconv.reading.unpickling.pickle_policy import classify_global
from ckptconv.reading.unpickling.unpickler import Unpickler
from ckptconv.values.standins import ForeignGlobal, ForeignObject

PROTOCOLS = range(pickle.HIGHEST_PROTOCOL + 1)


def ours(data: bytes) -> Any:
    return Unpickler(data, source="test").load()


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(),
    st.binary(),
    st.complex_numbers(allow_nan=False),
)
hashables = st.one_of(st.none(), st.booleans(), st.integers(), st.text(), st.binary())
data_trees = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=6),
        st.tuples(children, children),
        st.tuples(children),
        st.dictionaries(hashables, children, max_size=6),
        st.frozensets(hashables, max_size=5),
        st.sets(hashables, max_size=5),
        st.builds(bytearray, st.binary(max_size=8)),
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(data_trees, st.sampled_from(list(PROTOCOLS)))
def test_plain_data_round_trips_like_pickle(value: Any, protocol: int) -> None:
    data = pickle.dumps(value, protocol=protocol)
    assert ours(data) == pickle.loads(data)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_shared_and_recursive_structures(protocol: int) -> None:
    shared = [1, 2]
    value: Any = {"a": shared, "b": shared, "od": collections.OrderedDict(x=1), "c": collections.Counter("aab")}
    loop: list[Any] = []
    loop.append(loop)
    value["loop"] = loop
    result = ours(pickle.dumps(value, protocol=protocol))
    assert result["a"] is result["b"]
    assert result["loop"][0] is result["loop"]
    assert result["od"] == collections.OrderedDict(x=1)
    assert result["c"] == collections.Counter("aab")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_foreign_objects_become_inert_stand_ins(protocol: int) -> None:
    namespace = argparse.Namespace(lr=0.1, layers=[1, 2])
    result = ours(pickle.dumps({"args": namespace, "cls": argparse.Namespace}, protocol=protocol))
    assert isinstance(result["args"], ForeignObject)
    assert result["args"].qualname == "argparse.Namespace"
    assert result["args"].attributes() == {"lr": 0.1, "layers": [1, 2]}
    assert isinstance(result["cls"], ForeignGlobal)


def _module_that_will_vanish(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(
        "class Config(dict):\n"
        "    pass\n"
        "class Slotted:\n"
        "    __slots__ = ('a', 'b')\n"
        "    def __init__(self): self.a, self.b = 1, 2\n"
        "class Items(list):\n"
        "    pass\n",
        module.__dict__,
    )
    for cls in (module.Config, module.Slotted, module.Items):
        cls.__module__ = name
    return module


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_classes_from_missing_code_are_never_imported(protocol: int, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _module_that_will_vanish("vanished_research_code")
    monkeypatch.setitem(sys.modules, "vanished_research_code", module)
    config = module.Config(depth=3)
    config.note = "x"
    value = {"config": config, "items": module.Items([1, 2])}
    if protocol >= 2:  # protocols 0 and 1 cannot pickle __slots__ objects at all
        value["slotted"] = module.Slotted()
    data = pickle.dumps(value, protocol=protocol)
    monkeypatch.delitem(sys.modules, "vanished_research_code")

    result = ours(data)
    assert "vanished_research_code" not in sys.modules
    assert result["config"].items == {"depth": 3}
    assert result["config"].attributes() == {"note": "x"}
    if protocol >= 2:
        assert result["slotted"].attributes() == {"a": 1, "b": 2}
    assert result["items"].list_items == [1, 2]


DANGEROUS = [
    ("os", "system"),
    ("posix", "system"),
    ("subprocess", "Popen"),
    ("builtins", "eval"),
    ("builtins", "exec"),
    ("__builtin__", "eval"),
    ("builtins", "getattr"),
    ("builtins", "__import__"),
    ("importlib", "import_module"),
    ("pickle", "loads"),
    ("_pickle", "loads"),
    ("marshal", "loads"),
    ("runpy", "run_path"),
    ("ctypes", "CDLL"),
    ("shutil", "rmtree"),
    ("socket", "socket"),
    ("numpy.testing._private.utils", "runstring"),
    ("torch", "load"),
    ("torch.serialization", "load"),
    ("pathlib", "Path.write_text"),
    ("collections", "OrderedDict.__init__.__globals__"),
    ("operator", "attrgetter"),
    ("types", "CodeType"),
]


@pytest.mark.parametrize("module, name", DANGEROUS)
def test_code_running_globals_are_classified_dangerous(module: str, name: str) -> None:
    assert classify_global(module, name) == "dangerous"


@pytest.mark.parametrize(
    "module, name",
    [
        ("argparse", "Namespace"),
        ("omegaconf.dictconfig", "DictConfig"),
        ("__main__", "MyModel"),
        ("pathlib", "PosixPath"),
        ("types", "SimpleNamespace"),
        ("functools", "partial"),
        ("torch.nn.modules.conv", "Conv2d"),
        ("ultralytics.nn.tasks", "DetectionModel"),
        ("datetime", "datetime"),
    ],
)
def test_ordinary_globals_are_foreign_not_dangerous(module: str, name: str) -> None:
    assert classify_global(module, name) == "foreign"


def _global_opcode(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _payloads(canary: Path) -> dict[str, bytes]:
    """Pickles that, run by pickle.loads, create ``canary``."""
    command = f"touch {canary}".encode()
    arg = b"X" + len(command).to_bytes(4, "little") + command
    return {
        "GLOBAL+REDUCE": b"\x80\x02" + _global_opcode("os", "system") + arg + b"\x85R.",
        "STACK_GLOBAL": b"\x80\x04" + b"\x8c\x02os\x8c\x06system\x93" + arg + b"\x85R.",
        "INST": b"(" + b"S'" + command + b"'\n" + b"ios\nsystem\n.",
        "OBJ": b"(" + _global_opcode("os", "system") + b"S'" + command + b"'\no.",
        "nested after tensors": b"\x80\x02}(X\x01\x00\x00\x00a]X\x01\x00\x00\x00b"
        + _global_opcode("os", "system")
        + arg
        + b"\x85Ru.",
        "builtins.exec": b"\x80\x02"
        + _global_opcode("builtins", "exec")
        + b"X"
        + len(f"open('{canary}', 'w')".encode()).to_bytes(4, "little")
        + f"open('{canary}', 'w')".encode()
        + b"\x85R.",
        "popped global": b"\x80\x02" + _global_opcode("os", "system") + b"0N.",
    }


@pytest.mark.parametrize("name", list(_payloads(Path("/x"))))
def test_payloads_are_refused_and_never_run(name: str, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    payload = _payloads(canary)[name]
    with pytest.raises(UnsafeCheckpointError) as raised:
        ours(payload)
    assert raised.value.globals[0] in ("os.system", "builtins.exec")
    assert not canary.exists()


def test_payloads_are_live(tmp_path: Path) -> None:
    """The payloads above really run code under pickle.loads, so refusing them means something."""
    import subprocess

    for name, payload in _payloads(tmp_path / "canary").items():
        if name == "popped global":
            continue
        canary = tmp_path / "canary"
        code = f"import pickle; pickle.loads({payload!r})"
        subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, timeout=60)
        assert canary.exists(), name
        canary.unlink()


def test_extension_codes_are_refused() -> None:
    with pytest.raises(UnsupportedFormatError, match="extension registry"):
        ours(b"\x80\x02\x82\x01.")


def test_out_of_band_buffers_are_refused() -> None:
    with pytest.raises(UnsupportedFormatError, match="out-of-band"):
        ours(b"\x80\x05\x97.")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_every_truncation_is_a_clear_error(protocol: int) -> None:
    data = pickle.dumps({"a": [1, 2.5, "x" * 300, b"y"], "b": (None, True, 10**30)}, protocol=protocol)
    for cut in range(len(data) - 1):
        with pytest.raises(MalformedCheckpointError):
            ours(data[:cut])


def test_deeply_nested_keys_are_refused_not_crashing() -> None:
    key: Any = ()
    for _ in range(100_000):
        key = (key,)
    data = b"\x80\x02}" + b")" + b"\x85" * 100_000 + b"Ns."
    with pytest.raises(MalformedCheckpointError, match="nested"):
        ours(data)
    del key


def test_deeply_nested_lists_load() -> None:
    depth = 200_000
    data = b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."
    result = ours(data)
    for _ in range(depth - 1):
        result = result[0]
    assert result == []


def test_item_limit_stops_runaway_pickles() -> None:
    data = b"\x80\x02]" + b"(" + b"N" * 1000 + b"e."
    with pytest.raises(MalformedCheckpointError, match="builds more than"):
        Unpickler(data, max_items=500).load()


@pytest.mark.parametrize(
    "data",
    [
        b"\x80\x02h\x05.",
        b"\x80\x02R.",
        b"\x80\x02N)b.",
        b"\x80\x02\xff.",
        b"\x80\x02(u.",
        b"\x80\x02(N]u.",
        b"\x80\x02" + _global_opcode("collections", "OrderedDict") + b"K\x01\x85R.",
    ],
)
def test_nonsense_pickles_are_clear_errors(data: bytes) -> None:
    with pytest.raises(MalformedCheckpointError):
        ours(data)


_DEEP_TUPLE = b")" + b"\x85" * 300_000  # ((((...),),),) nested 300,000 deep


@pytest.mark.parametrize(
    "data",
    [
        # builtins.set([deep]) and frozenset([deep]) hash the item inside set()/frozenset()
        b"\x80\x02cbuiltins\nset\n(" + _DEEP_TUPLE + b"l\x85R.",
        b"\x80\x02cbuiltins\nfrozenset\n(" + _DEEP_TUPLE + b"l\x85R.",
        # OrderedDict([(deep, None)]) and Counter hash the keys of their pairs
        b"\x80\x02ccollections\nOrderedDict\n((" + _DEEP_TUPLE + b"Ntl\x85R.",
        b"\x80\x02ccollections\nCounter\n((" + _DEEP_TUPLE + b"Ntl\x85R.",
    ],
    ids=["set", "frozenset", "OrderedDict", "Counter"],
)
def test_deep_keys_reached_through_known_callables_are_refused(data: bytes) -> None:
    # Regression: these crashed the interpreter (SIGSEGV) by hashing the nested tuple in C.
    with pytest.raises(MalformedCheckpointError, match="nested more than 64 levels"):
        ours(data)


def test_error_messages_quote_hostile_values_briefly() -> None:
    huge = b"\x80\x02ctorch._utils\n_rebuild_tensor\n(" + b"(" + b"N" * 100_000 + b"l" * 1 + b"K\x00))t" + b"R."
    with pytest.raises(MalformedCheckpointError) as raised:
        ours(huge)
    assert len(str(raised.value)) < 300
