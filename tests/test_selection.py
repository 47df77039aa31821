"""Selection: the documented search order, EMA never picked silently, clear ambiguity errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ckptconv
from ckptconv.errors import SelectionError

from .conftest import run_cli, tiny_state_dict


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


@pytest.mark.parametrize(
    ("obj", "select_text", "ways"),
    [
        (
            {"model.state_dict": {"a": torch.ones(1)}, "model": {"state_dict": {"b": torch.zeros(1)}}},
            "model.state_dict",
            "'model.state_dict' and 'model' -> 'state_dict'",
        ),
        ({"0": {"a": torch.ones(1)}, 0: {"b": torch.zeros(1)}}, "0", "'0' and 0"),
    ],
)
def test_a_select_path_that_names_two_places_is_refused(
    tmp_path: Path, obj: dict[Any, Any], select_text: str, ways: str
) -> None:
    """--select took the longest key silently, though the path named another set of weights too."""
    source = tmp_path / "ckpt.pt"
    torch.save(obj, source)
    with pytest.raises(SelectionError, match=f"names two places in it: {ways}"):
        ckptconv.open(source).select(select_text)
    code, _, stderr = run_cli("convert", str(source), str(tmp_path / "out.pt"), "--select", select_text)
    assert code == 1 and stderr.count("\n") == 1 and "names two places" in stderr, stderr
    # Nor does the search pick one of two sets of weights that --select cannot tell apart.
    code, _, stderr = run_cli("convert", str(source), str(tmp_path / "out.pt"))
    assert code == 1 and stderr.count("\n") == 1, stderr
    assert f"holds two sets of weights both spelled {select_text!r} ({ways})" in stderr, stderr
    assert not (tmp_path / "out.pt").exists()


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


@pytest.mark.parametrize(
    "plain",
    [
        {"epoch": 3},
        {"step": 2**70},  # a LONG opcode
        {"shape": torch.Size([2, 3]), "dtype": torch.float16, "device": torch.device("cpu")},
        {"tags": {"a", "b"}, "blob": b"\x00\x01", "name": "run-7", "lr": 1e-3, "done": True},
    ],
)
def test_tensors_beside_plain_values_are_the_weights(tmp_path: Path, plain: dict[str, Any]) -> None:
    """`state = model.state_dict(); state["epoch"] = 3; torch.save(state)`: the tensors are the weights,
    bit for bit as torch reads them, and the plain entries are counted as skipped."""
    path = tmp_path / "mixed.pt"
    torch.save({**tiny_state_dict(), **plain}, path)
    expected = torch.load(path, weights_only=False)
    output = tmp_path / "out.safetensors"
    code, _, stderr = run_cli("convert", str(path), str(output))
    assert code == 0, stderr
    from safetensors.torch import load_file

    written = load_file(output)
    tensors = {key: value for key, value in expected.items() if isinstance(value, torch.Tensor)}
    assert written.keys() == tensors.keys()
    for key, tensor in tensors.items():
        assert torch.equal(written[key].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), key
    entries = "non-tensor entry" if len(plain) == 1 else "non-tensor entries"
    assert f"left out {len(plain)} {entries}" in stderr


def test_tensors_beside_a_container_of_tensors_are_refused(tmp_path: Path) -> None:
    """Taking the top-level tensors would drop the ones in the list: refused, not guessed."""
    path = tmp_path / "mixed.pt"
    torch.save({"w": torch.ones(2), "layers": [torch.zeros(3), torch.zeros(4)]}, path)
    with pytest.raises(SelectionError, match="holds no state dict or model"):
        ckptconv.open(path).select()


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("select", [None, "model"])
def test_a_state_dict_that_nests_mappings_of_tensors_is_taken_whole(tmp_path: Path, select: str | None) -> None:
    """The nested mapping alone was taken for the weights (with --select model too, without a word): the
    model's own tensors were dropped, and diff and verify called the files identical to its one tensor."""
    model = {
        "w": torch.arange(4.0),
        "v": torch.ones(2),
        "nested": {"x": torch.zeros(3), "deeper": {"y": torch.ones(1)}},
    }
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model, "step": 7}, path)
    selection = ckptconv.open(path).select(select)
    assert selection.where == "model" and not selection.note
    loaded = torch.load(path, weights_only=True)["model"]
    expected = {
        "w": loaded["w"],
        "v": loaded["v"],
        "nested.x": loaded["nested"]["x"],
        "nested.deeper.y": loaded["nested"]["deeper"]["y"],
    }
    weights = ckptconv.load(path, select=select)
    assert weights.keys() == expected.keys() and all(_bits(weights[k]) == _bits(v) for k, v in expected.items())
    torch.save({"x": torch.zeros(3)}, tmp_path / "other.pt")
    code, _, _ = run_cli("diff", str(path), str(tmp_path / "other.pt"))
    assert code == 3
    code, _, _ = run_cli("verify", str(path), str(tmp_path / "other.pt"))
    assert code == 3


