"""The public API: every exported name resolves, and importing ckptconv stays light."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import ckptconv


def test_every_exported_name_resolves() -> None:
    for name in ckptconv.__all__:
        assert getattr(ckptconv, name) is not None, name


def test_functions_are_never_shadowed_by_submodules() -> None:
    for module in ("loading", "conversion", "verification", "writing", "inspection", "transforms", "selection"):
        importlib.import_module(f"ckptconv.{module}")
    for name in ("open", "load", "convert", "save", "inspect", "verify"):
        assert inspect.isfunction(getattr(ckptconv, name)), name


def test_importing_ckptconv_does_not_import_torch_or_numpy() -> None:
    code = "import sys, ckptconv; assert not {'torch', 'numpy'} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_functions_take_keyword_only_options() -> None:
    for name in ("open", "load", "convert", "save", "inspect", "verify"):
        parameters = list(inspect.signature(getattr(ckptconv, name)).parameters.values())
        positional = [p for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert len(positional) <= 2, name
        assert all(p.kind is p.KEYWORD_ONLY for p in parameters[len(positional):]), name
