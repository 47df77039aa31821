"""The oracle: every output ckptconv writes is compared with ``torch.load(weights_only=True)`` of its source.

Hypothesis builds checkpoints over everything ``torch.save`` can write: every dtype it saves (complex,
bool, unsigned, every float8), conj and neg bits, 0-dim and empty tensors, views with arbitrary offsets
and strides (stride 0, transposed, overlapping), storages shared by several tensors and by several
dtypes, tied tensors, and nested training checkpoints; in the zip and the legacy format, and as
safetensors where that format can hold them. Each is converted to ``.pt`` and to safetensors through
the CLI and the library, and loaded with :func:`ckptconv.load`. Every result is read back with torch or
the safetensors library (never with ckptconv) and compared bit for bit, conj and neg resolved, with
the source as torch loads it.

Where an output format cannot hold a tensor exactly (complex128 in safetensors), the only accepted
answer is a one-line refusal that leaves nothing behind. Anything else (other values, a traceback,
a refusal of something the format can hold) fails the test.

The example count is bounded for CI; set ``CKPTCONV_ORACLE_EXAMPLES=5000`` for a longer run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import warnings
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptconv
from ckptconv.cli import cli

from .conftest import torch_saves

EXAMPLES = int(os.environ.get("CKPTCONV_ORACLE_EXAMPLES", "0"))


def oracle_settings(ci_examples: int) -> Any:
    return settings(
        max_examples=EXAMPLES or ci_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )


# What torch.save writes through a typed storage (_rebuild_tensor_v2): the legacy format holds only these.
V2_DTYPES = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
# What it writes through an untyped storage and _rebuild_tensor_v3: views of one storage may differ in dtype.
# Only those this torch saves and reads back (torch 2.4: no uint16/32/64, float8_e8m0fnu or float4_e2m1fn_x2).
V3_DTYPES = tuple(
    getattr(torch, name)
    for name in (
        "uint16",
        "uint32",
        "uint64",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "complex32",
        "float4_e2m1fn_x2",
        "bits8",
        "bits16",
    )
    if torch_saves(name)
)
# Dtypes torch can give a neg bit (torch._neg_view) and a conj bit (Tensor.conj).
NEG_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.complex64,
        torch.complex128,
        torch.complex32,
    }
)


def _safetensors_holds(dtype: torch.dtype) -> bool:
    """Whether the safetensors library itself writes and reads ``dtype`` (not ckptconv's opinion)."""
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = os.path.join(folder, "probe.safetensors")
        try:
            safetensors.torch.save_file({"t": torch.zeros(2, dtype=dtype)}, path)
            return safetensors.torch.load_file(path)["t"].dtype == dtype
        except Exception:  # the library refuses the dtype one way or another
            return False


SAFETENSORS_DTYPES = frozenset(d for d in (*V2_DTYPES, *V3_DTYPES) if _safetensors_holds(d))


def safetensors_holds(dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """The library counts float4 in 4-bit elements: a 0-dim float4_e2m1fn_x2 (one byte, two values)
    is a tensor it refuses to write."""
    return dtype in SAFETENSORS_DTYPES and not (dtype == getattr(torch, "float4_e2m1fn_x2", None) and not shape)


# ---------------------------------------------------------------------------------------
# The strategy
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class View:
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    conj: bool
    neg: bool

    @property
    def end_byte(self) -> int:
        """One past the last byte this view touches: none for an empty view, whose offset torch
        lets lie anywhere, past its storage's end included (``torch.empty(0, 6).chunk(3, 1)``)."""
        itemsize = self.dtype.itemsize
        if math.prod(self.shape) == 0:
            return 0
        last = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        return (last + 1) * itemsize


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@st.composite
def views(draw: Any, dtype: torch.dtype) -> View:
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim)))
    layout = draw(st.sampled_from(["contiguous", "transposed", "expanded", "strided"]))
    if layout == "contiguous":
        stride = _contiguous(shape)
    elif layout == "transposed":  # a permutation of a contiguous layout (.t(), .permute())
        order = draw(st.permutations(range(ndim)))
        permuted = _contiguous(tuple(shape[i] for i in order))
        stride = tuple(permuted[order.index(i)] for i in range(ndim))
    elif layout == "expanded":  # Tensor.expand: some dimensions repeat the same elements (stride 0)
        stride = tuple(0 if draw(st.booleans()) else s for s in _contiguous(shape))
    else:  # anything: stride 0, gaps, overlapping elements
        stride = tuple(draw(st.lists(st.sampled_from([0, 1, 2, 3, 5, 7]), min_size=ndim, max_size=ndim)))
    offset = draw(st.integers(0, 6))
    conj = dtype.is_complex and draw(st.booleans())
    neg = dtype in NEG_DTYPES and draw(st.booleans())
    return View(dtype, shape, stride, offset, conj, neg)


