"""CRC-32 of zip records on the GPU, taken from the bytes once they are there.

Why: a ``.pt`` load to a GPU checks every record's CRC-32. Taken on the host,
each of the reader threads spends 42-55 ms of an 8 GiB load checksumming its
pinned buffers (bench/results/bench_gpu_load_h200.md, round 4), so ``.pt``
loaded at 0.77-0.83x of safetensors' speed. On the GPU the same 8 GiB take a
few milliseconds, and the bytes checked are the ones the caller gets.

How: one kernel, compiled at run time with NVRTC (the library every CUDA build
of PyTorch ships; no compiler needed) on a thread of its own while the readers
read. Each GPU thread takes the CRC register of one :data:`CHUNK` of a record
(slice-by-4 tables in shared memory), moves it to the record's end by
multiplying with ``x^(8 * bytes after the chunk)`` modulo the polynomial (the
arithmetic of zlib's ``crc32_combine``), and XORs it into the record's result;
the register of a record's first chunk starts at ``0xFFFFFFFF``, so the sum is
the record's final register (its CRC-32 inverted). :func:`plan` lays the records
out for the kernel; it is pure Python, and the tests check it (with the same
arithmetic done by zlib) on machines without a GPU.

Where the kernel cannot be made (no NVRTC, an architecture it does not know,
another vendor's GPU) :func:`kernel` returns None and the caller takes the
CRC-32s on the host as before. This module imports torch only when it runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib.util
import os
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ckptconv.reading.checksums import x2n_table

if TYPE_CHECKING:
    import torch

__all__ = ["CHUNK", "Kernel", "kernel", "plan", "record_crcs"]

#: Bytes of a record each GPU thread checksums: 8 GiB make 512 Ki threads, two waves of an H200.
CHUNK = 16 << 10

_BLOCK = 256

_SOURCE = r"""
#define POLY 0xEDB88320u
__constant__ unsigned int X2N[32] = {%(x2n)s};

