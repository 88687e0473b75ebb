"""The compiled ops library of this process, loaded once, at import.

The library (custom_ops/, built and located by :mod:`fd_routing_replay.core.native`: the
ahead-of-time build, else a just-in-time build from the shipped sources) is a pybind11
module linked against Paddle; it is the only implementation of the ops.  When it cannot
load, the reason is kept and :func:`library` raises ``OpsError`` naming it: the first
capture constructor fails, nothing else does.  ``FD_RR_OPS=compiled`` makes that failure an
import error instead (deployments, ``make test``).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paddle  # noqa: F401  (loads libpaddle.so, which the library links against)

from fd_routing_replay.core.native import OPS, locate, mode
from fd_routing_replay.errors import OpsError

__all__ = ["ABI", "Loaded", "library", "load", "ops_backend", "ops_backend_reason"]

ABI = 3
"""The library's ``abi_version`` this package expects (3: every argument checked there,
refusals raised as :class:`~fd_routing_replay.errors.OpsError`)."""


@dataclass(frozen=True)
class Loaded:
    """The outcome of :func:`load`: the library's module (None when it did not load) and
    which file it came from, or why it did not load."""

    module: Any
    reason: str


def _import(path: Path) -> Any:
    """The library at ``path`` as a Python extension module (its ``PYBIND11_MODULE``)."""
    name = f"fd_routing_replay._ops.{OPS.name}"
    if name in sys.modules:   # one dlopen per process: a reload would bind the same handle
        return sys.modules[name]
    # The loader looks up PyInit_<last part of the name>, i.e. PyInit_fdrr_routing_ops.
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[name] = module
    return module


def load() -> Loaded:
    """Locate (or build) the library and import it; never raises."""
    path, why = locate(OPS)
    if path is None:
        return Loaded(None, why)
    try:
        module = _import(path)
    except Exception as exc:  # a broken or foreign build, a Paddle it was not built for
        return Loaded(None, f"{why}; importing {path} failed: {exc!r}")
    if getattr(module, "abi_version", None) != ABI:
        return Loaded(None, f"{path} has ABI {getattr(module, 'abi_version', None)!r}, expected {ABI}: "
                            "rebuild it (make ops)")
    module.set_error_type(OpsError)
    return Loaded(module, why)


_MODE = mode()   # an unknown FD_RR_OPS is an error here, whatever loads
_LOADED = load()
if _LOADED.module is None and _MODE == "compiled":
    raise OpsError(f"FD_RR_OPS=compiled but the compiled routing ops cannot load: {_LOADED.reason}")


def library() -> Any:
    """The library's module; ``OpsError`` naming why when it did not load."""
    if _LOADED.module is None:
        raise OpsError(f"routing replay needs its compiled ops library (custom_ops/), which did not "
                       f"load: {_LOADED.reason}")
    return _LOADED.module


def ops_backend() -> str:
    """``"compiled"`` when the library loaded, else ``"unavailable"``."""
    return "compiled" if _LOADED.module is not None else "unavailable"


def ops_backend_reason() -> str:
    """Which library file was loaded, or why none was."""
    return _LOADED.reason

