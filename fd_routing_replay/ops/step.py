"""The token-major step buffer's ops: record_rows, the bound recorder, the step plan.

Re-exported by :mod:`fd_routing_replay.ops`.  The buffer is ``[max_batched_tokens, L, K]``, token ``t`` of the
step in row ``t``; see docs/ops.md, "The step buffer".
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle

from fd_routing_replay.errors import OpsError
from fd_routing_replay.ops import reference as ref
from fd_routing_replay.ops.backend import ACTIVE, host_view, run, unified
from fd_routing_replay.ops.checks import (
    check_inplace,
    eager,
    index_dtype_of,
    is_tensor,
    layer_and_fill,
    positive_ints,
    routing_dtype_of,
    shape_of,
    tensor,
)
from fd_routing_replay.ops.dtypes import NP_ROUTING, dtype_text, routing_dtype

__all__ = [
    "ReferenceStepRecorder",
    "bind_step_flush",
    "bind_step_ledger",
    "bind_step_recorder",
    "count_unrouted",
    "new_step_buffer",
    "plan_step",
    "record_rows",
    "request_packer",
    "scatter_rows",
]


def new_step_buffer(max_tokens: int, num_layers: int, top_k: int, num_experts: int,
                    place: Any = None) -> paddle.Tensor:
    """The token-major step buffer ``[max_tokens, num_layers, top_k]``, filled.

    Row ``t`` holds token ``t`` of the current step for every MoE layer (FastDeploy 2.6's
    and vLLM's layout); same dtype and fill rules as
    :func:`fd_routing_replay.ops.table.new_routing_table`.
    """
    positive_ints(("max_tokens", max_tokens), ("num_layers", num_layers), ("top_k", top_k))
    dtype = routing_dtype(num_experts)
    shape = [int(max_tokens), int(num_layers), int(top_k) * dtype.itemsize]
    buffer = paddle.full(shape, 255, dtype=paddle.uint8, device=place)   # 0xFF: the fill of every dtype
    return buffer if dtype.itemsize == 1 else buffer.view(NP_ROUTING[dtype])


def _check_rows(buffer: Any, topk_ids: Any, layer: Any, counters: Any, num_experts: Any) -> tuple[int, int]:
    """Validate record_rows' arguments; return (layer, num_experts) as ints."""
    for name, t in (("buffer", buffer), ("topk_ids", topk_ids), ("counters", counters)):
        tensor(t, name)
    dtype = routing_dtype_of(buffer, "buffer")
    shape = shape_of(buffer, "buffer", 3)
    ids_shape = shape_of(topk_ids, "topk_ids", 2)
    index_dtype_of(topk_ids, "topk_ids")
    if ids_shape[1] != shape[2] and min(ids_shape[1], shape[2]) >= 0:
        raise OpsError(f"topk_ids has top_k={ids_shape[1]} but the buffer has top_k={shape[2]}")
    if eager() and ids_shape[0] > shape[0]:
        raise OpsError(f"topk_ids has {ids_shape[0]} tokens; the step buffer holds {shape[0]}")
    if counters.dtype != paddle.int64 or list(counters.shape) != [shape[1] + 1]:
        raise OpsError(f"counters must be int64 [1 + num_layers] = [{shape[1] + 1}], got "
                       f"{dtype_text(counters.dtype)} {list(counters.shape)}")
    check_inplace(buffer, "buffer")
    check_inplace(counters, "counters")
    return layer_and_fill(layer, shape[1], dtype, num_experts)


@unified
def record_rows(buffer: paddle.Tensor, topk_ids: paddle.Tensor, layer: int, counters: paddle.Tensor,
                *, num_experts: int | None = None) -> None:
    """Write one MoE layer's ``topk_ids`` into the step buffer: ``buffer[t, layer, :]``.

    ``buffer`` is ``[max_batched_tokens, L, K]`` (:func:`new_step_buffer`); token ``t`` of
    the step is row ``t``.  ``counters`` (int64 ``[1 + L]``, on the buffer's device):
    ``counters[0]`` += ids outside ``[0, num_experts)`` (written as the fill),
    ``counters[1 + layer]`` += 1 per call with tokens.  The validated op, usable in
    static graphs; the engine's hot path calls :func:`bind_step_recorder`'s object.
    """
    layer, experts = _check_rows(buffer, topk_ids, layer, counters, num_experts)
    if ACTIVE.name == "compiled":
        run("fdrr_record_rows_", buffer, topk_ids, counters, layer, experts)
        return
    if topk_ids.shape[0] == 0:
        return
    errors = ref.record_rows_np(host_view(buffer, "buffer"), host_view(topk_ids, "topk_ids"), layer, experts)
    view = host_view(counters, "counters")
    view[0] += errors
    view[1 + layer] += 1


class ReferenceStepRecorder:
    """NumPy twin of the library's bound ``StepRecorder`` (CPU tensors only).

    What :func:`bind_step_recorder` returns on the reference backend; the tests also
    build one next to the bound recorder to compare the two on the same inputs.  The
    arguments are those of the bound ``StepRecorder``, already validated.
    """

    pinned = False

    def __init__(self, buffer: Any, counters: Any, num_experts: int, layer_rows: list[int],
                 host_rows: np.ndarray, host_counters: np.ndarray, host_extra: np.ndarray) -> None:
        self._buffer = host_view(buffer, "buffer")
        self._counters = host_view(counters, "counters")
        self._num_experts = num_experts
        self._rows = list(layer_rows)
        for row in self._rows:
            if row >= self._buffer.shape[1]:
                raise OpsError(f"layer map row {row} is out of range [0, {self._buffer.shape[1]})")
        self._host_rows = host_rows.reshape(self._buffer.shape)
        self._host_counters = host_counters
        self._host_extra = host_extra

    def record(self, topk_ids: Any, layer_idx: int, expected_rows: int = -1) -> None:
        row = layer_idx
        if self._rows:
            if not 0 <= layer_idx < len(self._rows) or self._rows[layer_idx] < 0:
                raise OpsError(f"MoE layer {layer_idx} is not in the layer map; check "
                               "moe_layer_start_index / first_k_dense_replace")
            row = self._rows[layer_idx]
        if not is_tensor(topk_ids):
            raise OpsError("topk_ids must be a paddle.Tensor")
        index_dtype_of(topk_ids, "topk_ids")
        ids = host_view(topk_ids, "topk_ids")
        if ids.ndim != 2 or ids.shape[1] != self._buffer.shape[2]:
            raise OpsError(f"topk_ids must be [num_tokens, top_k] with top_k = {self._buffer.shape[2]}")
        if ids.shape[0] > self._buffer.shape[0]:
            raise OpsError(f"{ids.shape[0]} tokens exceed the step buffer's {self._buffer.shape[0]} rows")
        if not 0 <= row < self._buffer.shape[1]:
            raise OpsError(f"layer {row} is out of range [0, {self._buffer.shape[1]})")
        if expected_rows >= 0 and ids.shape[0] != expected_rows:
            raise OpsError(f"MoE layer {layer_idx}: {ids.shape[0]} routed rows for {expected_rows} tokens")
        if ids.shape[0] == 0:
            return
        self._counters[0] += ref.record_rows_np(self._buffer, ids, row, self._num_experts)
        self._counters[1 + row] += 1

    def offload(self, num_tokens: int, extra: Any = None) -> None:
        if not 0 <= num_tokens <= self._buffer.shape[0]:
            raise OpsError(f"offload of {num_tokens} rows from a step buffer of {self._buffer.shape[0]}")
        self._host_rows[:num_tokens] = self._buffer[:num_tokens]
        self._host_counters[...] = self._counters
        if extra is not None:
            src = host_view(extra, "extra").reshape(-1).view(np.uint8)
            count = min(src.shape[0], num_tokens * host_view(extra, "extra").itemsize)
            self._host_extra[:count] = src[:count]

    def wait(self) -> None:
        return None

    def fill(self) -> None:
        self._buffer.view(np.uint8)[...] = 0xFF


def bind_step_recorder(buffer: paddle.Tensor, counters: paddle.Tensor, *, num_experts: int,
                       layer_rows: Any = None, host_rows: np.ndarray, host_counters: np.ndarray,
                       host_extra: np.ndarray) -> Any:
    """The per-layer entry point over one step buffer, validated once, here.

    Returns an object with ``record(topk_ids, layer_idx, expected_rows=-1)`` (one MoE
    layer; ``layer_idx`` goes through ``layer_rows`` when given; ``expected_rows >= 0``
    requires that many routed rows), ``offload(num_tokens, extra=None)`` (rows
    ``[0, num_tokens)`` and the counters, plus the first ``num_tokens`` elements of
    ``extra``, into the host arrays: asynchronous on a GPU), ``wait()`` (until that copy
    landed) and ``fill()``.  Compiled: the library's pybind11 ``StepRecorder`` (no Paddle
    op dispatch per call; the host arrays are page-locked on a GPU).  Errors raise
    ``RuntimeError``/``OpsError`` naming the problem.
    """
    _, experts = _check_rows(buffer, paddle.zeros([0, buffer.shape[2]], "int64", device=buffer.place)
                             if eager() else buffer, 0, counters, num_experts)
    shape = list(buffer.shape)
    dtype = routing_dtype_of(buffer, "buffer")
    if host_rows.dtype != dtype or host_rows.shape != (shape[0], shape[1], shape[2]) or \
            not host_rows.flags.c_contiguous:
        raise OpsError(f"host_rows must be a C-contiguous {dtype} array of shape {shape}")
    if host_counters.dtype != np.int64 or host_counters.shape != (shape[1] + 1,):
        raise OpsError(f"host_counters must be int64 [{shape[1] + 1}]")
    if host_extra.dtype != np.uint8 or host_extra.ndim != 1 or not host_extra.flags.c_contiguous:
        raise OpsError("host_extra must be a contiguous 1-D uint8 array")
    rows = [] if layer_rows is None else [int(r) for r in layer_rows]
    if ACTIVE.bound is None:
        return ReferenceStepRecorder(buffer, counters, experts, rows, host_rows, host_counters, host_extra)
    return ACTIVE.bound.StepRecorder(buffer, counters, experts, rows, host_rows.ctypes.data,
                               host_counters.ctypes.data, host_extra.ctypes.data, host_extra.nbytes)


# ---------------------------------------------------------------------------------------
# Host-side step bookkeeping (numpy, one pass each)

def request_packer() -> Any:
    """The library's ``pack_request(cache, block_row, start, length, block_size)`` (a
    finished request's rows straight from its block-table row, custom_ops/step_ledger.cc),
    or None on the reference backend."""
    return getattr(ACTIVE.bound, "pack_request", None)


def count_unrouted(ids: np.ndarray, fill_value: int) -> int:
    """Tokens of a ``[layers, tokens, top_k]`` record with ``fill_value`` (no routing) in
    some layer.  One compiled pass (GIL released) when the fill is the dtype's all-ones
    value, as capture's always is; NumPy otherwise."""
    bound = getattr(ACTIVE.bound, "count_unrouted", None)
    if (bound is not None and ids.ndim == 3 and ids.flags.c_contiguous and ids.dtype in ref.ROUTING_DTYPES
            and int(fill_value) == int(np.iinfo(ids.dtype).max)):
        return int(bound(ids))
    if ids.ndim != 3 or ids.shape[1] == 0:
        return 0
    return int(np.count_nonzero((ids == fill_value).any(axis=(0, 2))))


def bind_step_flush(*, cache: np.ndarray, staging: np.ndarray, extra: np.ndarray,
                    host_counters: np.ndarray, seen: np.ndarray, delta: np.ndarray,
                    columns: np.ndarray | None = None) -> Any:
    """FastDeploy 2.6's worker flush over these arrays, bound once (custom_ops/step_ledger.cc
    ``StepFlush``): ``flush(num_tokens, slots_itemsize, damaged)`` returns ``(written,
    invalid, missing_layers, bad_ids)``; ``columns``: the cache row of each staged layer when
    the cache has more rows.  None on the reference backend."""
    if ACTIVE.bound is None or not hasattr(ACTIVE.bound, "StepFlush"):
        return None
    return ACTIVE.bound.StepFlush(cache=cache, staging=staging, extra=extra, host_counters=host_counters,
                                  seen=seen, delta=delta,
                                  columns=None if columns is None else np.ascontiguousarray(columns, np.int64))


def bind_step_ledger(**arrays: Any) -> Any:
    """The compiled per-step bookkeeping of the table-API manager, or None on the reference
    backend (the manager then takes its NumPy path, which is the reference).

    Keyword arguments are those of the library's ``StepLedger`` (custom_ops/step_ledger.cc):
    ``registered``/``damaged`` bool ``[S]``, ``forwarded`` int64 ``[S]``, scratch ``tokens``
    int64 ``[4, T]`` and ``slots`` int64 ``[4, S]``, ``finished`` int64 ``[S]``, the host
    ``block_table``, ``block_size``, ``max_model_len``, and for the rank that offloads the
    slot ``cache``, the ``staging`` rows and the ``host_counters``/``seen``/``delta`` int64
    ``[1 + L]`` arrays (``cache=None`` elsewhere).  Checked once there; a bad array raises
    ``ValueError`` naming it.
    """
    if ACTIVE.bound is None or not hasattr(ACTIVE.bound, "StepLedger"):
        return None
    return ACTIVE.bound.StepLedger(**arrays)


def plan_step(decoder: np.ndarray, this_time: np.ndarray, tracked: np.ndarray | None,
              block_table: np.ndarray | None, block_size: int) -> tuple[Any, ...]:
    """Slot, position, step-buffer row and KV slot of every tracked token of a step.

    ``decoder`` / ``this_time``: integers per batch slot; ``tracked``: bool per slot (None:
    all); ``block_table``: C-contiguous int32/int64 ``[slots, blocks]`` host array (None:
    KV slots are -1).  Row = the token's index among *all* the step's tokens.  Returns
    int64 ``(batch_ids, positions, rows, kv_slots, active_slots, step_tokens)``.  One pass
    in the compiled library (no per-sequence Python), the vectorised numpy reference
    otherwise.
    """
    if ACTIVE.bound is not None:
        return ACTIVE.bound.step_plan(decoder, this_time, tracked, block_table, int(block_size))
    n = this_time.shape[0]
    return ref.plan_step_np(np.asarray(decoder[:n], np.int64), np.asarray(this_time, np.int64),
                            None if tracked is None else np.asarray(tracked[:n], bool), block_table, block_size)


def scatter_rows(cache: np.ndarray, staging: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> int:
    """``cache[slots[i]] = staging[rows[i]]`` where both indices are in range; returns the count.

    ``cache`` ``[S, L, K]`` and ``staging`` ``[R, L, K]`` C-contiguous of one dtype;
    ``slots`` / ``rows`` int64 (a negative slot is skipped).  One pass, no temporaries.
    """
    if cache.dtype != staging.dtype or cache.shape[1:] != staging.shape[1:]:
        raise OpsError(f"staging {staging.dtype} {list(staging.shape)} does not fit the cache "
                       f"{cache.dtype} {list(cache.shape)}")
    if ACTIVE.bound is not None and cache.flags.c_contiguous and staging.flags.c_contiguous:
        return int(ACTIVE.bound.scatter_rows(cache, staging, slots, rows))
    return ref.scatter_rows_np(cache, staging, np.asarray(slots, np.int64), np.asarray(rows, np.int64))
