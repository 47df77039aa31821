"""ckptconv: open any PyTorch checkpoint safely on the CPU, and convert it.

The data flows one way, one module per stage::

    loading.py       open() / load()   detect the format, read the structure, lazy tensors
    selection.py     Selection         find the weights inside a training checkpoint
                                       (what a state dict or a module is: ``state_dicts.py``)
    transforms.py    StripPrefix, ...  pure steps over keys and dtypes
    fitting.py       fit()             find the key plan that matches a reference model
    writing.py       save()            stream to .pt, safetensors, shards or DCP, atomically
    verification.py  verify(), diff()  compare an output with its source, bit for bit

``conversion.convert()`` runs them all, as ``options.ConversionOptions`` says;
``scanning.scan()`` says whether a file is safe to load; ``inspection.inspect()``
describes a file. ``batching.batch()`` converts a whole folder: ``discovery.py``
finds the items and names their outputs, ``executors.py`` converts them in
workers, ``manifest.py`` records each result, ``report.py`` sums them up.
Format details live in ``formats/``, file names in ``suffixes.py``. The pickle
machine that never runs code is ``unpickler.py``; what it may call is decided
in ``pickle_policy.py``, built by ``rebuild.py`` or stood in for by ``standins.py``.
Which files may be read is decided in ``read_policy.py`` (regular files, inside
the checkpoint's folder, size caps), which may be written in ``write_policy.py``
(never an input, never through a link, nothing outside DST).

The public names below are imported on first use, so ``ckptconv --help`` and
``import ckptconv`` stay fast; importing ckptconv never imports torch. (Modules
are named for the stage, not the function, so that importing a submodule can
never shadow a function of the same name on the package.)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (
    CastOverflowError,
    CkptconvError,
    DestinationError,
    FitError,
    KeyCollisionError,
    LoadError,
    MalformedCheckpointError,
    OutputExistsError,
    SelectionError,
    TransformError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
    VerifyError,
    WriteError,
)

if TYPE_CHECKING:
    from .batching import batch
    from .conversion import ConversionReport, convert
    from .fitting import FitReport, Reference, fit, load_into
    from .inspection import CheckpointInfo, TensorInfo, inspect
    from .loading import Checkpoint, load, open
    from .options import ConversionOptions
    from .report import BatchReport, ItemResult
    from .scanning import ScanReport, ScanSummary, scan, scan_many
    from .selection import Selection
    from .tensor import TensorRef
    from .transforms import (
        AddPrefix,
        Canonicalize,
        Cast,
        Drop,
        Keep,
        Pipeline,
        Rename,
        StepReport,
        StripPrefix,
        canonicalize,
    )
    from .verification import DiffReport, VerifyReport, diff, verify
    from .writing import WriteReport, save

_HOMES = {
    ".batching": ["batch"],
    ".report": ["BatchReport", "ItemResult"],
    ".conversion": ["ConversionReport", "convert"],
    ".fitting": ["FitReport", "Reference", "fit", "load_into"],
    ".inspection": ["CheckpointInfo", "TensorInfo", "inspect"],
    ".scanning": ["ScanReport", "ScanSummary", "scan", "scan_many"],
    ".loading": ["Checkpoint", "load", "open"],
    ".options": ["ConversionOptions"],
    ".selection": ["Selection"],
    ".tensor": ["TensorRef"],
    ".transforms": [
        "AddPrefix",
        "Canonicalize",
        "Cast",
        "Drop",
        "Keep",
        "Pipeline",
        "Rename",
        "StepReport",
        "StripPrefix",
        "canonicalize",
    ],
    ".verification": ["DiffReport", "VerifyReport", "diff", "verify"],
    ".writing": ["WriteReport", "save"],
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

# Checked against _HOMES and errors.__all__ by tests/test_api.py.
__all__ = [
    "AddPrefix",
    "BatchReport",
    "Canonicalize",
    "Cast",
    "CastOverflowError",
    "Checkpoint",
    "CheckpointInfo",
    "CkptconvError",
    "ConversionOptions",
    "ConversionReport",
    "DestinationError",
    "DiffReport",
    "Drop",
    "FitError",
    "FitReport",
    "ItemResult",
    "Keep",
    "KeyCollisionError",
    "LoadError",
    "MalformedCheckpointError",
    "OutputExistsError",
    "Pipeline",
    "Reference",
    "Rename",
    "ScanReport",
    "ScanSummary",
    "Selection",
    "SelectionError",
    "StepReport",
    "StripPrefix",
    "TensorInfo",
    "TensorRef",
    "TransformError",
    "UnsafeCheckpointError",
    "UnsupportedFormatError",
    "VerifyError",
    "VerifyReport",
    "WriteError",
    "WriteReport",
    "__version__",
    "batch",
    "canonicalize",
    "convert",
    "diff",
    "fit",
    "inspect",
    "load",
    "load_into",
    "open",
    "save",
    "scan",
    "scan_many",
    "verify",
]


def __getattr__(name: str) -> Any:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptconv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
