"""The public API: every exported name resolves, and importing ckptconv stays light."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys

import ckptconv


def test_every_exported_name_resolves() -> None:
    for name in ckptconv.__all__:
        assert getattr(ckptconv, name) is not None, name


def test_functions_are_never_shadowed_by_submodules() -> None:
    for module in pkgutil.walk_packages(ckptconv.__path__, "ckptconv."):
        if module.name not in ("ckptconv.__main__", "ckptconv.batching.worker"):
            importlib.import_module(module.name)
    for name in ("open", "load", "convert", "save", "inspect", "verify"):
        assert inspect.isfunction(getattr(ckptconv, name)), name


def test_all_lists_every_lazy_name_and_every_error() -> None:
    expected = sorted([*ckptconv._HOME_OF, *ckptconv.errors.__all__, "__version__"])
    assert ckptconv.__all__ == expected


def test_importing_ckptconv_does_not_import_torch_or_numpy() -> None:
    code = "import sys, ckptconv; assert not {'torch', 'numpy'} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_functions_take_keyword_only_options() -> None:
    for name in ("open", "load", "convert", "save", "inspect", "verify"):
        parameters = list(inspect.signature(getattr(ckptconv, name)).parameters.values())
        positional = [p for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert len(positional) <= 2, name
        # convert() also takes ConversionOptions' fields as keywords (**changes): keyword-only too.
        assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in parameters[len(positional) :]), name


def test_conversions_and_inspect_run_without_torch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The streaming path never imports torch: it runs even where torch cannot be imported."""
    import torch

    source = tmp_path / "dp.pt"
    torch.save({"module.w": torch.randn(64, 64), "module.n": torch.arange(3)}, source)
    script = (
        "import sys\n"
        "sys.modules['torch'] = None  # any `import torch` now fails\n"
        "from ckptconv.cli import main\n"
        "for argv in ([\"strip-module\", sys.argv[1], sys.argv[2] + '/a.pt', '-q'],\n"
        "             [\"convert\", sys.argv[1], sys.argv[2] + '/b.safetensors', '--dtype', 'bf16', '-q'],\n"
        "             [\"convert\", sys.argv[2] + '/b.safetensors', sys.argv[2] + '/c.pt', '--verify', '-q'],\n"
        "             [\"inspect\", sys.argv[1], '--json']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as done:\n"
        "        assert done.code == 0, (argv, done.code)\n"
    )
    subprocess.run([sys.executable, "-c", script, str(source), str(tmp_path)], check=True, capture_output=True)
    assert (tmp_path / "c.pt").exists()


def test_fit_given_a_path_instead_of_a_state_says_what_it_takes() -> None:
    """ckptconv.fit("model.pt", model) failed inside with "string indices must be integers"."""
    import pytest

    for state in ("model.pt", b"model.pt", 3):
        with pytest.raises(TypeError) as raised:
            ckptconv.fit(state, {"w": (2,)})  # type: ignore[arg-type]
        assert str(raised.value) == (
            f"fit takes a mapping of names to tensors, not a {type(state).__name__}; for a file give "
            "ckptconv.open(path).select().weights"
        )
