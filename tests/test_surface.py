"""The public surface stays put: ``ckptconv.__all__``, every public signature and every ``--help`` text.

``tests/api_surface.json`` records them (recorded before the package was laid out by stage, in which
only ``TensorRef.verbatim_region``'s annotation changed: the region it returns is typed by the value
layer's protocol now). A change to the surface is a change to this file, made on purpose and reviewed.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner

import ckptconv
from ckptconv.cli import cli

RECORD = Path(__file__).with_name("api_surface.json")


def describe(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        out["signature"] = str(inspect.signature(obj))
    except (TypeError, ValueError):
        out["signature"] = None
    if inspect.isclass(obj):
        members: dict[str, str | None] = {}
        for name, member in sorted(vars(obj).items()):
            if name.startswith("_") and name not in ("__init__", "__call__", "__torch_function__"):
                continue
            target = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
            if callable(target):
                try:
                    members[name] = str(inspect.signature(target))
                except (TypeError, ValueError):
                    members[name] = None
            elif isinstance(member, property):
                members[name] = "property"
        out["members"] = members
    return out


def surface() -> dict[str, Any]:
    recorded: dict[str, Any] = {"__all__": list(ckptconv.__all__), "objects": {}, "help": {}}
    for name in ckptconv.__all__:
        if name != "__version__":
            recorded["objects"][name] = describe(getattr(ckptconv, name))
    runner = CliRunner()
    for argv in [[]] + [[name] for name in sorted(cli.commands)]:
        result = runner.invoke(cli, [*argv, "--help"], prog_name="ckptconv", terminal_width=100)
        assert result.exit_code == 0, result.output
        recorded["help"][" ".join(["ckptconv", *argv])] = result.output
    return recorded


def test_public_surface_is_as_recorded() -> None:
    assert surface() == json.loads(RECORD.read_text())


def test_the_record_covers_every_command_and_name() -> None:
    recorded = json.loads(RECORD.read_text())
    assert set(recorded["help"]) == {"ckptconv", *(f"ckptconv {name}" for name in cli.commands)}
    assert set(recorded["objects"]) == set(ckptconv.__all__) - {"__version__"}
