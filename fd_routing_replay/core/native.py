"""Build and load the package's compiled code: the Paddle-linked ops library and the Paddle-free C library.

:data:`OPS` (``fdrr_routing_ops.so``, a pybind11 module built with ``paddle.utils.cpp_extension``,
imported by :mod:`fd_routing_replay.ops.backend`) and :data:`C_LIBRARY` (``fdrr_native.so``: set
codec, checksum, unrouted count: plain C++ built with ``$CXX``, loaded here with ctypes: no Paddle).
Each lives ahead of time in ``fd_routing_replay/_ops/`` (``make ops``), else is built just
in time into ``$FD_RR_OPS_CACHE`` from ``custom_ops/`` or a wheel's ``_csrc/``; a
``<name>.json`` next to it records the digest of what determines it.  docs/ops.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fd_routing_replay.core.files import atomic_write
from fd_routing_replay.errors import OpsError

__all__ = ["CXX_FLAGS", "C_LIBRARY", "LIBRARIES", "NATIVE_ABI", "NVCC_FLAGS", "OPS", "STAMP_NAME",
           "CLibrary", "Library", "aot_dir", "build", "built_digest", "c_library", "cache_dir",
           "compile_flags", "jit_dir", "locate", "mode", "source_digest", "sources_dir"]

PACKAGE_DIR = Path(__file__).resolve().parents[1]
STAMP_NAME = ".built"  # written by custom_ops/build.py once both libraries load
CXX_FLAGS = ("-O3", "-std=c++17")
# SASS for Ampere (runs on sm_80/86/89) and Hopper, PTX for anything newer.
NVCC_FLAGS = ("-O3", "-std=c++17", "-gencode", "arch=compute_80,code=sm_80",
              "-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_90,code=compute_90")
NATIVE_ABI = 3  # fdrr_native_abi_version() of the C library this package expects
_BUILD_TIMEOUT_S = 1800
_MODES = ("auto", "compiled")


@dataclass(frozen=True)
class Library:
    """A library (``<name>.so``): sources, headers, CUDA sources (on a CUDA build), and
    whether it is a Paddle custom-op library (else plain C++)."""

    name: str
    sources: tuple[str, ...]
    headers: tuple[str, ...]
    cuda_sources: tuple[str, ...] = ()
    paddle: bool = False

    @property
    def file_name(self) -> str:
        """``<name>.so``."""
        return f"{self.name}.so"


OPS = Library("fdrr_routing_ops", ("step_ops.cc", "step_ledger.cc"),
              ("bound_args.h", "routing_kernels.h", "routing_kernels.cuh"), ("step_ops.cu",), paddle=True)
C_LIBRARY = Library("fdrr_native", ("set_codec.cc", "xxh3.cc", "unrouted.cc"), ("set_codec_tables.h",))
LIBRARIES = (OPS, C_LIBRARY)


def mode() -> str:
    """``$FD_RR_OPS``: ``auto`` (default: a library that cannot load is reported, with its
    reason, by the first call that needs it) or ``compiled`` (an error as soon as it is
    loaded); OpsError otherwise."""
    value = os.environ.get("FD_RR_OPS", "auto").strip().lower() or "auto"
    if value not in _MODES:
        raise OpsError(f"FD_RR_OPS={value!r} is not one of 'auto', 'compiled'")
    return value


def sources_dir(library: Library) -> Path | None:
    """The checkout's custom_ops/, else the wheel's _csrc/, if it holds ``library``'s sources."""
    for candidate in (PACKAGE_DIR.parent / "custom_ops", PACKAGE_DIR / "_csrc"):
        if all((candidate / name).is_file() for name in library.sources + library.headers):
            return candidate
    return None


def aot_dir() -> Path:
    """Where the ahead-of-time builds live ($FD_RR_OPS_AOT_DIR, else the package's _ops/)."""
    return Path(os.environ.get("FD_RR_OPS_AOT_DIR") or PACKAGE_DIR / "_ops")


