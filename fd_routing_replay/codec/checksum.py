"""The rr-v1 checksum: XXH3-64 (seed 0) from the C library, else the ``xxhash`` package.

custom_ops/xxh3.cc, compiled into the Paddle-free C library of
:mod:`fd_routing_replay.core.native`, hashes long inputs with an AVX-512, AVX2 or scalar
kernel chosen once per process from what the CPU supports (:func:`checksum_backend` says
which), ~1.8x as fast as the ``xxhash`` package's SSE2 build on a 15 MB payload, with the
GIL released.  Inputs below :data:`NATIVE_BYTES` (headers, token ids, small records) go to
the ``xxhash`` package's C extension instead: its call costs ~0.04 µs against ~1.6 µs for a
ctypes call (tens of µs with cold caches), more than the faster kernel saves at that size.
Where the library is not built or loaded (no compiler,
``FD_RR_OPS_JIT=0`` without a build), the package hashes everything.  Both give the same
values (tests/test_checksum.py, every length class).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from typing import Any

import numpy as np
import xxhash

from fd_routing_replay.core.native import c_library

__all__ = ["KERNELS", "NATIVE_BYTES", "checksum_backend", "xxh3_64", "xxh3_64_kernel"]

KERNELS = ("scalar", "avx2", "avx512")
"""The C library's stripe kernels, by the number ``fdrr_xxh3_kernel()`` returns."""
NATIVE_BYTES = 1 << 20
"""Inputs of at least this many bytes are hashed by the C library, with the GIL released."""


class _Native:
    """The library's XXH3 entry points, declared."""

    def __init__(self, handle: ctypes.CDLL) -> None:
        self.hash = handle["fdrr_xxh3_64"]
        self.hash.restype = ctypes.c_uint64
        self.hash.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        self.with_kernel = handle["fdrr_xxh3_64_with"]
        self.with_kernel.restype = ctypes.c_int64
        self.with_kernel.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.POINTER(ctypes.c_uint64)]
        kernel = handle["fdrr_xxh3_kernel"]
        kernel.restype = ctypes.c_int64
        self.kernel = KERNELS[kernel()]


@lru_cache(maxsize=1)
def _native() -> _Native | None:
    """The declared library, or None (the package hashes); OpsError is not cached."""
    loaded = c_library()
    return None if loaded.handle is None else _Native(loaded.handle)


def xxh3_64(data: Any) -> int:
    """XXH3-64 (seed 0) of the bytes of ``data`` (bytes, or any C-contiguous buffer:
    memoryview, bytearray, numpy array), as ``xxhash.xxh3_64_intdigest`` computes it."""
    if memoryview(data).nbytes < NATIVE_BYTES or (native := _native()) is None:
        return xxhash.xxh3_64_intdigest(data)
    array = np.frombuffer(data, dtype=np.uint8)
    return native.hash(array.ctypes.data, array.size)


def xxh3_64_kernel(data: Any, kernel: str) -> int | None:
    """XXH3-64 of ``data`` with the C library's ``kernel`` (one of :data:`KERNELS`), or None
    when this CPU or process lacks it (for the tests: every kernel gives the same value)."""
    native = _native()
    if native is None:
        return None
    array = np.frombuffer(data, dtype=np.uint8)
    out = ctypes.c_uint64()
    status = native.with_kernel(array.ctypes.data, array.size, KERNELS.index(kernel), ctypes.byref(out))
    return out.value if status == 0 else None


def checksum_backend() -> str:
    """What hashes inputs of :data:`NATIVE_BYTES` and more: ``"native avx512"``,
    ``"native avx2"``, ``"native scalar"`` (the C library's kernel) or ``"xxhash"``."""
    native = _native()
    return "xxhash" if native is None else f"native {native.kernel}"
