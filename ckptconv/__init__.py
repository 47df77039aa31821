"""ckptconv: open any PyTorch checkpoint safely on the CPU, and convert it.

The data flows one way, one module per stage::

    load.py       open() / load()   detect the format, read the structure, lazy tensors
    selection.py  Selection         find the weights inside a training checkpoint
    transform.py  StripPrefix, ...  pure steps over keys and dtypes
    write.py      save()            stream to .pt or safetensors, atomically
    verify.py     verify()          compare an output with its source, bit for bit

``convert()`` runs them all; ``inspect()`` describes a file. Format details
live in ``formats/``; the pickle machine that never runs code is
``unpickler.py``. Importing ckptconv does not import torch.
"""

from __future__ import annotations

from ._version import __version__
from .convert import ConversionReport, convert
from .errors import (
    CastOverflowError,
    CkptconvError,
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
from .inspection import CheckpointInfo, TensorInfo, inspect
from .load import Checkpoint, load, open
from .selection import Selection
from .tensor import TensorRef
from .transform import AddPrefix, Cast, Drop, Keep, Pipeline, Rename, StepReport, StripPrefix
from .verify import VerifyReport, verify
from .write import WriteReport, save

__all__ = [
    "AddPrefix",
    "Cast",
    "CastOverflowError",
    "Checkpoint",
    "CheckpointInfo",
    "CkptconvError",
    "ConversionReport",
    "Drop",
    "Keep",
    "KeyCollisionError",
    "LoadError",
    "MalformedCheckpointError",
    "OutputExistsError",
    "Pipeline",
    "Rename",
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
    "convert",
    "inspect",
    "load",
    "open",
    "save",
    "verify",
]
