"""Build and load the compiled routing ops (custom_ops/ -> a Paddle custom-op library).

Two places hold a build:

* ahead of time: ``fd_routing_replay/_ops/fdrr_routing_ops.so`` (or
  ``$FD_RR_OPS_AOT_DIR``), made by ``custom_ops/build.py`` (the Makefile's ``ops`` target);
* just in time: ``$FD_RR_OPS_CACHE`` (default ``~/.cache/fd_routing_replay/ops``), one
  sub-directory per source digest, built on first import when the ahead-of-time build
  is missing or stale.

Each build records a digest of the sources, the Paddle version and the flags next to
the library, so a stale library is never loaded and an up-to-date one is never rebuilt.
``load_ops()`` returns the loaded library, or the reason it could not load one; the
caller (fd_routing_replay.ops.backend) then falls back to the numpy reference.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODULE_NAME = "fdrr_routing_ops"
OP_NAMES = (
    "fdrr_record_routing_",
    "fdrr_pack_routing",
    "fdrr_pack_routing_into_",
    "fdrr_gather_routing_rows",
    "fdrr_clear_routing_rows_",
    "fdrr_record_rows_",
)
PACKAGE_DIR = Path(__file__).resolve().parents[1]
# $FD_RR_OPS_AOT_DIR moves the ahead-of-time build (tests, read-only installs).
AOT_DIR = Path(os.environ.get("FD_RR_OPS_AOT_DIR") or PACKAGE_DIR / "_ops")
STAMP_NAME = ".built"
INFO_NAME = "build_info.json"

def _sources_dir() -> Path:
    """The op sources: the checkout's custom_ops/, else the copy a wheel ships in _csrc/."""
    for candidate in (PACKAGE_DIR.parent / "custom_ops", PACKAGE_DIR / "_csrc"):
        if (candidate / "routing_ops.cc").is_file():
            return candidate
    return PACKAGE_DIR / "_csrc"


SOURCES_DIR = _sources_dir()
BOUND_ABI = 2
"""The pybind11 module's ``abi_version`` this package expects (2: ``StepLedger``)."""
CPU_SOURCES = ("routing_ops.cc", "step_ops.cc", "step_ledger.cc")
CUDA_SOURCES = ("routing_ops.cu",)
HEADERS = ("routing_kernels.h", "routing_kernels.cuh")
CXX_FLAGS = ("-O3", "-std=c++17")
# SASS for Ampere (runs on sm_80/86/89) and Hopper, PTX for anything newer.
NVCC_FLAGS = ("-O3", "-std=c++17", "-gencode", "arch=compute_80,code=sm_80",
              "-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_90,code=compute_90")


@dataclass(frozen=True)
class LoadResult:
    """Outcome of ``load_ops``: whether the ops are usable, from which library, and why."""

    loaded: bool
    library: Path | None
    reason: str


