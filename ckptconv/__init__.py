"""ckptconv: open any PyTorch checkpoint safely on the CPU, and convert it.

The data flows one way, one folder per stage (ARCHITECTURE.md draws it)::

    reading/     open() / load()   detect the format, read the structure, lazy tensors
    selection/   Selection         find the weights inside a training checkpoint
    transforms/  StripPrefix, ...  pure steps over keys and dtypes; the cast kernels
    writing/     save()            stream to .pt, safetensors, shards or DCP, atomically
    checking/    verify(), diff()  compare an output with its source, bit for bit; inspect, scan

``conversion.convert()`` runs them all, as ``options.ConversionOptions`` says; ``loading`` is the
face of reading (``open``, ``load``) and ``fitting`` finds the key plan that matches a reference
model. ``batching/`` converts a whole folder, ``gpu/`` loads onto GPUs, ``values/`` holds the value
objects every stage shares. Which files may be read is decided in ``reading/read_policy.py``, which
may be written in ``writing/write_policy.py``, what a pickle may call in
``reading/unpickling/pickle_policy.py``.

The public names below are imported on first use, so ``ckptconv --help`` and
``import ckptconv`` stay fast; importing ckptconv never imports torch. (Modules
are named for the stage, not the function, so that importing a submodule can
never shadow a function of the same name on the package.)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ckptconv._version import __version__
from ckptconv.errors import (
    CastOverflowError,
    CkptconvError,
    DestinationError,
    DeviceError,
    FitError,
    InvalidConfigError,
    KeyCollisionError,
    LoadError,
    MalformedCheckpointError,
    MissingDependencyError,
    OutputExistsError,
    SelectionError,
    TrainingStateError,
    TransformError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
    UnsupportedQuantizationError,
    VerifyError,
    WriteError,
)

if TYPE_CHECKING:
    from ckptconv.adapters.extraction import ExtractionReport, extract_lora
    from ckptconv.adapters.merging import merge_lora
    from ckptconv.batching.flow import batch
    from ckptconv.batching.report import BatchReport, ItemResult
    from ckptconv.checking.inspection import CheckpointInfo, TensorInfo, inspect
    from ckptconv.checking.scanning import ScanReport, ScanSummary, scan, scan_many
    from ckptconv.checking.verification import DiffReport, VerifyReport, diff, verify
    from ckptconv.conversion import ConversionReport, convert
    from ckptconv.fitting import FitReport, Reference, fit, load_into
    from ckptconv.loading import Checkpoint, load, open
    from ckptconv.options import ConversionOptions
    from ckptconv.selection.weights import Selection
    from ckptconv.transforms.keys import (
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
    from ckptconv.values.tensor import TensorRef
    from ckptconv.writing.files import WriteReport
    from ckptconv.writing.writer import save

_HOMES = {
    ".adapters.extraction": ["ExtractionReport", "extract_lora"],
    ".adapters.merging": ["merge_lora"],
    ".batching.flow": ["batch"],
    ".batching.report": ["BatchReport", "ItemResult"],
    ".conversion": ["ConversionReport", "convert"],
    ".fitting": ["FitReport", "Reference", "fit", "load_into"],
    ".checking.inspection": ["CheckpointInfo", "TensorInfo", "inspect"],
    ".checking.scanning": ["ScanReport", "ScanSummary", "scan", "scan_many"],
    ".loading": ["Checkpoint", "load", "open"],
    ".options": ["ConversionOptions"],
    ".selection.weights": ["Selection"],
    ".values.tensor": ["TensorRef"],
    ".transforms.keys": [
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
    ".checking.verification": ["DiffReport", "VerifyReport", "diff", "verify"],
    ".writing.writer": ["WriteReport", "save"],
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
    "DeviceError",
    "DiffReport",
    "Drop",
    "ExtractionReport",
    "FitError",
    "FitReport",
    "InvalidConfigError",
    "ItemResult",
    "Keep",
    "KeyCollisionError",
    "LoadError",
    "MalformedCheckpointError",
    "MissingDependencyError",
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
    "TrainingStateError",
    "TransformError",
    "UnsafeCheckpointError",
    "UnsupportedFormatError",
    "UnsupportedQuantizationError",
    "VerifyError",
    "VerifyReport",
    "WriteError",
    "WriteReport",
    "__version__",
    "batch",
    "canonicalize",
    "convert",
    "diff",
    "extract_lora",
    "fit",
    "inspect",
    "load",
    "load_into",
    "merge_lora",
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
