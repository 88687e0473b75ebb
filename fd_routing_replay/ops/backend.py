"""Which implementation the routing ops use in this process, chosen once at import.

The compiled ops (custom_ops/, loaded by :mod:`fd_routing_replay.ops.loader`: the
ahead-of-time build, else a JIT build) or, when they cannot load, the NumPy reference
(:mod:`fd_routing_replay.ops.reference`, CPU tensors only), with one warning that says
why.  ``FD_RR_OPS=reference`` forces the reference, ``FD_RR_OPS=compiled`` makes a
missing build an import error.  Also here: calling a compiled op (``run``) and the
zero-copy host view the reference works on (``host_view``).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import paddle
from paddle import _C_ops

from fd_routing_replay.errors import OpsError
from fd_routing_replay.ops.loader import bound_module, host_pack_function, load_ops

try:  # marks functions that already work in dygraph and static mode (no re-tracing)
    from paddle.jit.marker import unified
except ImportError:  # pragma: no cover - older Paddle
    def unified(fn):  # type: ignore[no-redef]
        """No-op stand-in for ``paddle.jit.marker.unified`` on older Paddle."""
        return fn

__all__ = [
    "ACTIVE",
    "Backend",
    "active_backend",
    "bound_backend",
    "host_view",
    "ops_backend",
    "ops_backend_reason",
    "run",
    "select_backend",
    "unified",
]


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


def select_backend() -> Backend:
    """Choose the backend from ``$FD_RR_OPS`` and what loads (warns on the reference)."""
    mode = os.environ.get("FD_RR_OPS", "auto").strip().lower() or "auto"
    if mode not in ("auto", "compiled", "reference"):
        raise OpsError(f"FD_RR_OPS={mode!r} is not one of 'auto', 'compiled', 'reference'")
    if mode == "reference":
        reason = "forced by FD_RR_OPS=reference"
    else:
        result = load_ops()
        if result.loaded:
            host_pack = host_pack_function(result.library)
            bound, bound_reason = bound_module(result.library)
            return Backend("compiled", result.reason, result.library, host_pack, bound, bound_reason,
                           host_pack_function(result.library, keep_gil=True))
        if mode == "compiled":
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
