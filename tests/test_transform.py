"""Transforms: pure, whole-component prefixes, no silent merges, float-only casts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptconv.dtypes import dtype_by_name
from ckptconv.errors import KeyCollisionError, TransformError
from ckptconv.reading.sources import InMemory
from ckptconv.transforms.keys import AddPrefix, Cast, Drop, Keep, Pipeline, Rename, StripPrefix
from ckptconv.values.tensor import Storage, TensorRef


def ref(dtype: str = "float32") -> TensorRef:
    kind = dtype_by_name(dtype)
    assert kind is not None
    return TensorRef(Storage(kind.itemsize, InMemory(bytes(kind.itemsize))), kind, (1,), (1,))


def state(*keys: str) -> dict[str, TensorRef]:
    return {key: ref() for key in keys}


def test_strip_prefix_takes_whole_components_only() -> None:
    original = state("module.conv.weight", "modules.0.weight", "module_list.0.bias", "module", "backbone.module.x")
    result, report = StripPrefix("module").apply(original)
    assert list(result) == ["conv.weight", "modules.0.weight", "module_list.0.bias", "module", "backbone.module.x"]
    assert (report.changed, report.unchanged) == (1, 4)
    assert next(iter(original)) == "module.conv.weight"  # the input is not mutated


def test_strip_prefix_with_several_components_and_trailing_dot() -> None:
    result, _ = StripPrefix("model.backbone.").apply(state("model.backbone.a", "model.head.b"))
    assert list(result) == ["a", "model.head.b"]


def test_add_prefix() -> None:
    result, report = AddPrefix("module").apply(state("a", "b.c"))
    assert list(result) == ["module.a", "module.b.c"]
    assert report.changed == 2


def test_strip_that_would_merge_two_keys_names_both() -> None:
    with pytest.raises(KeyCollisionError) as raised:
        StripPrefix("module").apply(state("module.w", "w"))
    assert raised.value.keys == ("module.w", "w")
    assert raised.value.new_key == "w"


def test_rename_keep_drop() -> None:
    original = state("backbone.layer1.w", "backbone.layer2.w", "head.w", "head.num_batches_tracked")
    result, _ = Pipeline.of(
        [Rename(r"^backbone\.", "encoder."), Drop(r"num_batches_tracked$"), Keep(r"^(encoder|head)\.")]
    ).apply(original)
    assert list(result) == ["encoder.layer1.w", "encoder.layer2.w", "head.w"]
    with pytest.raises(KeyCollisionError):
        Rename(r"layer\d", "layer").apply(original)
    with pytest.raises(TransformError):
        Keep("((").apply(original)


def test_cast_touches_floating_point_only() -> None:
    original = {
        "w": ref("float32"),
        "h": ref("float16"),
        "num_batches_tracked": ref("int64"),
        "position_ids": ref("int32"),
        "mask": ref("bool"),
        "c": ref("complex64"),
        "norm.weight": ref("float32"),
    }
    result, report = Cast("bf16", keep=("norm",)).apply(original)
    assert {k: v.out_dtype.name for k, v in result.items()} == {
        "w": "bfloat16",
        "h": "bfloat16",
        "num_batches_tracked": "int64",
        "position_ids": "int32",
        "mask": "bool",
        "c": "complex64",
        "norm.weight": "float32",
    }
    assert report.changed == 2
    back, _ = Cast("fp32").apply(result)
    assert back["w"].cast_to is None  # casting back to the stored dtype cancels the cast


def test_pipeline_describes_itself() -> None:
    pipeline = Pipeline.of([StripPrefix("module"), Rename("a", "b"), Cast("fp16", keep=("norm",))])
    assert pipeline.describe() == [
        "strip prefix 'module.'",
        "rename 'a' -> 'b'",
        "cast floating-point tensors to float16 except keys matching 'norm'",
    ]


components = st.text(alphabet="abcmodule_0123456789", min_size=1, max_size=8)
keys = st.lists(components, min_size=1, max_size=4).map(".".join)
prefixes = st.sampled_from(["module", "_orig_mod", "model.backbone", "module.module"])


@settings(max_examples=200, deadline=None)
@given(st.lists(keys, min_size=1, max_size=20, unique=True), prefixes)
def test_strip_undoes_add(key_list: list[str], prefix: str) -> None:
    original = state(*key_list)
    added, _ = AddPrefix(prefix).apply(original)
    stripped, report = StripPrefix(prefix).apply(added)
    assert list(stripped) == key_list
    assert report.unchanged == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(keys, min_size=1, max_size=20, unique=True), prefixes)
def test_rules_never_merge_keys_silently(key_list: list[str], prefix: str) -> None:
    for step in (StripPrefix(prefix), Rename(r"\d", "0"), Rename(r"^[a-z]+\.", "")):
        try:
            result, _ = step.apply(state(*key_list))
        except KeyCollisionError:
            continue
        assert len(result) == len(key_list)


def test_keep_with_several_patterns_keeps_a_key_any_of_them_matches() -> None:
    """Repeated --keep options were applied one after another, so `--keep encoder --keep decoder` kept
    nothing; like --keep-dtype (and --include in other tools), they now keep a key any of them matches."""
    original = state("encoder.w", "decoder.w", "head.w", "extra")
    result, report = Keep((r"^encoder\.", r"^decoder\.")).apply(original)
    assert list(result) == ["encoder.w", "decoder.w"]
    assert (report.changed, report.dropped, report.unchanged) == (0, 2, 2)  # dropped keys are not "changed"
    assert Keep((r"^encoder\.", "^head")).describe() == r"keep keys matching '^encoder\\.' or '^head'"
    _, report = Rename("^head", "out").apply(original)
    assert (report.changed, report.dropped, report.unchanged) == (1, 0, 3)
    _, report = Drop("^e").apply(original)
    assert (report.changed, report.dropped, report.unchanged) == (0, 2, 2)
