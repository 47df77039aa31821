"""What a pickle may name: the security policy of ckptconv's pickle machine.

:func:`classify_global` sorts every global a pickle names into one of three kinds:

* ``"known"``: re-implemented by ckptconv in :mod:`ckptconv.reading.unpickling.rebuild` (torch's
  tensor rebuild functions, ``collections.OrderedDict``, numpy's reconstructor).
  This is the allowlist: only these are ever *safe*.
* ``"dangerous"``: a member of one of the *unsafe families* below (made to run
  code, spawn processes, touch files, reach the network, import, reach into the
  interpreter, load further pickles or tamper with scanners), or a dunder that
  walks from an object to its internals. The file is refused, and
  ``ckptconv scan`` calls it *unsafe*; :func:`unsafe_family` names the family.
* ``"foreign"``: everything else; it becomes an inert stand-in
  (:mod:`ckptconv.values.standins`) that is never imported nor called, and
  ``ckptconv scan`` lists it, because ``torch.load(weights_only=False)`` would
  import it and call it.

One exception to the families is narrow enough to state whole:
``builtins.getattr(Class, "name")``, which CPython's pickler writes for a
nested class (``ShardedTensor.ProcessGroupState``) below protocol 4 and for
an enum member from Python 3.12 on. :func:`attribute_lookup_refusal` allows it
only where ``Class`` is a foreign stand-in and ``name`` a plain identifier;
the result is the stand-in ``module.Class.name``, classified like any global
(so ``getattr(Popen, "x")`` or ``getattr(Thing, "system")`` stay unsafe), and
nothing is looked up. Any other use of ``getattr`` is unsafe.

The stand-ins are the safety boundary; the families are a warning about intent
(SECURITY.md documents them). The interpreter that enforces this policy is
:mod:`ckptconv.reading.unpickling.unpickler`.
"""

from __future__ import annotations

import _compat_pickle  # CPython's own table of Python 2 names, used by every unpickler for protocols 0-2

from ckptconv.reading.unpickling.rebuild import known_global
from ckptconv.reading.unpickling.unsafe_globals import DANGEROUS_METHODS, FAMILIES

__all__ = [
    "GETATTR",
    "TORCH_OWN_TYPES",
    "attribute_lookup_refusal",
    "classify_global",
    "normalise_global",
    "unsafe_family",
]

# Types torch itself names when it saves its own tensors (``_rebuild_from_type_v2(..., torch.Tensor, ...)``
# for a tensor with Python attributes). They stay inert stand-ins, but they are not "classes from code
# that is not here", so they are never listed as such.
TORCH_OWN_TYPES = frozenset({"torch.Tensor"})


# Modules inside an unsafe family whose members only build data: TorchScript archives
# name torch.jit._pickle.build_intlist and friends, which return the list they are given.
_DATA_ONLY_MODULES = frozenset(["torch.jit._pickle"])
# Classes inside an unsafe module that only hold data, with their members: the enums of the
# signal module. Megatron-LM's argument namespace, saved in every checkpoint it writes, holds
# ``exit_signal = signal.SIGTERM``, pickled as ``signal.Signals(15)``; building that member
# sends nothing (``signal.signal``, ``raise_signal``, ``pthread_kill``... stay unsafe).
_DATA_ONLY_CLASSES = frozenset(["signal.Signals", "signal.Handlers", "signal.Sigmasks"])
# Up to Python 3.10 the same member pickles as the module's constant itself, ``signal.SIGTERM``
# (enums made by ``IntEnum._convert_`` reduce to their name): every Megatron-LM checkpoint saved
# under Python 3.10 or older names it. The signal module's upper-case names are all such constants
# (``SIGTERM``, ``SIG_DFL``, ``NSIG``, ``ITIMER_REAL``); its functions are lower case and stay unsafe.
_DATA_ONLY_CONSTANTS = frozenset(["signal", "_signal"])
_METHOD_FAMILY = {method: family for family, methods in DANGEROUS_METHODS.items() for method in methods}
_NAME_FAMILY = {name: family for family, (_modules, names) in FAMILIES.items() for name in names}
_MODULE_FAMILY: dict[str, str] = {}
for _family, (_modules, _names) in FAMILIES.items():
    for _module in _modules:
        _MODULE_FAMILY.setdefault(_module, _family)

# Dunder names a legitimate pickle uses; every other ``__x__`` component in a
# global is an attempt to walk from an object to its internals.
_ALLOWED_DUNDERS = frozenset({"__newobj__", "__newobj_ex__", "__main__", "__builtin__"})

# Python 2 module names that pickles written by Python 2 use.
_PY2_MODULES = {
    "__builtin__": "builtins",
    "httplib": "http.client",
    "urllib2": "urllib.request",
    "SocketServer": "socketserver",
    "xmlrpclib": "xmlrpc.client",
    "copy_reg": "copyreg",
    "cPickle": "pickle",
    "exceptions": "builtins",
    "UserDict": "collections",
    "_abcoll": "collections.abc",
}


