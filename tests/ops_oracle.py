"""NumPy oracles of the compiled ops (custom_ops/): what the step recorder and the request
pack must compute, written from their definitions and independent of the kernels.

NumPy only (no Paddle), so scripts/device_check.py can check the CUDA kernels against the
same oracle on a GPU machine.  The oracles are themselves checked against plain per-element
loops (tests/test_ops_step.py).
"""

from __future__ import annotations

import numpy as np

__all__ = ["fill_of", "pack_request", "record_rows"]


def fill_of(dtype: np.dtype) -> int:
    """The "no routing" fill of a routing dtype: its maximum (all bits set)."""
    return int(np.iinfo(dtype).max)


def record_rows(buffer: np.ndarray, topk_ids: np.ndarray, layer: int, num_experts: int) -> int:
    """One MoE layer into the token-major step buffer ``[capacity, L, K]``:
    ``buffer[t, layer, :] = topk_ids[t, :]`` for every token ``t``; ids outside
    ``[0, num_experts)`` are written as the fill.  Returns their count (the kernel adds it
    to ``counters[0]``, and 1 to ``counters[1 + layer]`` when there are tokens)."""
    num_tokens = topk_ids.shape[0]
    if num_tokens == 0:
        return 0
    ids = topk_ids.astype(np.int64)
    bad = (ids < 0) | (ids >= num_experts)
    buffer[:num_tokens, layer, :] = np.where(bad, fill_of(buffer.dtype), ids).astype(buffer.dtype)
    return int(np.count_nonzero(bad))


def pack_request(cache: np.ndarray, block_row: np.ndarray, start: int, length: int,
                 block_size: int) -> np.ndarray:
    """Rows of positions ``[start, length)`` of one request as ``[L, length - start, K]``:
    position ``p`` sits in KV slot ``block_row[p // block_size] * block_size + p %
    block_size`` of the slot cache ``[S, L, K]``."""
    positions = np.arange(start, length, dtype=np.int64)
    slots = block_row.astype(np.int64)[positions // block_size] * block_size + positions % block_size
    return np.ascontiguousarray(cache[slots].transpose(1, 0, 2))
