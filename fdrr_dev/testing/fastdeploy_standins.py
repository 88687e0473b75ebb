"""Stand-ins for the parts of FastDeploy that need a GPU build, installed before FastDeploy is imported
(the contract tier, tests/fastdeploy_contract, and benchmarks that run FastDeploy's own code on a CPU).

FastDeploy's Python imports on a CPU machine once its compiled ops and its Triton glue are
replaced (../shared/fastdeploy/README.md).  Each stand-in is a real module object, so
``from X import name`` and typing annotations work; calling a stand-in op raises, naming
it, so a test can never pass by silently running a fake kernel.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

__all__ = ["STANDIN_REASONS", "install", "StandInOpError"]


class StandInOpError(RuntimeError):
    """A FastDeploy compiled op (a GPU build) was called in the CPU contract tier."""


STANDIN_REASONS: dict[str, str] = {
    # prefix → why it is replaced (one line each, as the contract tier's rules ask)
    "fastdeploy.model_executor.ops.gpu": "FastDeploy's CUDA custom ops exist only in a GPU build",
    "fastdeploy.model_executor.ops.cpu": "FastDeploy's CPU custom ops are compiled; not in the source tree",
    "fastdeploy.model_executor.ops.xpu": "Kunlun XPU ops are compiled for XPU builds",
    "fastdeploy.model_executor.ops.npu": "Ascend NPU ops are compiled for NPU builds",
    "fastdeploy.model_executor.ops.gcu": "Enflame GCU ops are compiled for GCU builds",
    "fastdeploy.model_executor.ops.iluvatar": "Iluvatar ops are compiled for Iluvatar builds",
    "fastdeploy.model_executor.ops.intel_hpu": "Intel HPU ops are compiled for HPU builds",
    "use_triton_in_paddle": "Triton-on-Paddle glue ships with FastDeploy's GPU wheel",
    "triton": "Triton kernels need a GPU; FastDeploy only decorates them at import",
    "paddle.distributed.communication.deep_ep": "DeepEP (the expert-parallel all-to-all) ships with "
                                                "Paddle's GPU build only; FastDeploy's ep.py imports it",
    "decord": "video decoding for multimodal inputs, not used by routing replay",
    "moviepy": "video decoding for multimodal inputs, not used by routing replay",
}


class _StandInCallable:
    """A named callable that refuses to run; also usable as a decorator target."""

    def __init__(self, qualname: str) -> None:
        self.__qualname__ = self.__name__ = qualname

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise StandInOpError(f"{self.__qualname__} is a stand-in for a compiled FastDeploy/Triton "
                             "function and cannot run on this CPU machine")

    def __getitem__(self, grid: Any) -> _StandInCallable:  # triton kernel[grid](...)
        return self

    def __getattr__(self, name: str) -> _StandInCallable:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandInCallable(f"{self.__qualname__}.{name}")

    def __mro_entries__(self, bases: tuple) -> tuple:  # `class X(stand_in)` → plain object
        return (object,)


def _jit(fn: Any = None, **kwargs: Any) -> Any:
    """``triton.jit`` / ``@triton.jit(...)``: keep the Python function, mark it a stand-in."""
    if fn is None:
        return _jit
    return _StandInCallable(getattr(fn, "__qualname__", "triton_kernel"))


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandInCallable(f"{self.__name__}.{name}")


def _make_module(name: str) -> types.ModuleType:
    module = _StandInModule(name)
    # A package (submodules resolve through the finder); FastDeploy's triton_utils reads
    # triton.__path__[0] at import, so the path names the stand-in instead of being empty.
    module.__path__ = [f"<stand-in {name}>"]
    module.__fdrr_standin__ = True
    if name == "triton":
        module.jit = _jit
        module.autotune = lambda *a, **k: (lambda fn: fn)
        module.heuristics = lambda *a, **k: (lambda fn: fn)
        module.cdiv = lambda a, b: -(-a // b)
        module.next_power_of_2 = lambda n: 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
        module.Config = dict
        module.__version__ = "0.0-standin"
    if name == "triton.language":
        module.constexpr = type("constexpr", (), {})
        module.tensor = type("tensor", (), {})
    if name == "use_triton_in_paddle":
        module.make_triton_compatible_with_paddle = lambda: None
    return module


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, prefixes: list[str]) -> None:
        self.prefixes = prefixes

    def _covered(self, fullname: str) -> bool:
        return any(fullname == p or fullname.startswith(p + ".") for p in self.prefixes)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not self._covered(fullname):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        return _make_module(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install() -> list[str]:
    """Put the finder first on ``sys.meta_path``; returns the prefixes it replaces.

    Triton, decord and moviepy are replaced only when they do not import on their own.
    """
    prefixes = []
    for prefix in STANDIN_REASONS:
        optional = prefix in ("triton", "decord", "moviepy", "paddle.distributed.communication.deep_ep")
        if optional and importlib.util.find_spec(prefix) is not None:
            continue
        prefixes.append(prefix)
    if not any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StandInFinder(prefixes))
    return prefixes