__device__ __forceinline__ unsigned int multmodp(unsigned int a, unsigned int b) {
    unsigned int m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

__device__ unsigned int x8nmodp(unsigned long long n) {
    unsigned int p = 1u << 31;
    unsigned int k = 3;
    while (n) {
        if (n & 1) p = multmodp(X2N[k & 31], p);
        n >>= 1;
        k++;
    }
    return p;
}

// table: for each record (address, length, first chunk), then the number of chunks.
// out: one register per record, zero before the launch; the CRC-32 is its complement.
extern "C" __global__ void ckptconv_crc32(const unsigned long long* table, int records,
                                          unsigned int chunk, unsigned int* out) {
    __shared__ unsigned int T[4][256];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        unsigned int c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        T[0][i] = c;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        unsigned int c = T[0][i];
        c = (c >> 8) ^ T[0][c & 0xff]; T[1][i] = c;
        c = (c >> 8) ^ T[0][c & 0xff]; T[2][i] = c;
        c = (c >> 8) ^ T[0][c & 0xff]; T[3][i] = c;
    }
    __syncthreads();
    unsigned long long g = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= table[3 * (unsigned long long)records]) return;
    int lo = 0, hi = records - 1;  // the last record whose first chunk is at or before g
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (table[3 * mid + 2] <= g) lo = mid; else hi = mid - 1;
    }
    const unsigned char* base = (const unsigned char*)table[3 * lo];
    unsigned long long length = table[3 * lo + 1];
    unsigned long long k = g - table[3 * lo + 2];
    unsigned long long start = k * chunk;
    unsigned long long stop = start + chunk < length ? start + chunk : length;
    const unsigned char* p = base + start;
    const unsigned char* end = base + stop;
    unsigned int c = k == 0 ? 0xFFFFFFFFu : 0u;
    while (p < end && ((unsigned long long)p & 15)) c = (c >> 8) ^ T[0][(c ^ *p++) & 0xff];
    for (; p + 16 <= end; p += 16) {
        uint4 v = *(const uint4*)p;
        c ^= v.x; c = T[3][c & 0xff] ^ T[2][(c >> 8) & 0xff] ^ T[1][(c >> 16) & 0xff] ^ T[0][c >> 24];
        c ^= v.y; c = T[3][c & 0xff] ^ T[2][(c >> 8) & 0xff] ^ T[1][(c >> 16) & 0xff] ^ T[0][c >> 24];
        c ^= v.z; c = T[3][c & 0xff] ^ T[2][(c >> 8) & 0xff] ^ T[1][(c >> 16) & 0xff] ^ T[0][c >> 24];
        c ^= v.w; c = T[3][c & 0xff] ^ T[2][(c >> 8) & 0xff] ^ T[1][(c >> 16) & 0xff] ^ T[0][c >> 24];
    }
    while (p < end) c = (c >> 8) ^ T[0][(c ^ *p++) & 0xff];
    if (stop < length && c) c = multmodp(x8nmodp(length - stop), c);
    atomicXor(out + lo, c);
}
"""


def source() -> str:
    """The kernel's CUDA source, with zlib's ``x^(2^k)`` table (:func:`ckptconv.reading.checksums.x2n_table`) in it."""
    return _SOURCE % {"x2n": ", ".join(f"0x{value:08x}u" for value in x2n_table())}


def plan(lengths: Sequence[int], chunk: int = CHUNK) -> tuple[list[int], int]:
    """Each record's first chunk (records of ``lengths`` bytes cut in ``chunk``-byte chunks), and the total."""
    firsts = []
    total = 0
    for length in lengths:
        firsts.append(total)
        total += -(-length // chunk)
    return firsts, total


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUDA error {result}")


class Kernel:
    """The compiled kernel, loaded into one device's primary context (the one PyTorch uses)."""

    def __init__(self, device: int) -> None:
        import torch

        self.device = device
        major, minor = torch.cuda.get_device_capability(device)
        binary = _compile(source(), f"sm_{major}{minor}")
        libcuda = ctypes.CDLL("libcuda.so.1")
        libcuda.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        self.libcuda = libcuda
        handle = ctypes.c_int()
        _check(libcuda.cuDeviceGet(ctypes.byref(handle), device), "cuDeviceGet")
        self.context = ctypes.c_void_p()
        _check(libcuda.cuDevicePrimaryCtxRetain(ctypes.byref(self.context), handle), "cuDevicePrimaryCtxRetain")
        self.module = ctypes.c_void_p()
        self.function = ctypes.c_void_p()
        with self._current():
            _check(libcuda.cuModuleLoadData(ctypes.byref(self.module), binary), "cuModuleLoadData")
            _check(
                libcuda.cuModuleGetFunction(ctypes.byref(self.function), self.module, b"ckptconv_crc32"),
                "cuModuleGetFunction",
            )

    @contextlib.contextmanager
    def _current(self) -> Iterator[None]:
        """The device's context current on this thread, whatever was before (driver calls use it)."""
        _check(self.libcuda.cuCtxPushCurrent_v2(self.context), "cuCtxPushCurrent")
        try:
            yield
        finally:
            self.libcuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def launch(self, table: torch.Tensor, records: int, total: int, out: torch.Tensor, stream: int) -> None:
        """Queue the kernel on ``stream`` (a CUDA stream handle); ``table`` and ``out`` on the device."""
        values = (
            ctypes.c_uint64(table.data_ptr()),
            ctypes.c_int(records),
            ctypes.c_uint(CHUNK),
            ctypes.c_uint64(out.data_ptr()),
        )
        arguments = (ctypes.c_void_p * len(values))(*(ctypes.addressof(value) for value in values))
        blocks = -(-total // _BLOCK)
        with self._current():
            _check(
                self.libcuda.cuLaunchKernel(
                    self.function, blocks, 1, 1, _BLOCK, 1, 1, 0, stream, ctypes.addressof(arguments), None
                ),
                "cuLaunchKernel",
            )


def _nvrtc() -> Any:
    """The NVRTC library of PyTorch's CUDA version (PyTorch's CUDA wheels ship it)."""
    import torch

    major = str(torch.version.cuda or "").split(".")[0]
    names = [f"libnvrtc.so.{major}", "libnvrtc.so"]
    spec = importlib.util.find_spec("nvidia")  # the nvidia-cuda-nvrtc wheel, if PyTorch has not loaded it
    for folder in (spec.submodule_search_locations or []) if spec else []:
        names += sorted(glob.glob(os.path.join(folder, "*", "lib", f"libnvrtc.so.{major}*")))
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("no NVRTC library found")


def _compile(text: str, arch: str) -> bytes:
    """``text`` compiled by NVRTC for ``arch`` (``sm_90``): the CUBIN."""
    lib = _nvrtc()
    program = ctypes.c_void_p()
    _check(lib.nvrtcCreateProgram(ctypes.byref(program), text.encode(), b"crc32.cu", 0, None, None), "NVRTC")
    try:
        options = (ctypes.c_char_p * 1)(f"--gpu-architecture={arch}".encode())
        result = lib.nvrtcCompileProgram(program, 1, options)  # ctypes releases the GIL meanwhile
        if result != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(program, log)
            raise RuntimeError(f"NVRTC could not compile the CRC-32 kernel: {log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _check(lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        binary = ctypes.create_string_buffer(size.value)
        _check(lib.nvrtcGetCUBIN(program, binary), "nvrtcGetCUBIN")
        return binary.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


_LOCK = threading.Lock()
_KERNELS: dict[int, Kernel | None] = {}

#: Why the kernel could not be made, by device (for ``CKPTCONV_DEBUG`` and the benchmarks).
failures: dict[int, str] = {}


def kernel(device: int) -> Kernel | None:
    """The kernel on CUDA device ``device``, compiled once per process; None where it cannot be made."""
    with _LOCK:
        if device not in _KERNELS:
            try:
                _KERNELS[device] = Kernel(device)
            except (OSError, RuntimeError, AttributeError) as error:
                _KERNELS[device] = None
                failures[device] = f"{type(error).__name__}: {error}"
        return _KERNELS[device]


def known_unavailable(device: int) -> bool:
    """True when the kernel cannot be had on ``device``: PyTorch is not built for CUDA (ROCm), or
    the kernel was tried there and could not be made."""
    import torch

    if not torch.version.cuda or getattr(torch.version, "hip", None):
        return True
    return device in _KERNELS and _KERNELS[device] is None


def record_crcs(outs: Sequence[torch.Tensor], kernel_: Kernel) -> list[int]:
    """The CRC-32 of each of ``outs`` (uint8 tensors on the kernel's device, each one whole record).

    Runs on the device's current stream, after whatever was queued on it, and waits for the result.
    """
    import numpy as np
    import torch

    device = torch.device("cuda", kernel_.device)
    lengths = [int(out.numel()) for out in outs]
    firsts, total = plan(lengths)
    if total == 0:
        return [0] * len(outs)
    table = np.empty(3 * len(outs) + 1, dtype=np.uint64)
    table[0:-1:3] = [out.data_ptr() for out in outs]
    table[1:-1:3] = lengths
    table[2:-1:3] = firsts
    table[-1] = total
    on_device = torch.from_numpy(table.view(np.int64)).to(device)
    result = torch.zeros(len(outs), dtype=torch.int32, device=device)
    kernel_.launch(on_device, len(outs), total, result, torch.cuda.current_stream(device).cuda_stream)
    registers = result.cpu().numpy().view(np.uint32)
    return [int(~int(register) & 0xFFFFFFFF) if length else 0 for register, length in zip(registers, lengths)]