def normalise_global(module: str, name: str) -> tuple[str, str]:
    """The Python 3 spelling of a global a Python 2 pickle names."""
    return _PY2_MODULES.get(module, module), name


def unsafe_family(module: str, name: str) -> str | None:
    """The unsafe family ``module.name`` belongs to (``"runs processes"``, ...), or None.

    A dunder component other than the few a pickle legitimately names
    (``copyreg.__newobj__``) counts as ``"reaches into the interpreter"``. Both
    spellings count: as written, and as CPython's unpickler renames Python 2
    names for protocols 0-2 (``commands.getoutput`` is ``subprocess.getoutput``,
    ``__builtin__.reduce`` is ``functools.reduce``).
    """
    spellings = [normalise_global(module, name)]
    renamed = _compat_pickle.NAME_MAPPING.get((module, name))
    if renamed is None and module in _compat_pickle.IMPORT_MAPPING:
        renamed = (_compat_pickle.IMPORT_MAPPING[module], name)
    if renamed is not None:
        spellings.append(renamed)
    for spelling in spellings:
        family = _family_of(*spelling)
        if family is not None:
            return family
    return None


def _family_of(module: str, name: str) -> str | None:
    name_parts = name.split(".")
    for part in name_parts:
        if part.startswith("__") and part.endswith("__") and part not in _ALLOWED_DUNDERS:
            return "reaches into the interpreter"
    if len(name_parts) > 1 and name_parts[-1] in _METHOD_FAMILY:
        return _METHOD_FAMILY[name_parts[-1]]
    if module in _DATA_ONLY_MODULES and len(name_parts) == 1:
        return None
    if module in _DATA_ONLY_CONSTANTS and len(name_parts) == 1 and _is_constant_name(name):
        return None
    full = f"{module}.{name}"
    if any(full == cls or full.startswith(cls + ".") for cls in _DATA_ONLY_CLASSES):
        return None
    parts = f"{module}.{name}".split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        family = _MODULE_FAMILY.get(prefix) or _NAME_FAMILY.get(prefix)
        if family is not None:
            return family
    if known_global(module, name) is not None:
        return None
    # The name is an attribute chain from the module (CPython resolves ``a.b.c`` by getattr), so every
    # module the chain passes through counts: ``__future__._ssl.RAND_bytes`` reaches ``_ssl``, and
    # ``anything.os`` is the os module itself (which BUILD would monkeypatch).
    for j in range(len(name_parts)):
        tail_module, tail_name = name_parts[j], ".".join(name_parts[j + 1 :])
        family = _family_of(tail_module, tail_name) if tail_name else _MODULE_FAMILY.get(tail_module)
        if family is not None:
            return family
    return None


# ``builtins.getattr`` (Python 3 spelling), the one unsafe global with a narrow allowed use.
GETATTR = ("builtins", "getattr")


def attribute_lookup_refusal(module: str, name: str, attribute: object) -> str | None:
    """Why ``getattr(<stand-in module.name>, attribute)`` is refused, or None when it is allowed.

    Allowed: ``module.name`` is not unsafe itself, ``attribute`` is a plain
    ASCII identifier with no leading or trailing ``__`` (no dunders), and ``module.name.attribute`` belongs to no unsafe
    family (which also refuses method names such as ``system`` or ``load``).
    The caller checks that the target is an inert stand-in class.
    """
    if unsafe_family(module, name) is not None:
        return f"its target {module}.{name} is unsafe itself"
    if not isinstance(attribute, str):
        return f"the attribute name is {type(attribute).__name__}, not a string"
    if not (attribute.isascii() and attribute.isidentifier()) or attribute.startswith("__") or attribute.endswith("__"):
        return f"{attribute[:60]!r} is not a plain attribute name"
    family = unsafe_family(module, f"{name}.{attribute}")
    if family is not None:
        return f"{module}.{name}.{attribute} {family}"
    return None


def classify_global(module: str, name: str) -> str:
    """``"dangerous"``, ``"known"`` or ``"foreign"``: what ckptconv does with a pickle global.

    ``known`` globals are re-implemented by ckptconv, ``foreign`` ones become
    inert stand-ins, ``dangerous`` ones (see :func:`unsafe_family`) make the
    file be refused.
    """
    if unsafe_family(module, name) is not None:
        return "dangerous"
    module, name = normalise_global(module, name)
    if known_global(module, name) is not None:
        return "known"
    return "foreign"


def _is_constant_name(name: str) -> bool:
    """``SIGTERM``, ``SIG_DFL``: an upper-case ASCII letter, then upper-case letters, digits and underscores."""
    return (
        name[:1].isascii()
        and name[:1].isupper()
        and all(c.isascii() and (c.isupper() or c.isdigit() or c == "_") for c in name)
    )
