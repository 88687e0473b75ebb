"""Which implementation the routing ops use in this process, chosen once at import.

The compiled ops (custom_ops/, built and located by :mod:`fd_routing_replay.core.native`:
the ahead-of-time build, else a JIT build; registered with Paddle here) or, when they
cannot load, the NumPy reference (:mod:`fd_routing_replay.ops.reference`, CPU tensors
only), with one warning that says why.  ``FD_RR_OPS=reference`` forces the reference,
``FD_RR_OPS=compiled`` makes a missing build an import error.  Also here: the library's
directly bound entry points and its C pack entry, calling a compiled op (``run``) and the
zero-copy host view the reference works on (``host_view``).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import paddle
from paddle import _C_ops

from fd_routing_replay.core.native import OPS, aot_dir, locate, mode
from fd_routing_replay.errors import OpsError

try:  # marks functions that already work in dygraph and static mode (no re-tracing)
    from paddle.jit.marker import unified
except ImportError:  # pragma: no cover - older Paddle
    def unified(fn):  # type: ignore[no-redef]
        """No-op stand-in for ``paddle.jit.marker.unified`` on older Paddle."""
        return fn

__all__ = [
    "ACTIVE",
    "BOUND_ABI",
    "OP_NAMES",
    "Backend",
    "LoadResult",
    "active_backend",
    "bound_backend",
    "bound_module",
    "host_pack_function",
    "host_view",
    "load_ops",
    "ops_backend",
    "ops_backend_reason",
    "run",
    "select_backend",
    "unified",
]

OP_NAMES = (
    "fdrr_record_routing_",
    "fdrr_pack_routing",
    "fdrr_pack_routing_into_",
    "fdrr_gather_routing_rows",
    "fdrr_clear_routing_rows_",
    "fdrr_record_rows_",
)
BOUND_ABI = 2
"""The pybind11 module's ``abi_version`` this package expects (2: ``StepLedger``)."""


@dataclass
class Backend:
    """The ops implementation of this process.

    ``name``: ``"compiled"`` or ``"reference"``; ``reason``: which library was loaded or
    what failed; ``library``: the loaded library (None for the reference);
    ``host_pack``: the library's C entry point that packs NumPy buffers in place (None
    when unavailable: ``pack_routing`` then takes the DLPack + Paddle-op path);
    ``bound``: the library's pybind11 module (None: the NumPy twins), ``bound_reason``
    why; ``host_pack_small``: the same C entry holding the GIL, for small packs.  The ops
    read these fields at call time, so a test may set ``host_pack`` to None to exercise
    the fallback path.
    """

    name: str
    reason: str
    library: Path | None
    host_pack: Any
    bound: Any
    bound_reason: str
    host_pack_small: Any = None


@dataclass(frozen=True)
class LoadResult:
    """Outcome of ``load_ops``: whether the ops are usable, from which library, and why."""

    loaded: bool
    library: Path | None
    reason: str


def load_ops() -> LoadResult:
    """Register the compiled ops with Paddle (the build :func:`~fd_routing_replay.core.native.locate`
    finds).  Never raises: any failure becomes the ``reason`` of a result without a library."""
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
    library, why = locate(OPS)
    if library is None:
        return LoadResult(False, None, why)
    try:
        registered = set(load_op_meta_info_and_register_op(str(library)))
    except Exception as exc:
        return LoadResult(False, None, f"{why}; loading {library} failed: {exc!r}")
    missing = [name for name in OP_NAMES if name not in registered]
    if missing:
        return LoadResult(False, None, f"{why}; {library} lacks ops {missing}")
    return LoadResult(True, library, why)


def bound_module(library: Path | None) -> tuple[Any, str]:
    """The library's directly bound entry points (its pybind11 module), or why not.

    The custom-op library is also a Python extension module named like the file
    (``PYBIND11_MODULE(fdrr_routing_ops, ...)`` in custom_ops/step_ops.cc).  Importing it
    from the path Paddle loaded returns the same ``dlopen`` handle, so the op
    registrations do not run again.  With ``library`` None (ops registered earlier in
    this process), the module imported then is reused, else the ahead-of-time build.
    """
    name = f"fd_routing_replay._ops.{OPS.name}"
    if name in sys.modules:
        return sys.modules[name], "already imported"
    if library is None:
        library = aot_dir() / OPS.file_name
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

def select_backend() -> Backend:
    """Choose the backend from ``$FD_RR_OPS`` and what loads (warns on the reference)."""
    chosen = mode()
    if chosen == "reference":
        reason = "forced by FD_RR_OPS=reference"
    else:
        result = load_ops()
        if result.loaded:
            host_pack = host_pack_function(result.library)
            bound, bound_reason = bound_module(result.library)
            return Backend("compiled", result.reason, result.library, host_pack, bound, bound_reason,
                           host_pack_function(result.library, keep_gil=True))
        if chosen == "compiled":
            raise OpsError(f"FD_RR_OPS=compiled but the compiled routing ops cannot load: {result.reason}")
        reason = result.reason
    warnings.warn(
        "fd_routing_replay: using the numpy reference routing ops (slower, CPU tensors only) "
        f"instead of the compiled ones: {reason}",
        RuntimeWarning,
        stacklevel=4,  # the code importing fd_routing_replay.ops (via ops/__init__, this module)
    )
    return Backend("reference", reason, None, None, None, "reference backend")


# The one backend of this process (chosen when fd_routing_replay.ops is first imported).
ACTIVE = select_backend()


def active_backend() -> Backend:
    """The :class:`Backend` the ops of this process use."""
    return ACTIVE


def ops_backend() -> str:
    """``"compiled"`` or ``"reference"``: which implementation the ops use in this process."""
    return ACTIVE.name


def ops_backend_reason() -> str:
    """Why ``ops_backend()`` is what it is (which library was loaded, or what failed)."""
    return ACTIVE.reason


def bound_backend() -> str:
    """``"bound"`` (the library's pybind11 entry points) or ``"reference"``, and why."""
    return "bound" if ACTIVE.bound is not None else f"reference ({ACTIVE.bound_reason})"


def host_view(t: paddle.Tensor, name: str) -> np.ndarray:
    """Zero-copy numpy view of a CPU tensor (the reference backend works on these)."""
    if not t.place.is_cpu_place():
        raise OpsError(
            f"{name} is on {t.place}, but the reference routing ops run on CPU tensors only "
            f"(compiled ops unavailable: {ACTIVE.reason})"
        )
    return np.from_dlpack(t)


def run(op: str, *args: Any) -> Any:
    """Call a compiled op, turning its "fdrr: ..." errors into OpsError."""
    try:
        return _C_ops._run_custom_op(op, *args)
    except (OSError, RuntimeError, ValueError) as exc:
        text = str(exc)
        if "fdrr:" not in text:
            raise
        raise OpsError(text.split("fdrr:", 1)[1].splitlines()[0].strip()) from exc
