"""The GPU CRC-32 kernel's arithmetic (ckptconv.gpu.crc), checked against zlib on the CPU.

The kernel cuts each record into chunks (:func:`ckptconv.gpu.crc.plan`), takes each chunk's CRC
register, moves it to the record's end with the ``x^(2^k)`` table written into the CUDA source, and
XORs the results. Here the same steps run in Python, with each chunk's register from zlib and the
table parsed out of the source the GPU compiles, and the result must be zlib's CRC-32 of the whole
record. The kernel itself is compared with zlib in tests/test_transfer.py where CUDA is available.
"""

from __future__ import annotations

import re
import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptconv.gpu import crc as _gpu_crc
from ckptconv.reading.checksums import _multmodp as multmodp

MASK = 0xFFFFFFFF


def source_table() -> list[int]:
    found = re.search(r"X2N\[32\] = \{([^}]*)\}", _gpu_crc.source())
    assert found is not None
    return [int(value.strip().rstrip("u"), 16) for value in found.group(1).split(",")]


def x8nmodp(n: int, table: list[int]) -> int:  # the kernel's x8nmodp, line for line
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            p = multmodp(table[k & 31], p)
        n >>= 1
        k += 1
    return p


def emulate(records: list[bytes], chunk: int) -> list[int]:
    """What the kernel computes, one GPU thread per chunk, each chunk's register from zlib."""
    table = source_table()
    firsts, total = _gpu_crc.plan([len(r) for r in records], chunk)
    out = [0] * len(records)
    for g in range(total):
        index = max(i for i, first in enumerate(firsts) if first <= g)  # the kernel's binary search
        data = records[index]
        k = g - firsts[index]
        start, stop = k * chunk, min(k * chunk + chunk, len(data))
        begin = MASK if k == 0 else 0
        register = ~zlib.crc32(data[start:stop], ~begin & MASK) & MASK
        if stop < len(data) and register:
            register = multmodp(x8nmodp(len(data) - stop, table), register)
        out[index] ^= register
    return [~register & MASK for register in out]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=6),
    st.sampled_from([16, 32, 48, 4096]),
)
def test_chunked_crcs_equal_zlib(records: list[bytes], chunk: int) -> None:
    assert emulate(records, chunk) == [zlib.crc32(record) for record in records]


def test_long_records_equal_zlib() -> None:
    data = bytes(range(256)) * 5000 + b"tail"
    assert emulate([data, data[:77]], 16384) == [zlib.crc32(data), zlib.crc32(data[:77])]


def test_shifts_past_the_tables_end() -> None:
    """Records of 256 MiB and more shift by x^(2^k) with k past 31 (the table wraps, as zlib's
    does): the result equals x^(8n) by plain square-and-multiply from x^1, without the table."""
    table = source_table()

    def power(n: int) -> int:
        result, base = 1 << 31, 1 << 30  # x^0, x^1
        exponent = 8 * n
        while exponent:
            if exponent & 1:
                result = multmodp(base, result)
            base = multmodp(base, base)
            exponent >>= 1
        return result

    for n in (1, 3, 16384, (1 << 28) + 7, (1 << 31) + 3, (1 << 33) + 5, 10**12 + 9):
        assert x8nmodp(n, table) == power(n), n


def test_plan_counts_chunks_per_record() -> None:
    assert _gpu_crc.plan([1, 16, 17, 0, 48], 16) == ([0, 1, 2, 4, 4], 7)
