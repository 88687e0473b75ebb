"""The compiled set codec, loaded with ctypes (no Paddle: trainers read records without it).

Which implementation the set encoding uses in this process is chosen once, on first use,
from ``$FD_RR_OPS`` as for the routing ops (:mod:`fd_routing_replay.ops.backend`):

* ``auto`` (default): the ahead-of-time library (``fd_routing_replay/_ops/``, current
  sources), else a just-in-time build into the cache, else the NumPy reference
  (:mod:`fd_routing_replay.codec.set_numpy`) with one RuntimeWarning saying why;
* ``compiled``: the library or an OpsError (``make test`` runs so: no silent fallback);
* ``reference``: the NumPy reference.

``FD_RR_OPS_JIT=0`` disables the just-in-time build.  Calls release the GIL (ctypes), and
the per-(E, k) tables are built once, immutable and shared by threads.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
import weakref
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from fd_routing_replay.codec.set_build import (
    LIBRARY_NAME,
    aot_dir,
    build_library,
    built_digest,
    jit_dir,
    source_digest,
    sources_dir,
)
from fd_routing_replay.errors import OpsError

__all__ = ["ABI_VERSION", "NativeCodec", "SetCodecChoice", "native_codec", "set_codec_choice"]

ABI_VERSION = 1
_MODES = ("auto", "compiled", "reference")


@dataclass(frozen=True)
class SetCodecChoice:
    """The set codec of this process: ``name`` ``"native"`` or ``"numpy"``, and why."""

    name: str
    reason: str
    library: Path | None = None


class _Tables:
    """The library's tables for one (E, k), freed with this object."""

    def __init__(self, lib: ctypes.CDLL, num_experts: int, top_k: int) -> None:
        self.handle = lib.fdrr_set_context_new(num_experts, top_k)
        if not self.handle:
            raise OpsError(f"the compiled set codec refuses C({num_experts}, {top_k})")
        self.bits = int(lib.fdrr_set_context_bits(self.handle))
        weakref.finalize(self, lib.fdrr_set_context_free, self.handle)


class NativeCodec:
    """The loaded library: encode and decode rows, each returning the first bad row or -1."""

    def __init__(self, lib: ctypes.CDLL, library: Path) -> None:
        self.lib = lib
        self.library = library
        self._tables = lru_cache(maxsize=16)(lambda e, k: _Tables(lib, e, k))

    def tables(self, num_experts: int, top_k: int) -> _Tables:
        """The (cached) tables for C(num_experts, top_k)."""
        return self._tables(num_experts, top_k)

    def encode(self, ids: np.ndarray, num_experts: int, fill_value: int, out: np.ndarray) -> int:
        """Encode ``ids`` ([L, T, K], C-contiguous uint8/16/32) into ``out`` (uint8 of the
        payload's size): -1, or the first row that is neither a set nor padding."""
        tables = self.tables(num_experts, int(ids.shape[2]))
        rows = int(ids.shape[0]) * int(ids.shape[1])
        result = self.lib.fdrr_set_encode(tables.handle, ids.ctypes.data, ids.itemsize, rows,
                                          fill_value, out.ctypes.data, out.size)
        return self._checked(result, "encode")

    def decode(self, stream: np.ndarray, num_experts: int, fill_value: int,
               out: np.ndarray) -> int:
        """Decode ``stream`` (uint8 of the payload's size) into ``out`` ([rows, K],
        C-contiguous): -1, or the first row whose rank is above C(E, K)."""
        tables = self.tables(num_experts, int(out.shape[1]))
        result = self.lib.fdrr_set_decode(tables.handle, stream.ctypes.data, stream.size,
                                          int(out.shape[0]), out.ctypes.data, out.itemsize,
                                          fill_value)
        return self._checked(result, "decode")

    @staticmethod
    def _checked(result: int, what: str) -> int:
        if result < -1:
            raise OpsError(f"the compiled set codec refused the arguments of {what} ({result})")
        return result


