"""The step buffer and the library's bound entry points over it and the host arrays.

Re-exported by :mod:`fd_routing_replay.ops`.  The buffer is ``[max_batched_tokens, L, K]``,
token ``t`` of the step in row ``t``; see docs/ops.md.  Every argument of a bound entry point
is checked once, by the library (custom_ops/bound_args.h): a malformed one raises
``OpsError`` naming it.  Without the library each ``bind_*`` / :func:`request_packer` call
raises ``OpsError`` saying why it did not load.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle

from fd_routing_replay.errors import OpsError
from fd_routing_replay.ops.backend import library
from fd_routing_replay.ops.dtypes import NP_ROUTING, routing_dtype

__all__ = ["bind_step_flush", "bind_step_ledger", "bind_step_recorder", "new_step_buffer", "request_packer"]


def new_step_buffer(max_tokens: int, num_layers: int, top_k: int, num_experts: int,
                    place: Any = None) -> paddle.Tensor:
    """The token-major step buffer ``[max_tokens, num_layers, top_k]``, filled.

    Row ``t`` holds token ``t`` of the current step for every MoE layer (FastDeploy 2.6's
    and vLLM's layout).  The dtype is ``routing_dtype(num_experts)`` as a real Paddle dtype:
    Paddle's CPU ``full`` has no uint16/uint32 kernel and the string "uint16" means bfloat16,
    so the buffer is allocated as bytes of 0xFF (the fill of every routing dtype) and viewed
    as the routing dtype without a copy.  ``place``: a Paddle place or device string.
    """
    for name, value in (("max_tokens", max_tokens), ("num_layers", num_layers), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise OpsError(f"{name} must be a positive integer, got {value!r}")
    dtype = routing_dtype(num_experts)
    shape = [int(max_tokens), int(num_layers), int(top_k) * dtype.itemsize]
    buffer = paddle.full(shape, 255, dtype=paddle.uint8, device=place)
    return buffer if dtype.itemsize == 1 else buffer.view(NP_ROUTING[dtype])


def bind_step_recorder(buffer: paddle.Tensor, counters: paddle.Tensor, *, num_experts: int,
                       layer_rows: Any = None, host_rows: np.ndarray, host_counters: np.ndarray,
                       host_extra: np.ndarray) -> Any:
    """The per-layer entry point over one step buffer (the library's ``StepRecorder``).

    ``counters``: int64 ``[1 + L]`` on the buffer's device (``counters[0]`` += ids outside
    ``[0, num_experts)``, written as the fill; ``counters[1 + row]`` += 1 per call with
    tokens); ``layer_rows``: the buffer row of each FastDeploy MoE layer index (negative: not
    a MoE layer), None for the identity; ``host_rows`` (the buffer's dtype and shape),
    ``host_counters`` (int64 ``[1 + L]``) and ``host_extra`` (uint8): the host staging, kept
    alive by the recorder and page-locked on a GPU.  Methods: ``record(topk_ids, layer_idx,
    expected_rows=-1)`` (one MoE layer; ``expected_rows >= 0`` requires that many routed
    rows), ``offload(num_tokens, extra=None)`` (rows ``[0, num_tokens)``, the counters and the
    first ``num_tokens`` elements of ``extra`` into the staging: asynchronous on a GPU),
    ``wait()`` (until that copy landed), ``fill()``.
    """
    return library().StepRecorder(buffer, counters, num_experts, layer_rows, host_rows, host_counters,
                                  host_extra)


def bind_step_flush(*, cache: np.ndarray, staging: np.ndarray, extra: np.ndarray,
                    host_counters: np.ndarray, seen: np.ndarray, delta: np.ndarray,
                    columns: np.ndarray | None = None) -> Any:
    """FastDeploy 2.6's worker flush over these arrays, bound once (the library's
    ``StepFlush``): ``flush(num_tokens, slots_itemsize, damaged)`` returns ``(written,
    invalid, missing_layers, bad_ids)``; ``columns``: the cache row (int64) of each staged
    layer when the cache has more rows."""
    return library().StepFlush(cache=cache, staging=staging, extra=extra, host_counters=host_counters,
                               seen=seen, delta=delta, columns=columns)


def bind_step_ledger(**arrays: Any) -> Any:
    """The table-API manager's per-step bookkeeping, bound once (the library's ``StepLedger``).

    Keyword arguments: ``registered``/``damaged`` bool ``[S]``, ``forwarded`` int64 ``[S]``,
    scratch ``tokens`` int64 ``[4, T]`` and ``slots`` int64 ``[5, S]``, ``finished`` int64
    ``[2, S]``, the host ``block_table`` (or None), ``block_size``, ``max_model_len``, and for
    the rank that offloads the slot ``cache``, the ``staging`` rows and the
    ``host_counters``/``seen``/``delta`` int64 ``[1 + L]`` arrays (``cache=None`` elsewhere).
    """
    return library().StepLedger(**arrays)


def request_packer() -> Any:
    """The library's ``pack_request(cache, block_row, start, length, block_size, out=None)``:
    a finished request's rows of positions ``[start, length)`` straight from its block-table
    row, packed ``[L, length - start, K]`` into ``out`` (the writer's ring) or a new array."""
    return library().pack_request