def cache_dir() -> Path:
    """Root of the just-in-time build cache ($FD_RR_OPS_CACHE or ~/.cache/...)."""
    env = os.environ.get("FD_RR_OPS_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "fd_routing_replay" / "ops"


def _with_cuda() -> bool:
    """Build the CUDA kernels too: only with a CUDA Paddle and nvcc on PATH."""
    import paddle

    return bool(paddle.is_compiled_with_cuda()) and shutil.which("nvcc") is not None


def source_digest(sources_dir: Path = SOURCES_DIR, *, with_cuda: bool | None = None) -> str:
    """Digest of everything that determines the library: sources, flags, Paddle, Python."""
    import paddle

    if with_cuda is None:
        with_cuda = _with_cuda()
    h = hashlib.sha256()
    names = CPU_SOURCES + HEADERS + (CUDA_SOURCES if with_cuda else ())
    for name in sorted(names):
        h.update(name.encode() + b"\0" + (sources_dir / name).read_bytes() + b"\0")
    h.update(repr((paddle.__version__, sys.version_info[:2], CXX_FLAGS, NVCC_FLAGS, with_cuda)).encode())
    return h.hexdigest()


def _read_info(directory: Path) -> dict:
    try:
        return json.loads((directory / INFO_NAME).read_text())
    except (OSError, ValueError):
        return {}


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Serialise builds into ``directory`` across processes (e.g. tensor-parallel ranks)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


_BUILD_CHILD = """
import json, sys, warnings
warnings.filterwarnings("ignore")
from paddle.utils.cpp_extension import load
load(**json.loads(sys.argv[1]))
"""


def build(out_dir: Path = AOT_DIR, *, force: bool = False, verbose: bool = False) -> Path:
    """Compile the ops into ``out_dir/fdrr_routing_ops.so`` and return its path.

    Idempotent: when the library there was built from the same digest it is kept as is.
    The compiler runs ``paddle.utils.cpp_extension.load`` in a child process (loading
    registers the ops, and Paddle aborts the process that registers an op twice), in a
    fresh build directory under ``out_dir``.  The library is copied into place atomically, so a concurrent loader never sees half a
    file.  Raises ``RuntimeError`` with the compiler's output when the build fails.
    """
    out_dir = Path(out_dir).resolve()
    with_cuda = _with_cuda()
    digest = source_digest(with_cuda=with_cuda)
    target = out_dir / f"{MODULE_NAME}.so"
    with _locked(out_dir):
        if not force and target.exists() and _read_info(out_dir).get("digest") == digest:
            return target
        build_dir = out_dir / "build"
        # cpp_extension's own up-to-date check hashes the .cc/.cu files but not the
        # headers they include, so a kernel change would be missed: start clean.
        shutil.rmtree(build_dir, ignore_errors=True)
        build_dir.mkdir(parents=True, exist_ok=True)
        sources = [str(SOURCES_DIR / s) for s in CPU_SOURCES + (CUDA_SOURCES if with_cuda else ())]
        include = f"-I{SOURCES_DIR}"
        args = {
            "name": MODULE_NAME,
            "sources": sources,
            "extra_cxx_cflags": [*CXX_FLAGS, include],
            "extra_cuda_cflags": [*NVCC_FLAGS, include],
            "build_directory": str(build_dir),
            "verbose": verbose,
        }
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-c", _BUILD_CHILD, json.dumps(args)],
            stdout=None if verbose else subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        )
        built = build_dir / MODULE_NAME / f"{MODULE_NAME}.so"
        if proc.returncode != 0 or not built.exists():
            tail = (proc.stdout or "")[-4000:]
            raise RuntimeError(f"building {MODULE_NAME} failed (exit {proc.returncode}):\n{tail}")
        tmp = out_dir / f".{MODULE_NAME}.so.tmp{os.getpid()}"
        shutil.copyfile(built, tmp)
        os.replace(tmp, target)
        info = {
            "digest": digest,
            "with_cuda": with_cuda,
            "seconds": round(time.monotonic() - started, 1),
            "ops": list(OP_NAMES),
        }
        (out_dir / INFO_NAME).write_text(json.dumps(info, indent=2) + "\n")
        return target


def _aot_status() -> tuple[Path | None, str]:
    """The ahead-of-time library if present and current, else why not."""
    target = AOT_DIR / f"{MODULE_NAME}.so"
    if not target.exists():
        return None, f"no ahead-of-time build at {target} (run `make ops`)"
    if not SOURCES_DIR.is_dir():
        return target, "ahead-of-time build (sources not shipped; digest not checked)"
    recorded = _read_info(AOT_DIR).get("digest")
    if recorded != source_digest():
        return None, f"ahead-of-time build at {target} is stale (custom_ops/ changed; run `make ops`)"
    return target, f"ahead-of-time build {target}"


