"""Checking: what a checkpoint holds and whether it is what it should be, without writing.

``verification`` (``verify``, ``diff``), ``reference`` (independent readers: torch.load, safetensors),
``inspection`` (``inspect``) and ``scanning`` (``scan``: safe to ``torch.load``?).
"""