@dataclass(frozen=True)
class StorageSpec:
    data: bytes
    views: tuple[View, ...]


@st.composite
def storages(draw: Any, *, legacy: bool) -> StorageSpec:
    """One storage and the views saved from it.

    Views of a typed (v2) storage share its dtype: torch.save refuses anything else. An untyped
    (v3) storage may be viewed with several dtypes, as torch.save allows.
    """
    if legacy or draw(st.booleans()):
        dtypes = [draw(st.sampled_from(V2_DTYPES))]
    else:
        dtypes = draw(st.lists(st.sampled_from(V3_DTYPES), min_size=1, max_size=3))
    chosen = tuple(draw(views(draw(st.sampled_from(dtypes)))) for _ in range(draw(st.integers(1, 3))))
    unit = max(d.itemsize for d in dtypes)
    needed = max(view.end_byte for view in chosen) + draw(st.integers(0, 3)) * unit
    needed = -(-needed // unit) * unit
    data = draw(st.binary(min_size=needed, max_size=needed))
    if dtypes == [torch.bool]:
        data = bytes(byte & 1 for byte in data)  # torch.save never writes other bool bytes
    return StorageSpec(data, chosen)


def build_tensor(untyped: torch.UntypedStorage, view: View) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is "experimental"
        tensor = torch.empty(0, dtype=view.dtype).set_(untyped, view.offset, view.shape, view.stride)
    if view.conj:
        tensor = tensor.conj()
    if view.neg:
        tensor = torch._neg_view(tensor)
    return tensor


class Example:
    """A checkpoint as torch.save gets it, and where its weights are.

    Not a dataclass: Hypothesis would print its fields with torch's repr, which fails for float4.
    """

    def __init__(self, obj: Any, weights_at: tuple[str, ...]) -> None:
        self.obj = obj
        self.weights_at = weights_at

    def __repr__(self) -> str:  # torch cannot print some dtypes (float4): describe the tensors instead
        def describe(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                bits = "".join(name for name, on in (("+conj", value.is_conj()), ("+neg", value.is_neg())) if on)
                return (
                    f"<{value.dtype} {tuple(value.shape)} stride {value.stride()} offset "
                    f"{value.storage_offset()} of {value.untyped_storage().nbytes()} B{bits}>"
                )
            if isinstance(value, dict):
                return {key: describe(item) for key, item in value.items()}
            if isinstance(value, (list, tuple)):
                return type(value)(describe(item) for item in value)
            return value

        return f"Example({describe(self.obj)!r}, weights_at={self.weights_at!r})"

    def weights(self, loaded: Any) -> Mapping[str, torch.Tensor]:
        for key in self.weights_at:
            loaded = loaded[key]
        return loaded


@st.composite
def examples(draw: Any, *, legacy: bool = False) -> Example:
    specs = draw(st.lists(storages(legacy=legacy), min_size=1, max_size=4))
    state: dict[str, torch.Tensor] = {}
    for index, spec in enumerate(specs):
        untyped = torch.frombuffer(bytearray(spec.data), dtype=torch.uint8).untyped_storage() if spec.data else None
        untyped = untyped if untyped is not None else torch.UntypedStorage(0)
        for number, view in enumerate(spec.views):
            tensor = build_tensor(untyped, view)
            state[f"layer{index}.w{number}"] = tensor
            if draw(st.integers(0, 5)) == 0:  # a tied weight: the same tensor under a second name
                state[f"tied{index}.w{number}"] = tensor
    layout = draw(st.sampled_from(["flat", "training", "nested"]))
    if layout == "flat":
        return Example(state, ())
    extra = draw(storages(legacy=legacy))
    untyped = torch.frombuffer(bytearray(extra.data), dtype=torch.uint8).untyped_storage() if extra.data else None
    moment = build_tensor(untyped if untyped is not None else torch.UntypedStorage(0), extra.views[0])
    optimizer = {"state": {0: {"step": 3, "exp_avg": moment}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    config = {"lr": 1e-3, "layers": [1, 2, 3], "name": "oracle", "flags": (True, None)}
    if layout == "training":
        return Example({"state_dict": state, "optimizer": optimizer, "epoch": 7, "config": config}, ("state_dict",))
    return Example(
        {"model": {"state_dict": state}, "optimizer_states": [optimizer], "args": config}, ("model", "state_dict")
    )


# ---------------------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------------------


# Dtypes torch only stores and views (no copy kernels): copied as bytes.
OPAQUE = {
    getattr(torch, "float4_e2m1fn_x2", torch.bits8): torch.uint8,  # float4 is new in torch 2.8
    torch.bits8: torch.uint8,
    torch.bits16: torch.int16,
    torch.quint4x2: torch.uint8,
    torch.quint2x4: torch.uint8,
}


def materialized(tensor: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous copy of the values torch means by ``tensor``: conj and neg applied."""
    if tensor.dtype in OPAQUE:  # the same bytes and layout as integers (a view of a quint stays quantized)
        as_ints = torch.empty(0, dtype=OPAQUE[tensor.dtype])
        as_ints.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
        return materialized(as_ints).view(tensor.dtype)
    plain = torch.empty(tensor.shape, dtype=tensor.dtype)
    plain.copy_(tensor.resolve_conj().resolve_neg())
    return plain


def resolved_bytes(tensor: torch.Tensor) -> bytes:
    """The values torch means by ``tensor``, conj and neg applied, in row-major order.

    The bits are applied here as IEEE 754 defines negation (flip the sign bit, NaNs
    included) and conjugation (negate the imaginary part), not with torch's
    ``resolve_neg``: on float16/bfloat16/complex32 NaNs that kernel quiets or
    canonicalises them, differently for the vectorised part of a tensor and its
    tail, so it has no single bit-exact answer to compare with.
    """
    conj, neg = tensor.is_conj(), tensor.is_neg()
    stored = tensor.conj() if conj else tensor  # toggling a bit back gives the stored values
    stored = torch._neg_view(stored) if neg else stored
    assert not (stored.is_conj() or stored.is_neg())
    plain = materialized(stored).reshape(-1)
    if plain.numel() == 0:
        return b""
    if neg and not (tensor.dtype.is_floating_point or tensor.dtype.is_complex):
        plain = plain.neg()  # integers: two's complement, wrapping (exact and deterministic)
    elif conj or neg:
        half = tensor.dtype.itemsize // (2 if tensor.dtype.is_complex else 1)
        words = plain.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[half])
        sign = -(1 << (8 * half - 1))
        if neg:
            words ^= sign
        if conj:
            words[1::2] ^= sign
    return plain.view(torch.uint8).numpy().tobytes()


Expected = dict[str, tuple[torch.dtype, tuple[int, ...], bytes]]


def expected_weights(source: Path, example: Example | None) -> Expected:
    loaded = (
        safetensors.torch.load_file(source)
        if source.suffix == ".safetensors"
        else torch.load(source, weights_only=True)
    )
    weights = example.weights(loaded) if example else loaded
    return {key: (t.dtype, tuple(t.shape), resolved_bytes(t)) for key, t in weights.items()}


def assert_holds(where: str, expected: Expected, actual: Mapping[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected), f"{where}: keys {sorted(actual)} != {sorted(expected)}"
    for key, (dtype, shape, data) in expected.items():
        tensor = actual[key]
        assert tensor.dtype == dtype, f"{where}: {key}: dtype {tensor.dtype} != {dtype}"
        assert tuple(tensor.shape) == shape, f"{where}: {key}: shape {tuple(tensor.shape)} != {shape}"
        assert resolved_bytes(tensor) == data, f"{where}: {key}: values differ"


def read_pt(path: Path) -> dict[str, torch.Tensor]:
    return dict(torch.load(path, weights_only=True))


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every key, ckptconv's tied-tensor aliases included, read with the safetensors library."""
    tensors = safetensors.torch.load_file(path)
    with safetensors.safe_open(path, "pt") as file:
        metadata = file.metadata() or {}
    for alias, target in json.loads(metadata.get("ckptconv.aliases", "{}")).items():
        tensors[alias] = tensors[target]
    return tensors


def representable(output: str, expected: Expected) -> bool:
    return output == "pt" or all(safetensors_holds(dtype, shape) for dtype, shape, _ in expected.values())


def assert_one_line_refusal(stderr: str) -> None:
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptconv: error: "), stderr


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="oracle-") as name:
        yield Path(name)


def check_conversions(source: Path, example: Example | None) -> None:
    """Convert ``source`` every way and hold each result against the source as torch reads it."""
    expected = expected_weights(source, example)
    folder = source.parent
    for output in ("pt", "safetensors"):
        exact = representable(output, expected)
        # Through the library.
        destination = folder / f"lib.{output}"
        try:
            ckptconv.convert(source, destination, fsync=False)
        except ckptconv.CkptconvError as error:
            assert not exact, f"library refused a {output} output it can hold: {error}"
            assert "\n" not in str(error)
            assert not destination.exists()
        else:
            assert exact, f"library wrote {output} that cannot hold every tensor exactly"
            assert_holds(
                f"library -> {output}", expected, (read_pt if output == "pt" else read_safetensors)(destination)
            )
            # ckptconv's own verify agrees, and so does the one that reads with torch / safetensors.
            for reference in ("ckptconv", "torch"):
                report = ckptconv.verify(source, destination, reference=reference)
                assert report.ok, (reference, report.summary())
        # Through the CLI.
        destination = folder / f"cli.{output}"
        result = CliRunner().invoke(cli, ["convert", str(source), str(destination), "-q", "--no-fsync"])
        if exact:
            assert result.exit_code == 0, (result.exit_code, result.stderr, result.exception)
            assert_holds(f"CLI -> {output}", expected, (read_pt if output == "pt" else read_safetensors)(destination))
        else:
            assert result.exit_code == 1, (result.exit_code, result.stderr, result.exception)
            assert_one_line_refusal(result.stderr)
            assert not destination.exists()
    assert_holds("ckptconv.load", expected, ckptconv.load(source))


def record_features(example: Example) -> None:
    """Hypothesis statistics (``--hypothesis-show-statistics``): what the examples held."""
    from hypothesis import event

    state = example.weights(example.obj)
    storages: dict[int, set[torch.dtype]] = {}
    seen: set[int] = set()
    for tensor in state.values():
        event(f"dtype {tensor.dtype}")
        features = {
            "conj bit": tensor.is_conj(),
            "neg bit": tensor.is_neg(),
            "0-dim": tensor.dim() == 0,
            "empty": tensor.numel() == 0,
            "stride 0": any(s == 0 and n > 1 for s, n in zip(tensor.stride(), tensor.shape)),
            "non-contiguous": not tensor.is_contiguous(),
            "storage offset": tensor.storage_offset() > 0,
            "tied (same tensor twice)": id(tensor) in seen,
        }
        for name, present in features.items():
            if present:
                event(name)
        seen.add(id(tensor))
        storages.setdefault(tensor.untyped_storage().data_ptr(), set()).add(tensor.dtype)
    if any(len(dtypes) > 1 for dtypes in storages.values()):
        event("one storage, several dtypes")
    event(f"layout {'/'.join(example.weights_at) or 'flat'}")


def save_example(example: Example, path: Path, *, legacy: bool) -> None:
    record_features(example)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(example.obj, path, _use_new_zipfile_serialization=not legacy)


# ---------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------


@oracle_settings(ci_examples=100)
@given(examples())
def test_oracle_torch_zip(example: Example) -> None:
    with scratch() as folder:
        source = folder / "source.pt"
        save_example(example, source, legacy=False)
        check_conversions(source, example)


# The dtypes torch.load does not swap in a big-endian file: their storage is untyped bytes.
UNSWAPPED_DTYPES = frozenset(d for d in V3_DTYPES if d.itemsize > 1)


def mark_big_endian(path: Path) -> None:
    """Rewrite a zip checkpoint's byteorder record to "big", as a big-endian machine's torch.save writes it.

    torch.load then swaps each storage's bytes by its storage class's dtype (the records keep the bytes
    this machine wrote, so the values it reads are swapped ones): that reading is the oracle, whatever
    it gives.
    """
    marked = path.with_suffix(".big")
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(marked, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            data = source.read(info)
            target.writestr(info.filename, b"big" if info.filename.endswith("/byteorder") else data)
    marked.replace(path)


@oracle_settings(ci_examples=50)
@given(examples())
def test_oracle_big_endian_zip(example: Example) -> None:
    """Big-endian files: what torch.load reads, or, where it reads a storage in the writer's byte order
    (the dtypes saved through untyped storages), a one-line refusal that leaves nothing behind."""
    with scratch() as folder:
        source = folder / "source.pt"
        save_example(example, source, legacy=False)
        mark_big_endian(source)
        unswapped = [t for t in example.weights(example.obj).values() if t.dtype in UNSWAPPED_DTYPES and t.numel()]
        if not unswapped:  # (an empty tensor has no bytes to swap)
            check_conversions(source, example)
            return
        with pytest.raises(ckptconv.UnsupportedFormatError, match="big-endian") as refusal:
            ckptconv.load(source)
        assert "\n" not in str(refusal.value)
        destination = folder / "out.pt"
        result = CliRunner().invoke(cli, ["convert", str(source), str(destination), "-q"])
        assert result.exit_code == 1, (result.exit_code, result.stderr, result.exception)
        assert_one_line_refusal(result.stderr)
        assert not destination.exists()


@oracle_settings(ci_examples=50)
@given(examples(legacy=True))
def test_oracle_torch_legacy(example: Example) -> None:
    with scratch() as folder:
        source = folder / "source.pt"
        save_example(example, source, legacy=True)
        check_conversions(source, example)


@oracle_settings(ci_examples=50)
@given(examples())
def test_oracle_safetensors_source(example: Example) -> None:
    """Sources written by the safetensors library, from the same tensors where it can hold them."""
    state = example.weights(example.obj)
    plain = {key: materialized(t) for key, t in state.items() if safetensors_holds(t.dtype, tuple(t.shape))}
    if not plain:
        return
    with scratch() as folder:
        source = folder / "source.safetensors"
        safetensors.torch.save_file(plain, source)
        check_conversions(source, None)


# ---------------------------------------------------------------------------------------
# The cases, one by one (each also lies inside the strategy above)
# ---------------------------------------------------------------------------------------


def test_conj_and_neg_bits_are_resolved(tmp_path: Path) -> None:
    c = torch.tensor([1 + 2j, 3 - 4j])
    source = tmp_path / "cn.pt"
    torch.save({"c": c.conj(), "n": c.clone().conj().imag}, source)
    check_conversions(source, Example(None, ()))


def test_empty_non_contiguous_tensor(tmp_path: Path) -> None:
    source = tmp_path / "e.pt"
    torch.save({"e": torch.empty(3, 0, 2).transpose(0, 2), "x": torch.ones(2)}, source)
    check_conversions(source, Example(None, ()))
    for command in (["verify", str(source), str(tmp_path / "lib.pt")], ["diff", str(source), str(tmp_path / "lib.pt")]):
        result = CliRunner().invoke(cli, command)
        assert result.exit_code == 0, (result.stderr, result.exception)


@pytest.mark.parametrize("legacy", [False, True])
def test_empty_tensors_whose_offset_lies_past_their_storage(tmp_path: Path, legacy: bool) -> None:
    """torch bounds-checks no view of zero elements: chunks of an empty matrix sit past its 0-byte storage."""
    source = tmp_path / "chunks.pt"
    chunks = dict(zip(("q", "k", "v"), torch.empty(0, 6).chunk(3, dim=1)))
    tail = torch.arange(4.0).as_strided((0, 3), (1, 1), 10)
    torch.save({**chunks, "tail": tail, "x": torch.ones(2)}, source, _use_new_zipfile_serialization=not legacy)
    check_conversions(source, Example(None, ()))


@pytest.mark.parametrize("legacy", [False, True])
def test_packed_quantized_dtypes(tmp_path: Path, legacy: bool) -> None:
    """quint4x2 and quint2x4 (sub-byte integers packed two or four to a byte, saved through
    QUInt4x2Storage / QUInt2x4Storage) were refused as "a damaged zip checkpoint"."""
    packed = torch.arange(200, 208, dtype=torch.uint8)
    state = {"q4": packed.view(torch.quint4x2), "q2": packed.clone().view(torch.quint2x4)[2:6], "x": torch.ones(2)}
    source = tmp_path / "packed.pt"
    torch.save(state, source, _use_new_zipfile_serialization=not legacy)
    expected = expected_weights(source, None)
    output = tmp_path / "out.pt"
    result = CliRunner().invoke(cli, ["convert", str(source), str(output), "-q"])
    assert result.exit_code == 0, (result.stderr, result.exception)
    assert_holds("CLI -> pt", expected, read_pt(output))
    assert_holds("ckptconv.load", expected, ckptconv.load(source))
    result = CliRunner().invoke(cli, ["convert", str(source), str(tmp_path / "out.safetensors")])
    assert result.exit_code == 1 and "is quint4x2, which safetensors cannot store" in result.stderr
    assert_one_line_refusal(result.stderr)
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("legacy", [False, True])
def test_tied_tensors_conj_and_plain_views_of_one_storage(tmp_path: Path, legacy: bool) -> None:
    c = torch.tensor([1 + 2j, 3 - 4j, -5 + 0.5j], dtype=torch.complex128)
    source = tmp_path / "tied.pt"
    torch.save(
        {"c": c, "cc": c.conj(), "tail": c[1:], "neg": torch._neg_view(c[:2])},
        source,
        _use_new_zipfile_serialization=not legacy,
    )
    check_conversions(source, Example(None, ()))