def load_ops() -> LoadResult:
    """Register the compiled ops with Paddle: ahead-of-time build, else a JIT build.

    Never raises: any failure becomes the ``reason`` of a result without a library.
    """
    from paddle.base import core
    from paddle.utils.cpp_extension import load_op_meta_info_and_register_op

    # Registering an op twice aborts the process: reuse ops already registered (a
    # reloaded module), refuse a partial set.
    known = set(core.get_all_op_names())
    present = [name for name in OP_NAMES if name in known]
    if len(present) == len(OP_NAMES):
        return LoadResult(True, None, "ops already registered in this process")
    if present:
        return LoadResult(False, None, f"some ops are registered by another library: {present}")
    reasons = []
    try:
        library, why = _aot_status()
    except Exception as exc:  # unreadable sources, broken Paddle: report, fall through
        library, why = None, f"ahead-of-time build unusable: {exc!r}"
    if library is None:
        reasons.append(why)
        if os.environ.get("FD_RR_OPS_JIT", "1") == "0":
            return LoadResult(False, None, "; ".join(reasons + ["JIT build disabled by FD_RR_OPS_JIT=0"]))
        if not SOURCES_DIR.is_dir():
            return LoadResult(False, None, "; ".join(reasons + [f"no sources for a JIT build at {SOURCES_DIR}"]))
        try:
            jit_dir = cache_dir() / source_digest()[:16]
            library = build(jit_dir)
            why = f"JIT build {library} ({reasons[0]})"
        except Exception as exc:
            return LoadResult(False, None, "; ".join(reasons + [f"JIT build into {cache_dir()} failed: {exc!r}"]))
    try:
        registered = set(load_op_meta_info_and_register_op(str(library)))
    except Exception as exc:
        return LoadResult(False, None, "; ".join(reasons + [f"loading {library} failed: {exc!r}"]))
    missing = [name for name in OP_NAMES if name not in registered]
    if missing:
        return LoadResult(False, None, "; ".join(reasons + [f"{library} lacks ops {missing}"]))
    return LoadResult(True, library, why)


def bound_module(library: Path | None) -> tuple[Any, str]:
    """The library's directly bound entry points (its pybind11 module), or why not.

    The custom-op library is also a Python extension module named like the file
    (``PYBIND11_MODULE(fdrr_routing_ops, ...)`` in custom_ops/step_ops.cc).  Importing it
    from the path Paddle loaded returns the same ``dlopen`` handle, so the op
    registrations do not run again.  With ``library`` None (ops registered earlier in
    this process), the module imported then is reused, else the ahead-of-time build.
    """
    import importlib.machinery
    import importlib.util

    name = f"fd_routing_replay._ops.{MODULE_NAME}"
    if name in sys.modules:
        return sys.modules[name], "already imported"
    if library is None:
        library = AOT_DIR / f"{MODULE_NAME}.so"
        if not library.exists():
            return None, f"no library to bind from ({library} missing)"
    try:
        # The loader looks up PyInit_<last part of the name>, i.e. PyInit_fdrr_routing_ops.
        loader = importlib.machinery.ExtensionFileLoader(name, str(library))
        spec = importlib.util.spec_from_file_location(name, str(library), loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except Exception as exc:  # an old build without the module, a broken library
        return None, f"binding {library} failed: {exc!r}"
    if getattr(module, "abi_version", None) != BOUND_ABI:
        return None, (f"{library} has bound ABI {getattr(module, 'abi_version', None)!r}, expected "
                      f"{BOUND_ABI}: rebuild it (make ops)")
    sys.modules[name] = module
    return module, f"bound from {library}"


def host_pack_function(library: Path | None, *, keep_gil: bool = False) -> Any:
    """The library's C entry for packing numpy buffers, through ctypes, or None.

    ``fdrr_host_pack_routing(source, num_slots, num_layers, top_k, elem_bytes, slots,
    idx_bytes, num_tokens, out)`` returns -1 when done, the first out-of-range slot's
    position (nothing written), or -2/-3 (unsupported size / failure).  dlopen of the
    library Paddle already loaded returns the same handle, so the op registrations do
    not run again; ctypes releases the GIL during the call, unless ``keep_gil`` (the same
    entry through ``ctypes.PyDLL``: for small packs, where handing the GIL to another thread
    and waiting to get it back costs more than the pack).
    """
    if library is None:
        return None
    try:
        lib = ctypes.PyDLL(str(library)) if keep_gil else ctypes.CDLL(str(library))
        lib.fdrr_host_abi_version.restype = ctypes.c_int64
        if lib.fdrr_host_abi_version() != 1:
            return None
        function = lib.fdrr_host_pack_routing
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_int64
    function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                         ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return function