@pytest.mark.parametrize(
    ("tree", "where", "note"),
    [
        ({"state_dict": {"a.w": torch.ones(2)}, "loss_scale": torch.tensor(2.0)}, "state_dict", ""),
        ({"model": {"a.w": torch.ones(2)}, "buf": torch.ones(3)}, "model", "left out 1 tensor outside 'model' ('buf')"),
    ],
)
def test_a_tensor_beside_named_weights_does_not_make_the_file_one_state_dict(
    tree: dict[str, Any], where: str, note: str, tmp_path: Path
) -> None:
    """Flattening nested mappings took the whole file for one state dict when a loose tensor sat beside
    `state_dict` or `model` (keys 'loss_scale', 'state_dict.a.w', no note): named weights are found as before."""
    path = tmp_path / "beside.pt"
    torch.save(tree, path)
    selection = ckptconv.open(path).select()
    assert (sorted(selection.weights), selection.where) == (["a.w"], where)
    assert note in selection.note and (note or not selection.note)


def test_nested_names_that_meet_a_dotted_key_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "twice.pt"
    torch.save({"w": torch.ones(1), "head.b": torch.ones(2), "head": {"b": torch.zeros(2)}}, path)
    with pytest.raises(SelectionError, match=r"both named 'head\.b'"):
        ckptconv.open(path).select()


def test_mappings_of_mappings_are_still_sets_of_weights_to_pick(tmp_path: Path) -> None:
    """{"G": ..., "D": ...}: two models (a GAN), not one to flatten."""
    path = tmp_path / "gan.pt"
    torch.save({"G": {"w": torch.ones(2)}, "D": {"w": torch.zeros(2)}}, path)
    with pytest.raises(SelectionError, match="several sets of weights"):
        ckptconv.open(path).select()


def test_select_refuses_a_mapping_whose_tensors_it_cannot_take_whole(tmp_path: Path) -> None:
    path = tmp_path / "mixed.pt"
    torch.save({"model": {"w": torch.ones(2), "layers": [torch.zeros(3)], "sub": {"x": torch.ones(1)}}}, path)
    with pytest.raises(SelectionError, match="takes all of it or nothing"):
        ckptconv.open(path).select("model")
    selection = ckptconv.open(path).select()  # the search takes a part, and says what it leaves out
    assert "left out" in selection.note


def test_two_mappings_of_tensors_beside_plain_values_are_ambiguous(tmp_path: Path) -> None:
    path = tmp_path / "two.pt"
    torch.save({"a": {"w": torch.ones(2), "epoch": 1}, "b": {"w": torch.ones(2), "epoch": 2}}, path)
    with pytest.raises(SelectionError, match="several sets of weights"):
        ckptconv.open(path).select()


def test_tensors_outside_the_selected_weights_are_counted_in_the_note(tmp_path: Path) -> None:
    selection = select(
        tmp_path,
        {
            "model": tiny_state_dict(),
            "extra_head": torch.ones(3),
            "best_score": torch.tensor(0.5),  # 0-dim: a counter, not a weight
            "optimizer": {"state": {0: {"exp_avg": torch.ones(4)}}},  # training state
        },
    )
    assert selection.where == "model"
    assert selection.note == "left out 1 tensor outside 'model' ('extra_head'); pass --select to choose other weights"


def test_a_plain_training_checkpoint_has_no_left_out_note(tmp_path: Path) -> None:
    selection = select(
        tmp_path,
        {"state_dict": tiny_state_dict(), "epoch": 3, "optimizer": {"state": {0: {"exp_avg": torch.ones(4)}}}},
    )
    assert selection.where == "state_dict" and selection.note == ""


def test_meta_tensors_are_refused_with_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "meta.pt"
    torch.save({"w": torch.empty(3, device="meta")}, path)
    with pytest.raises(SelectionError, match=r"meta-device tensors \('w'\).*materialise them"):
        ckptconv.open(path).select()


@pytest.mark.parametrize("choice", ["²", "model.²", "layers.²", "9" * 5000])
def test_select_with_digits_int_refuses_is_a_one_line_error(tmp_path: Path, choice: str) -> None:
    # str.isdigit() takes "²" and any number of digits; int() refuses both: no key, not a traceback.
    with pytest.raises(SelectionError, match="has no"):
        select(tmp_path, {"model": tiny_state_dict(0), "layers": [tiny_state_dict(1)]}, choice)
