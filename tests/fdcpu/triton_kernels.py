"""CPU stand-ins for FastDeploy's Triton kernels, bound when FastDeploy decorates them.

FastDeploy's Triton kernels are Python functions decorated with ``triton.jit``; on this CPU
machine ``triton`` is a stand-in module (:mod:`fdrr_dev.testing.fastdeploy_standins`) whose
``jit`` returns an object that raises when launched.  :func:`patch_triton` makes ``jit``
return a CPU implementation instead for the kernels named in :data:`KERNELS`, launched the
same way (``kernel[grid](...)``).

* ``_save_routing_kernel_v2`` (model_executor/layers/moe/routing_indices_cache.py:31-63 in
  2.6): FastDeploy's own routing replay capture -- each token's top-k ids of one MoE layer
  into the step buffer ``[tokens, num_moe_layers, top_k]`` at ``LAYER_IDX``.  Only used when
  FastDeploy's built-in routing replay runs (the plugin off), for the baseline of
  FastDeploy's R3 test flow.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .tensors import read, write

__all__ = ["KERNELS", "CpuTritonKernel", "patch_triton", "save_routing_kernel_v2"]


def save_routing_kernel_v2(device_routing_buffer: Any, topk_ids: Any, LAYER_IDX: int, TOKEN_NUM: int,  # noqa: N803
                           TOP_K: int, NUM_MOE_LAYERS: int, BLOCK_SIZE_M: int = 128,  # noqa: N803
                           BLOCK_SIZE_K: int = 0) -> None:  # noqa: N803
    """``buffer[t, LAYER_IDX, k] = topk_ids[t, k]`` for ``t < TOKEN_NUM``, ``k < TOP_K`` (the
    kernel's masked loads and stores); the ids take the buffer's dtype."""
    buffer = read(device_routing_buffer)
    rows = read(topk_ids)[:TOKEN_NUM, :TOP_K]
    buffer[:TOKEN_NUM, LAYER_IDX, :TOP_K] = rows.astype(buffer.dtype)
    write(device_routing_buffer, buffer)


KERNELS = {"_save_routing_kernel_v2": save_routing_kernel_v2}
"""Triton kernel name -> CPU implementation."""


class CpuTritonKernel:
    """A ``triton.jit`` kernel run on the CPU: ``kernel[grid](*args, **kwargs)``."""

    def __init__(self, name: str, fn: Any) -> None:
        self.__name__ = self.__qualname__ = name
        self.fn = fn

    def __getitem__(self, grid: Any) -> CpuTritonKernel:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def patch_triton(triton: ModuleType) -> None:
    """Make the stand-in ``triton.jit`` bind :data:`KERNELS` (a real Triton is left alone)."""
    if not getattr(triton, "__fdrr_standin__", False):
        return
    standin_jit = triton.jit

    def jit(fn: Any = None, **kwargs: Any) -> Any:
        if fn is None:
            return jit
        name = getattr(fn, "__name__", "")
        if name in KERNELS:
            return CpuTritonKernel(name, KERNELS[name])
        return standin_jit(fn)

    triton.jit = jit