def _open(library: Path) -> NativeCodec:
    """Load ``library`` and declare its entry points (OSError/AttributeError/OpsError)."""
    lib = ctypes.CDLL(str(library))
    lib.fdrr_set_abi_version.restype = ctypes.c_int64
    if lib.fdrr_set_abi_version() != ABI_VERSION:
        raise OpsError(f"{library} has ABI {lib.fdrr_set_abi_version()}, expected {ABI_VERSION}")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.fdrr_set_context_new.restype = ptr
    lib.fdrr_set_context_new.argtypes = [i64, i64]
    lib.fdrr_set_context_free.restype = None
    lib.fdrr_set_context_free.argtypes = [ptr]
    lib.fdrr_set_context_bits.restype = i64
    lib.fdrr_set_context_bits.argtypes = [ptr]
    lib.fdrr_set_encode.restype = i64
    lib.fdrr_set_encode.argtypes = [ptr, ptr, i64, i64, ctypes.c_uint64, ptr, i64]
    lib.fdrr_set_decode.restype = i64
    lib.fdrr_set_decode.argtypes = [ptr, ptr, i64, i64, ptr, i64, ctypes.c_uint64]
    return NativeCodec(lib, library)


def _load() -> tuple[NativeCodec | None, str]:
    """The library (ahead of time, else just in time) and why, or None and why not."""
    sources = sources_dir()
    digest = source_digest(sources) if sources is not None else None
    reasons = []
    target = aot_dir() / LIBRARY_NAME
    if not target.exists():
        reasons.append(f"no ahead-of-time build at {target} (run `make ops`)")
    elif digest is not None and built_digest(target) != digest:
        reasons.append(f"ahead-of-time build at {target} is stale (custom_ops/{LIBRARY_NAME} "
                       "sources changed; run `make ops`)")
    else:
        try:
            note = "" if digest is not None else " (sources not shipped; digest not checked)"
            return _open(target), f"ahead-of-time build {target}{note}"
        except (OSError, AttributeError, OpsError) as exc:
            reasons.append(f"loading {target} failed: {exc!r}")
    if os.environ.get("FD_RR_OPS_JIT", "1") == "0":
        return None, "; ".join(reasons + ["JIT build disabled by FD_RR_OPS_JIT=0"])
    if digest is None:
        return None, "; ".join(reasons + ["no set_codec.cc sources for a JIT build"])
    try:
        library = build_library(jit_dir(digest), sources=sources)
        return _open(library), f"JIT build {library} ({reasons[0]})"
    except (RuntimeError, OSError, AttributeError, OpsError) as exc:
        return None, "; ".join(reasons + [f"JIT build failed: {exc}"])


_LOCK = threading.Lock()
_CHOICE: SetCodecChoice | None = None
_NATIVE: NativeCodec | None = None
_FAILURE: str | None = None  # FD_RR_OPS=compiled and no library: every use raises this


def _choose() -> None:
    global _CHOICE, _NATIVE, _FAILURE
    mode = os.environ.get("FD_RR_OPS", "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise OpsError(f"FD_RR_OPS={mode!r} is not one of 'auto', 'compiled', 'reference'")
    if mode == "reference":
        _CHOICE = SetCodecChoice("numpy", "forced by FD_RR_OPS=reference")
        return
    native, reason = _load()
    if native is not None:
        _NATIVE, _CHOICE = native, SetCodecChoice("native", reason, native.library)
        return
    if mode == "compiled":
        _FAILURE = f"FD_RR_OPS=compiled but the compiled set codec cannot load: {reason}"
        raise OpsError(_FAILURE)
    _CHOICE = SetCodecChoice("numpy", reason)
    warnings.warn("fd_routing_replay: using the NumPy set codec (slower) instead of the "
                  f"compiled one: {reason}", RuntimeWarning, stacklevel=4)


def set_codec_choice() -> SetCodecChoice:
    """Which set codec this process uses, and why (chosen on the first call)."""
    with _LOCK:
        if _FAILURE is not None:
            raise OpsError(_FAILURE)
        if _CHOICE is None:
            _choose()
        assert _CHOICE is not None
        return _CHOICE


def native_codec() -> NativeCodec | None:
    """The compiled codec, or None when this process uses the NumPy reference."""
    set_codec_choice()
    return _NATIVE
