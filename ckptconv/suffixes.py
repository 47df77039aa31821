"""What checkpoint files are called: the one list of suffixes every module asks.

Names never decide a file's format (:func:`ckptconv.reading.detection.detect` reads its
content); they decide which files to look at (a folder's single checkpoint,
a batch's items), which files make up a checkpoint (its shards), and which
format an output gets when ``--to`` is not given.
"""

from __future__ import annotations

__all__ = [
    "CHECKPOINT_SUFFIXES",
    "DCP_DATA_SUFFIX",
    "DCP_METADATA",
    "INDEX_SUFFIX",
    "INDEX_SUFFIXES",
    "SAFETENSORS_SUFFIX",
    "SHARD_SUFFIXES",
    "TAR_SUFFIX",
    "TORCH_SUFFIXES",
]

SAFETENSORS_SUFFIX = ".safetensors"
# What torch.save files are called, longest first, so "x.pth.tar" loses ".pth.tar", not ".tar".
# A bare ".tar" is left out: most .tar files are tar archives, found by content when they are not.
TORCH_SUFFIXES = (".pth.tar", ".pt.tar", ".pickle", ".ckpt", ".pth", ".pkl", ".bin", ".pt")
# "model_best.tar": an output so named is a torch file; an input is taken when its content is one.
TAR_SUFFIX = ".tar"
# Every name a single-file checkpoint goes by.
CHECKPOINT_SUFFIXES = (*TORCH_SUFFIXES, SAFETENSORS_SUFFIX)
# The shards of a Hugging Face sharded checkpoint, and the index that names them.
SHARD_SUFFIXES = (SAFETENSORS_SUFFIX, ".bin", ".pt", ".pth")
INDEX_SUFFIX = ".index.json"
INDEX_SUFFIXES = tuple(suffix + INDEX_SUFFIX for suffix in SHARD_SUFFIXES)
# A torch.distributed.checkpoint folder: its metadata file and its data files.
DCP_METADATA = ".metadata"
DCP_DATA_SUFFIX = ".distcp"
