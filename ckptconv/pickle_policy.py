"""What a pickle may name: the security policy of ckptconv's pickle machine.

:func:`classify_global` sorts every global a pickle names into one of three kinds:

* ``"dangerous"``: made to run code, spawn processes, read or write files, load
  more pickles or reach the network (the lists below), or a dunder that walks
  from an object to its internals. The file is refused.
* ``"known"``: re-implemented by ckptconv in :mod:`ckptconv.rebuild` (torch's
  tensor rebuild functions, ``collections.OrderedDict``, numpy's reconstructor).
* ``"foreign"``: everything else; it becomes an inert stand-in
  (:mod:`ckptconv.standins`) that is never imported nor called.

The stand-ins are the safety boundary; these lists are a warning about intent.
The interpreter that enforces this policy is :mod:`ckptconv.unpickler`.
"""

from __future__ import annotations

from .rebuild import known_global

__all__ = ["classify_global", "normalise_global"]

# Modules whose every member exists to run code, spawn processes, load more
# pickles or reach the network. Matched on the module and its submodules.
_DANGEROUS_MODULES = frozenset(
    [
        "os",
        "posix",
        "nt",
        "posixpath",
        "ntpath",
        "subprocess",
        "_posixsubprocess",
        "_winapi",
        "sys",
        "importlib",
        "imp",
        "pkgutil",
        "zipimport",
        "runpy",
        "ctypes",
        "_ctypes",
        "cffi",
        "pickle",
        "_pickle",
        "cPickle",
        "pickletools",
        "dill",
        "cloudpickle",
        "joblib",
        "marshal",
        "shelve",
        "code",
        "codeop",
        "pdb",
        "bdb",
        "pty",
        "tty",
        "socket",
        "_socket",
        "ssl",
        "select",
        "selectors",
        "http",
        "urllib",
        "urllib2",
        "urllib3",
        "requests",
        "httpx",
        "aiohttp",
        "ftplib",
        "smtplib",
        "telnetlib",
        "poplib",
        "imaplib",
        "webbrowser",
        "shutil",
        "multiprocessing",
        "concurrent",
        "threading",
        "_thread",
        "asyncio",
        "signal",
        "resource",
        "commands",
        "popen2",
        "timeit",
        "cProfile",
        "profile",
        "trace",
        "doctest",
        "site",
        "sysconfig",
        "distutils",
        "setuptools",
        "pip",
        "ensurepip",
        "venv",
        "idlelib",
        "lib2to3",
        "IPython",
        "gc",
        "inspect",
        "linecache",
        "tempfile",
        "glob",
        "fileinput",
        "mmap",
        "yaml",
        "jinja2",
        "xmlrpc",
        "logging.config",
        "tkinter",
        "turtle",
        "numpy.f2py",
        "numpy.distutils",
        "numpy.ctypeslib",
        "numpy.testing",
        "torch.hub",
        "torch.jit",
        "torch.package",
        "torch.utils.cpp_extension",
        "torch.ops",
        "torch._ops",
        "torch.distributed.rpc",
        "torch.serialization.load",
        "torch._dynamo",
        "torch._inductor",
        "torch.compiler",
        "torch.fx",
        "pydoc",
        "_osx_support",
        "_aix_support",
        "_pyrepl",
        "cgitb",
        "test.support",
        "torch.utils.collect_env",
        "torch.utils.bottleneck",
        "torch.utils.data.datapipes",
    ]
)

# Individual callables that run code, read files or resolve attributes by name.
_DANGEROUS_NAMES = frozenset(
    [
        "builtins.eval",
        "builtins.exec",
        "builtins.execfile",
        "builtins.compile",
        "builtins.open",
        "builtins.input",
        "builtins.raw_input",
        "builtins.__import__",
        "builtins.getattr",
        "builtins.setattr",
        "builtins.delattr",
        "builtins.globals",
        "builtins.locals",
        "builtins.vars",
        "builtins.breakpoint",
        "builtins.help",
        "builtins.exit",
        "builtins.quit",
        "builtins.reload",
        "builtins.file",
        "builtins.apply",
        "io.open",
        "io.open_code",
        "io.FileIO",
        "_io.open",
        "_io.open_code",
        "_io.FileIO",
        "types.FunctionType",
        "types.LambdaType",
        "types.CodeType",
        "types.MethodType",
        "types.ModuleType",
        "operator.attrgetter",
        "operator.methodcaller",
        "functools.reduce",
        "torch.load",
        "torch.save",
        "torch.serialization.load",
        "torch.serialization._load",
        "torch.serialization._legacy_load",
        "torch.classes",
        "torch.from_file",
        "torch.UntypedStorage.from_file",
        "numpy.load",
        "numpy.save",
        "numpy.fromfile",
        "numpy.memmap",
        "numpy.loadtxt",
        "numpy.genfromtxt",
        "numpy.lib.npyio.load",
        "numpy.lib._npyio_impl.load",
        "numpy.testing._private.utils.runstring",
        "numpy.lib.utils.safe_eval",
        "numpy.lib._utils_impl.safe_eval",
        "pandas.read_pickle",
        "pandas.io.pickle.read_pickle",
        "uuid._get_command_stdout",
        "platform._syscmd_file",
        "platform._syscmd_ver",
    ]
)

# Method names that, reached through a qualified global such as
# ``pathlib.Path.write_text``, do something no checkpoint needs.
_DANGEROUS_METHODS = frozenset(
    [
        "system",
        "popen",
        "spawn",
        "spawnv",
        "spawnl",
        "eval",
        "exec",
        "compile",
        "unlink",
        "remove",
        "rmtree",
        "rmdir",
        "write_text",
        "write_bytes",
        "extractall",
        "import_module",
        "load",
        "loads",
        "check_output",
        "check_call",
        "getoutput",
        "startfile",
        "fork",
        "kill",
    ]
)

# Dunder names a legitimate pickle uses; every other ``__x__`` component in a
# global is an attempt to walk from an object to its internals.
_ALLOWED_DUNDERS = frozenset({"__newobj__", "__newobj_ex__", "__main__", "__builtin__"})

# Python 2 module names that pickles written by Python 2 use.
_PY2_MODULES = {
    "__builtin__": "builtins",
    "copy_reg": "copyreg",
    "cPickle": "pickle",
    "exceptions": "builtins",
    "UserDict": "collections",
    "_abcoll": "collections.abc",
}


def normalise_global(module: str, name: str) -> tuple[str, str]:
    """The Python 3 spelling of a global a Python 2 pickle names."""
    return _PY2_MODULES.get(module, module), name


def classify_global(module: str, name: str) -> str:
    """``"dangerous"``, ``"known"`` or ``"foreign"``: what ckptconv does with a pickle global.

    ``known`` globals are re-implemented by ckptconv, ``foreign`` ones become
    inert stand-ins, ``dangerous`` ones make the file be refused.
    """
    module, name = normalise_global(module, name)
    full = f"{module}.{name}"
    parts = full.split(".")
    name_parts = name.split(".")
    for part in name_parts:
        if part.startswith("__") and part.endswith("__") and part not in _ALLOWED_DUNDERS:
            return "dangerous"
    if len(name_parts) > 1 and name_parts[-1] in _DANGEROUS_METHODS:
        return "dangerous"
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if prefix in _DANGEROUS_MODULES or prefix in _DANGEROUS_NAMES:
            return "dangerous"
    if known_global(module, name) is not None:
        return "known"
    return "foreign"