def cache_dir() -> Path:
    """Root of the just-in-time build cache ($FD_RR_OPS_CACHE or ~/.cache/...)."""
    env = os.environ.get("FD_RR_OPS_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "fd_routing_replay" / "ops"


def jit_dir(library: Library, digest: str) -> Path:
    """The just-in-time build directory of ``library`` built from sources of ``digest``."""
    return cache_dir() / f"{library.name}-{digest[:16]}"


def compile_flags() -> tuple[str, ...]:
    """The C library's flags: ``-march=x86-64-v2`` on x86-64, never ``-march=native`` (a
    build may be shipped; the checksum picks AVX2 or AVX-512 at run time)."""
    flags = (*CXX_FLAGS, "-fPIC", "-shared")
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags += ("-march=x86-64-v2",)
    return flags


def _with_cuda(library: Library) -> bool:
    """Build ``library``'s CUDA sources too: only with a CUDA Paddle and nvcc on PATH."""
    if not library.cuda_sources:
        return False
    import paddle

    return bool(paddle.is_compiled_with_cuda()) and shutil.which("nvcc") is not None


def source_digest(library: Library, sources: Path | None = None) -> str:
    """Digest of what determines ``library``: sources, headers and flags (and for the ops
    the CUDA choice, the Paddle and Python versions)."""
    sources = sources or sources_dir(library)
    if sources is None:
        raise OpsError(f"no sources of {library.file_name} (neither custom_ops/ nor the wheel's "
                       "fd_routing_replay/_csrc/)")
    cuda = _with_cuda(library)
    names = library.sources + library.headers + (library.cuda_sources if cuda else ())
    h = hashlib.sha256()
    for name in sorted(names):
        h.update(name.encode() + b"\0" + (sources / name).read_bytes() + b"\0")
    if library.paddle:
        import paddle

        h.update(repr((paddle.__version__, sys.version_info[:2], CXX_FLAGS, NVCC_FLAGS, cuda)).encode())
    else:
        h.update(repr(compile_flags()).encode())
    return h.hexdigest()


def built_digest(directory: Path, library: Library) -> str | None:
    """The digest ``library``'s build in ``directory`` was made from, or None."""
    try:
        if (directory / library.file_name).exists():
            return json.loads((directory / f"{library.name}.json").read_text()).get("digest")
    except (OSError, ValueError, AttributeError):
        pass
    return None


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Serialise builds into ``directory`` across processes (ranks, data-loader workers)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


_PADDLE_CHILD = """
import json, sys, warnings
warnings.filterwarnings("ignore")
from paddle.utils.cpp_extension import load
load(**json.loads(sys.argv[1]))
"""


def _compile(library: Library, sources: Path, out_dir: Path, verbose: bool) -> Path:
    """Compile ``library`` into a temporary file in ``out_dir`` (RuntimeError on failure)."""
    temp = out_dir / f".{library.file_name}.tmp{os.getpid()}"
    if library.paddle:
        # cpp_extension's load registers the ops, and Paddle aborts the process that
        # registers an op twice: a child process, in a clean build directory (its own
        # up-to-date check ignores headers).
        build_dir = out_dir / "build"
        shutil.rmtree(build_dir, ignore_errors=True)
        build_dir.mkdir(parents=True)
        cuda = library.cuda_sources if _with_cuda(library) else ()
        include = f"-I{sources}"
        args = {"name": library.name, "sources": [str(sources / s) for s in library.sources + cuda],
                "extra_cxx_cflags": [*CXX_FLAGS, include], "extra_cuda_cflags": [*NVCC_FLAGS, include],
                "build_directory": str(build_dir), "verbose": verbose}
        command = [sys.executable, "-c", _PADDLE_CHILD, json.dumps(args)]
        built = build_dir / library.name / library.file_name
    else:
        cxx = next((c for c in (os.environ.get("CXX"), "g++", "c++") if c and shutil.which(c)), None)
        if cxx is None:
            raise RuntimeError("no C++ compiler (set $CXX, or install g++)")
        command = [cxx, *compile_flags(), "-o", str(temp), *(str(sources / s) for s in library.sources)]
        built = temp
    try:
        done = subprocess.run(command, stdout=None if verbose else subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=_BUILD_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        temp.unlink(missing_ok=True)
        raise RuntimeError(f"building {library.file_name} failed: {exc}") from exc
    if done.returncode != 0 or not built.exists():
        temp.unlink(missing_ok=True)
        raise RuntimeError(f"building {library.file_name} failed (exit {done.returncode}):\n"
                           f"{(done.stdout or '')[-4000:]}")
    if built != temp:
        shutil.copyfile(built, temp)
    return temp


def build(library: Library, out_dir: Path, *, force: bool = False, verbose: bool = False,
          sources: Path | None = None) -> Path:
    """Compile ``library`` into ``out_dir/<name>.so`` and return its path; a build there of
    the same digest is kept (unless ``force``).  The library, then its ``<name>.json``, are
    moved into place atomically.  RuntimeError (with the compiler's output) on failure."""
    sources = sources or sources_dir(library)
    if sources is None:
        raise RuntimeError(f"no sources of {library.file_name} to build from (neither "
                           "custom_ops/ nor the wheel's fd_routing_replay/_csrc/)")
    out_dir = Path(out_dir).resolve()
    digest = source_digest(library, sources)
    target = out_dir / library.file_name
    with _locked(out_dir):
        if not force and built_digest(out_dir, library) == digest:
            return target
        started = time.monotonic()
        os.replace(_compile(library, sources, out_dir, verbose), target)
        info = {"digest": digest, "seconds": round(time.monotonic() - started, 1)}
        if library.cuda_sources:
            info["with_cuda"] = _with_cuda(library)
        atomic_write(out_dir / f"{library.name}.json", [json.dumps(info, indent=2).encode() + b"\n"])
    return target


def locate(library: Library) -> tuple[Path | None, str]:
    """The build of ``library`` to load and why: the ahead-of-time build when current,
    else a just-in-time one (built now when missing); or None and every reason why not.
    Never raises."""
    sources = sources_dir(library)
    target = aot_dir() / library.file_name
    try:
        digest = source_digest(library, sources) if sources is not None else None
    except Exception as exc:  # unreadable sources, a broken Paddle: report, never raise
        return None, f"the sources of {library.file_name} cannot be read: {exc!r}"
    reasons = []
    if not target.exists():
        reasons.append(f"no ahead-of-time build at {target} (run `make ops`)")
    elif digest is None:
        return target, f"ahead-of-time build {target} (sources not shipped; digest not checked)"
    elif built_digest(target.parent, library) != digest:
        reasons.append(f"ahead-of-time build at {target} is stale (custom_ops/ changed; run `make ops`)")
    else:
        return target, f"ahead-of-time build {target}"
    if os.environ.get("FD_RR_OPS_JIT", "1") == "0":
        return None, "; ".join(reasons + ["JIT build disabled by FD_RR_OPS_JIT=0"])
    if digest is None:
        return None, "; ".join(reasons + [f"no sources of {library.file_name} for a JIT build"])
    try:
        built = build(library, jit_dir(library, digest), sources=sources)
    except Exception as exc:
        return None, "; ".join(reasons + [f"JIT build into {cache_dir()} failed: {exc}"])
    return built, f"JIT build {built} ({reasons[0]})"


@dataclass(frozen=True)
class CLibrary:
    """The C library of this process (``handle`` None: it did not load; the set codec and the
    unrouted count then raise naming ``reason``, the ``xxhash`` package hashes), why, and
    from which file."""

    handle: ctypes.CDLL | None
    reason: str
    path: Path | None = None


_LOCK = threading.Lock()
_C_LIBRARY: CLibrary | None = None
_FAILURE: str | None = None  # FD_RR_OPS=compiled and no library: every use raises this


def _load_c_library() -> CLibrary:
    global _FAILURE
    chosen = mode()
    path, reason = locate(C_LIBRARY)
    if path is not None:
        try:
            handle = ctypes.CDLL(str(path))
            handle.fdrr_native_abi_version.restype = ctypes.c_int64
            abi = handle.fdrr_native_abi_version()
            if abi == NATIVE_ABI:
                return CLibrary(handle, reason, path)
            reason = f"{path} has ABI {abi}, expected {NATIVE_ABI}: rebuild it (make ops)"
        except (OSError, AttributeError) as exc:
            reason = f"loading {path} failed: {exc!r}"
    if chosen == "compiled":
        _FAILURE = f"FD_RR_OPS=compiled but the compiled C library (set codec, checksum, unrouted count) cannot load: {reason}"
        raise OpsError(_FAILURE)
    warnings.warn("fd_routing_replay: the compiled C library did not load (set encoding and the writer's "
                  f"unrouted count need it; the xxhash package hashes): {reason}", RuntimeWarning, stacklevel=5)
    return CLibrary(None, reason)


def c_library() -> CLibrary:
    """The C library of this process, chosen on the first call from ``$FD_RR_OPS``: ``auto``
    loads :func:`locate`'s build, else warns once; ``compiled`` raises OpsError instead
    (on every call)."""
    global _C_LIBRARY
    with _LOCK:
        if _FAILURE is not None:
            raise OpsError(_FAILURE)
        if _C_LIBRARY is None:
            _C_LIBRARY = _load_c_library()
        return _C_LIBRARY
