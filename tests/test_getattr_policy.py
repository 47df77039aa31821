"""``builtins.getattr`` in a pickle: allowed only as ``getattr(<stand-in class>, "plain_name")``.

CPython's pickler writes ``getattr(Outer, "Inner")`` for a nested class below
protocol 4 (FSDP1's ``ShardedTensor.ProcessGroupState``) and, from Python 3.12,
``getattr(EnumClass, "MEMBER")`` for an enum member. ckptconv turns that into the
inert stand-in ``module.Outer.Inner`` and looks nothing up; every other use of
``getattr`` stays unsafe, for every command and for ``ckptconv scan``.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import ckptconv
from ckptconv.errors import UnsafeCheckpointError
from ckptconv.reading.unpickling.unpickler import Unpickler
from ckptconv.values.standins import ForeignGlobal, ForeignObject


class Outer:
    class Inner:
        def __init__(self) -> None:
            self.rank = 3


def _text(value: str) -> bytes:
    raw = value.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


GETATTR = _global("builtins", "getattr")
THING = _global("ckpt_fixture_pkg.models", "Thing")


def _lookup(target: bytes, name: bytes) -> bytes:
    """``getattr(target, name)`` as CPython writes it: the function, a 2-tuple, REDUCE."""
    return GETATTR + target + name + b"\x86R"


def ours(data: bytes) -> object:
    return Unpickler(data, source="test").load()


def test_a_nested_class_pickled_by_cpython_becomes_a_stand_in() -> None:
    data = pickle.dumps(Outer.Inner(), protocol=2)
    assert b"getattr" in data  # the real pickler's spelling, not ours
    value = ours(data)
    assert isinstance(value, ForeignObject)
    assert value.qualname == f"{__name__}.Outer.Inner"
    assert value.attributes() == {"rank": 3}


def test_an_enum_member_spelled_as_python_3_12_writes_it() -> None:
    value = ours(
        b"\x80\x02" + _lookup(_global("pkg.metadata", "MEM_FORMAT_ENCODING"), _text("TORCH_CHANNELS_LAST")) + b"."
    )
    assert isinstance(value, ForeignGlobal)
    assert value.qualname == "pkg.metadata.MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST"


def test_getattr_reused_through_the_memo_is_allowed() -> None:
    first = GETATTR + b"q\x00" + THING + b"q\x01" + _text("A") + b"\x86R"
    second = b"h\x00h\x01" + _text("B") + b"\x86R"
    value = ours(b"\x80\x02" + first + second + b"\x86.")
    assert [v.qualname for v in value] == ["ckpt_fixture_pkg.models.Thing.A", "ckpt_fixture_pkg.models.Thing.B"]


HOSTILE = {
    # getattr(__import__("os"), "system")("id"): refused at __import__ already
    "getattr(__import__('os'), 'system')": _lookup(
        _global("builtins", "__import__") + _text("os") + b"\x85R", _text("system")
    )
    + _text("id")
    + b"\x85R",
    "getattr(os.path, 'join')": _lookup(_global("os", "path"), _text("join")),
    "getattr(subprocess.Popen, 'x')": _lookup(_global("subprocess", "Popen"), _text("x")),
    "getattr(Thing, 'system')": _lookup(THING, _text("system")),
    "getattr(getattr(Thing, 'Inner'), 'load')": _lookup(_lookup(THING, _text("Inner")), _text("load")),
    "getattr(Thing, '__globals__')": _lookup(THING, _text("__globals__")),
    "getattr(Thing, '__class__')": _lookup(THING, _text("__class__")),
    "getattr(Thing, '__mro__x')": _lookup(THING, _text("__mro__x")),
    "getattr(Thing, 'x__')": _lookup(THING, _text("x__")),
    "getattr(Thing, 'a.b')": _lookup(THING, _text("a.b")),
    "getattr(Thing, '<Cyrillic dze>ystem')": _lookup(THING, _text("\u0455ystem")),
    "getattr(Thing, 7)": GETATTR + THING + b"K\x07\x86R",
    "getattr(Thing)": GETATTR + THING + b"\x85R",
    "getattr(Thing(), 'x')": _lookup(THING + b")R", _text("x")),
    "getattr(getattr, 'x')": _lookup(GETATTR, _text("x")),
    "getattr(dict, 'fromkeys')": _lookup(_global("collections", "OrderedDict"), _text("fromkeys")),
    "getattr passed to a class": THING + b"(" + GETATTR + b"tR",
    "getattr popped": GETATTR + b"0N",
    "getattr duplicated": GETATTR + b"2" + THING + _text("A") + b"\x86R0",
    "getattr from the memo, passed on": _lookup(THING, _text("A")) + b"0" + THING + b"(" + b"h\x00tR",
    "getattr instantiated": b"(" + GETATTR + b"o",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_every_other_use_of_getattr_is_refused(name: str) -> None:
    data = b"\x80\x02" + HOSTILE[name] + b"."
    if name == "getattr from the memo, passed on":
        data = b"\x80\x02" + GETATTR + b"q\x00" + HOSTILE[name][len(GETATTR) :] + b"."
    with pytest.raises(UnsafeCheckpointError) as raised:
        ours(data)
    assert "nothing was executed" in str(raised.value)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_scan_calls_every_other_use_of_getattr_unsafe(name: str, tmp_path: Path) -> None:
    data = b"\x80\x02" + HOSTILE[name] + b"."
    if name == "getattr from the memo, passed on":
        data = b"\x80\x02" + GETATTR + b"q\x00" + HOSTILE[name][len(GETATTR) :] + b"."
    path = tmp_path / "x.pkl"
    path.write_bytes(data)
    report = ckptconv.scan(path)
    assert report.verdict == "unsafe", report.reason


def test_scan_calls_an_allowed_lookup_foreign_and_names_it(tmp_path: Path) -> None:
    path = tmp_path / "x.pkl"
    path.write_bytes(b"\x80\x02" + _lookup(THING, _text("Inner")) + b")R.")
    report = ckptconv.scan(path)
    assert report.verdict == "foreign"
    assert "ckpt_fixture_pkg.models.Thing.Inner" in report.reason


def test_the_method_name_rule_matters_under_pickle(tmp_path: Path) -> None:
    """Under pickle.loads, getattr(<class>, "system") reaches whatever the class holds: os.system here."""
    canary = tmp_path / "canary"
    payload = b"\x80\x02" + _lookup(_global("ckpt_fixture_pkg", "Thing"), _text("system"))
    live = payload + _text(f"touch {canary}") + b"\x85R."
    code = (
        "import os, pickle, sys, types\n"
        "m = types.ModuleType('ckpt_fixture_pkg'); sys.modules['ckpt_fixture_pkg'] = m\n"
        "class Thing: system = staticmethod(os.system)\n"
        "Thing.__module__ = 'ckpt_fixture_pkg'; m.Thing = Thing\n"
        f"pickle.loads({live!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, timeout=60)
    assert canary.exists()
    canary.unlink()
    with pytest.raises(UnsafeCheckpointError, match=r"ckpt_fixture_pkg\.Thing\.system runs processes"):
        ours(live)
    assert not canary.exists()


# -- the signal module's enums: data, not a way to send signals ---------------------------


def test_a_signal_number_in_an_argument_namespace_is_data() -> None:
    """Megatron-LM saves its argparse namespace, with ``exit_signal = signal.SIGTERM``, in every checkpoint."""
    import argparse
    import signal

    value = ours(pickle.dumps(argparse.Namespace(exit_signal=signal.SIGTERM, lr=0.1), protocol=2))
    assert isinstance(value, ForeignObject)
    member = value.attributes()["exit_signal"]
    if sys.version_info >= (3, 11):
        assert isinstance(member, ForeignObject) and member.qualname == "signal.Signals" and member.args == (15,)
    else:  # Python 3.10 and older write the module's constant
        assert isinstance(member, ForeignGlobal) and member.qualname == "signal.SIGTERM"
    by_value = ours(b"\x80\x02" + _global("signal", "Signals") + b"K\x0f\x85R.")
    assert isinstance(by_value, ForeignObject) and by_value.qualname == "signal.Signals" and by_value.args == (15,)
    by_name = ours(b"\x80\x02" + _lookup(_global("signal", "Signals"), _text("SIGTERM")) + b".")
    assert isinstance(by_name, ForeignGlobal) and by_name.qualname == "signal.Signals.SIGTERM"


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1", "SIG_DFL", "SIG_IGN", "NSIG", "ITIMER_REAL", "SIGRTMIN"])
def test_a_signal_constant_as_python_3_10_pickles_it_is_data(name: str) -> None:
    """Up to Python 3.10 ``signal.SIGTERM`` pickles as the global ``signal.SIGTERM`` (so does every
    Megatron-LM checkpoint saved there, in its argument namespace); ckptconv refused those as unsafe."""
    namespace = _global("argparse", "Namespace") + b")\x81}X\x0b\x00\x00\x00exit_signal" + _global("signal", name)
    value = ours(b"\x80\x02" + namespace + b"sb.")
    assert isinstance(value, ForeignObject) and value.qualname == "argparse.Namespace"
    member = value.attributes()["exit_signal"]
    assert isinstance(member, ForeignGlobal) and member.qualname == f"signal.{name}"


@pytest.mark.parametrize(
    "module, name",
    [
        ("signal", "signal"),
        ("signal", "raise_signal"),
        ("signal", "pthread_kill"),
        ("signal", "alarm"),
        ("signal", "setitimer"),
        ("_signal", "signal"),
        ("signal", "Signals.system"),
        ("signal", "Signals.__call__"),
        ("signal", "SIGTERM.system"),
        ("signal", "Sigterm"),
        ("signal", "getsignal"),
    ],
)
def test_the_rest_of_the_signal_module_stays_unsafe(module: str, name: str) -> None:
    from ckptconv.reading.unpickling.pickle_policy import classify_global

    assert classify_global(module, name) == "dangerous"
    with pytest.raises(UnsafeCheckpointError):
        ours(b"\x80\x02" + _global(module, name) + b"K\x0f\x85R.")
