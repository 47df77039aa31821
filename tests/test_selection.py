"""Selection: the documented search order, EMA never picked silently, clear ambiguity errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ckptconv
from ckptconv.errors import SelectionError

from .conftest import tiny_state_dict


def select(tmp_path: Path, obj: Any, choice: str | None = None) -> ckptconv.Selection:
    path = tmp_path / "ckpt.pt"
    torch.save(obj, path)
    return ckptconv.open(path).select(choice)


@pytest.mark.parametrize(
    "layout, where",
    [
        ({"state_dict": "SD", "epoch": 1, "optimizer": {"state": {}, "param_groups": []}}, "state_dict"),
        ({"model_state_dict": "SD", "optimizer_state_dict": {}}, "model_state_dict"),
        ({"model": "SD", "epoch": 2}, "model"),
        ({"net": "SD"}, "net"),
        ({"model": {"state_dict": "SD", "config": {"depth": 2}}}, "model.state_dict"),
        ({"app": {"model": "SD"}}, "app.model"),
        ({"weights_only_here": "SD", "note": "x"}, "weights_only_here"),
        ({"state_dict": "SD", "model": "SD"}, "state_dict"),
    ],
)
def test_search_order(tmp_path: Path, layout: dict[str, Any], where: str) -> None:
    def fill(value: Any) -> Any:
        if value == "SD":
            return tiny_state_dict()
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        return value

    selection = select(tmp_path, fill(layout))
    assert selection.where == where
    assert len(selection.weights) == 9


def test_the_file_itself_is_a_state_dict(tmp_path: Path) -> None:
    selection = select(tmp_path, tiny_state_dict())
    assert selection.where == "" and selection.note == "" and selection.alternatives == ()


def test_ema_is_mentioned_never_silently_preferred(tmp_path: Path) -> None:
    selection = select(tmp_path, {"state_dict": tiny_state_dict(0), "state_dict_ema": tiny_state_dict(1)})
    assert selection.where == "state_dict" and not selection.is_ema
    assert "state_dict_ema" in selection.note


def test_only_ema_weights_are_used_with_a_note(tmp_path: Path) -> None:
    selection = select(tmp_path, {"ema": tiny_state_dict(), "epoch": 3})
    assert selection.where == "ema" and selection.is_ema
    assert "EMA" in selection.note


def test_explicit_select(tmp_path: Path) -> None:
    obj = {"params": tiny_state_dict(0), "params_ema": tiny_state_dict(1)}
    assert select(tmp_path, obj).where == "params"
    assert select(tmp_path, obj, "params_ema").where == "params_ema"
    assert select(tmp_path, obj, "ema").where == "params_ema"


def test_keys_with_dots_are_matched_whole(tmp_path: Path) -> None:
    obj = {"model.ema": tiny_state_dict(1), "model": {"x": 1}}
    assert select(tmp_path, obj, "model.ema").where == "model.ema"


def test_ambiguity_lists_candidates(tmp_path: Path) -> None:
    with pytest.raises(SelectionError) as raised:
        select(tmp_path, {"generator": tiny_state_dict(0), "discriminator": tiny_state_dict(1)})
    assert raised.value.candidates == ("generator", "discriminator")


def test_optimizer_state_is_never_taken_for_weights(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(1, 2)).sum().backward()
    optimizer.step()
    with pytest.raises(SelectionError, match="holds no state dict"):
        select(tmp_path, {"optimizer": optimizer.state_dict(), "epoch": 1})


def test_extra_state_and_none_entries_are_skipped(tmp_path: Path) -> None:
    obj = {"w": torch.ones(2), "layer._extra_state": {"fp8": 1}, "missing": None}
    selection = select(tmp_path, obj)
    assert list(selection.weights) == ["w"]
    assert selection.skipped == ("layer._extra_state", "missing")
