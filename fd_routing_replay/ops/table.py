"""The routing-table ops: capture, offload, pack, clear.

The device routing table is ``[max_num_seqs, max_len, num_layers, top_k]`` of the
smallest unsigned dtype that holds ``num_experts + 1`` values (``routing_dtype``); its
maximum is the "no routing" fill (``fill_value``).  Five operations work on it:

* ``record_routing`` — in every MoE layer, right after top-k: write the step's
  ``topk_ids`` into the table (one op call per layer, in place);
* ``gather_routing_rows`` — after the step: the new tokens' rows ``[N, L, K]`` in one
  gather, so the host copy is one device->host transfer;
* ``pack_routing`` — when a request finishes: ``[S, L, K]`` slot cache -> contiguous
  ``[L, T, K]`` record payload (transpose fused into the gather);
* ``clear_routing_rows`` — abort / preempt / slot reuse: refill whole sequences;
* ``new_routing_table`` — a table of a *real* uint16 dtype (Paddle's dtype string
  "uint16" means bfloat16, and its CPU ``full`` has no uint16 kernel).

Each op runs the backend of :mod:`fd_routing_replay.ops.backend` (compiled, or the NumPy
reference on CPU tensors) after :mod:`fd_routing_replay.ops.checks` validated its arguments.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle
from paddle.utils.dlpack import from_dlpack

from fd_routing_replay.errors import OpsError
from fd_routing_replay.ops import reference as ref
from fd_routing_replay.ops.backend import ACTIVE, host_view, run, unified
from fd_routing_replay.ops.checks import (
    check_inplace,
    check_range,
    eager,
    index_array,
    index_dtype_of,
    indices,
    is_tensor,
    layer_and_fill,
    positive_ints,
    routing_dtype_of,
    shape_of,
    tensor,
    vector_len,
)
from fd_routing_replay.ops.dtypes import NP_ROUTING, dtype_text, routing_dtype

__all__ = [
    "SMALL_PACK_BYTES",
    "IndexLike",
    "clear_routing_rows",
    "gather_routing_rows",
    "new_routing_table",
    "pack_routing",
    "record_routing",
    "to_paddle",
]

IndexLike = Any  # paddle.Tensor | np.ndarray | Sequence[int]
_Tensor = paddle.Tensor


def new_routing_table(
    max_num_seqs: int, max_len: int, num_layers: int, top_k: int, num_experts: int, place: Any = None
) -> paddle.Tensor:
    """A ``[max_num_seqs, max_len, num_layers, top_k]`` table filled with the fill value.

    The dtype is ``routing_dtype(num_experts)`` as a real Paddle dtype.  Paddle's CPU
    ``full`` has no uint16/uint32 kernel and the string "uint16" means bfloat16, so the
    table is allocated as bytes of 0xFF (the fill of every routing dtype) and viewed as
    the routing dtype without a copy.  ``place``: a Paddle place or device string; the
    default device when omitted.
    """
    positive_ints(("max_num_seqs", max_num_seqs), ("max_len", max_len),
                  ("num_layers", num_layers), ("top_k", top_k))
    dtype = routing_dtype(num_experts)
    shape = [int(max_num_seqs), int(max_len), int(num_layers), int(top_k) * dtype.itemsize]
    table = paddle.full(shape, 255, dtype=paddle.uint8, device=place)
    return table if dtype.itemsize == 1 else table.view(NP_ROUTING[dtype])


def to_paddle(array: np.ndarray) -> paddle.Tensor:
    """A Paddle-owned CPU copy of a routing array, in its real dtype.

    Not ``from_dlpack``: a Paddle tensor borrowing numpy memory that is later freed on a
    worker thread of Paddle's multi-threaded static executor can deadlock the process
    (its deleter needs the GIL).  ``to_tensor`` would turn uint16 into bfloat16.
    """
    dtype = NP_ROUTING[array.dtype]
    if array.dtype == np.uint8:
        return paddle.to_tensor(np.ascontiguousarray(array))
    if array.size == 0:
        return paddle.to_tensor(array.astype(np.int64)).cast(dtype)
    shape = list(array.shape)
    shape[-1] *= array.dtype.itemsize
    result = paddle.empty(shape, dtype=paddle.uint8).view(dtype)
    np.from_dlpack(result)[...] = array
    return result


# ---------------------------------------------------------------------------------------
# record_routing

def _check_record(
    table: Any, topk_ids: Any, batch: Any, cu: Any, dec: Any, layer: Any, error_count: Any, num_experts: Any
) -> tuple[int, int]:
    """Validate record_routing's arguments; return (layer, num_experts) as ints.

    On the per-layer hot path: every attribute is read once and dtypes are matched by
    identity, so this costs a few microseconds.
    """
    for name, t in (("table", table), ("topk_ids", topk_ids), ("batch_id_per_token", batch),
                    ("cu_seqlens_q", cu), ("seq_lens_decoder", dec), ("error_count", error_count)):
        if type(t) is not _Tensor and not is_tensor(t):
            raise OpsError(f"{name} must be a paddle.Tensor, got {type(t).__name__}")
    dtype = routing_dtype_of(table, "table")
    shape = table.shape
    if len(shape) != 4:
        raise OpsError(f"table must be 4-D [max_num_seqs, max_len, num_layers, top_k], got shape {list(shape)}")
    ids_shape = topk_ids.shape
    if len(ids_shape) != 2:
        raise OpsError(f"topk_ids must be 2-D [num_tokens, top_k], got shape {list(ids_shape)}")
    index_dtype_of(topk_ids, "topk_ids")
    if ids_shape[1] != shape[3] and min(ids_shape[1], shape[3]) >= 0:
        raise OpsError(f"topk_ids has top_k={ids_shape[1]} but the table has top_k={shape[3]}")
    index_dtype = index_dtype_of(batch, "batch_id_per_token")
    num_tokens = vector_len(batch, "batch_id_per_token")
    if num_tokens != ids_shape[0] and min(num_tokens, ids_shape[0]) >= 0:
        raise OpsError(f"batch_id_per_token has {num_tokens} tokens but topk_ids has {ids_shape[0]}")
    for name, t in (("cu_seqlens_q", cu), ("seq_lens_decoder", dec)):
        vector_len(t, name)
        other = t.dtype
        if other is not index_dtype and other != index_dtype:
            raise OpsError(
                f"{name} is {dtype_text(other)} but batch_id_per_token is {dtype_text(index_dtype)}; "
                "the three index tensors must share one dtype"
            )
    count_dtype = error_count.dtype
    count_shape = error_count.shape
    if (count_dtype is not paddle.int64 and count_dtype != paddle.int64) or len(count_shape) > 1 or (
        count_shape and count_shape[0] != 1
    ):
        raise OpsError(
            f"error_count must be an int64 tensor of shape [] or [1], got {dtype_text(count_dtype)} {list(count_shape)}"
        )
    check_inplace(table, "table")
    check_inplace(error_count, "error_count")
    return layer_and_fill(layer, shape[2], dtype, num_experts)


@unified
def record_routing(
    table: paddle.Tensor,
    topk_ids: paddle.Tensor,
    batch_id_per_token: paddle.Tensor,
    cu_seqlens_q: paddle.Tensor,
    seq_lens_decoder: paddle.Tensor,
    layer: int,
    error_count: paddle.Tensor,
    *,
    num_experts: int | None = None,
) -> None:
    """Write one MoE layer's ``topk_ids`` into ``table[b, p, layer, :]``, in place.

    Token ``t`` belongs to sequence ``b = batch_id_per_token[t]`` (``-1``: padding) at
    position ``p = seq_lens_decoder[b] + t - cu_seqlens_q[b]``.  Tokens whose ``b`` or
    ``p`` falls outside the table are skipped; an id outside ``[0, num_experts)``
    (default: anything below the fill value) is written as the fill and counted in
    ``error_count`` (an int64 tensor of one element) — it never fails the engine step.
    ``topk_ids`` is int32 or int64 ``[T, top_k]``; the three index tensors share one
    dtype (int32 or int64) and may be ``[n]`` or ``[n, 1]``.
    """
    layer, experts = _check_record(
        table, topk_ids, batch_id_per_token, cu_seqlens_q, seq_lens_decoder, layer, error_count, num_experts
    )
    if ACTIVE.name == "compiled":
        run("fdrr_record_routing_", table, topk_ids, batch_id_per_token, cu_seqlens_q,
            seq_lens_decoder, error_count, layer, experts)
        return
    errors = ref.record_routing_np(
        host_view(table, "table"), host_view(topk_ids, "topk_ids"),
        host_view(batch_id_per_token, "batch_id_per_token"), host_view(cu_seqlens_q, "cu_seqlens_q"),
        host_view(seq_lens_decoder, "seq_lens_decoder"), layer, experts,
    )
    if errors:
        host_view(error_count, "error_count")[...] += errors


# ---------------------------------------------------------------------------------------
# pack_routing

SMALL_PACK_BYTES = 1 << 20
"""Packs below this size keep the GIL (microseconds of copying; releasing it would let
another thread take it and make the engine's thread wait for its return)."""


@unified
def pack_routing(source: Any, slots: IndexLike, out: Any = None) -> Any:
    """Gather a finished request's rows: ``out[l, t, :] = source[slots[t], l, :]``.

    ``source`` is the slot-indexed cache ``[S, L, K]`` (uint8/uint16/uint32) as a numpy
    array or a Paddle tensor; ``slots`` the request's KV-cache slots in token order
    (int32/int64; repeats allowed); ``out`` an optional ``[L, T, K]`` destination of
    the same kind and dtype.  Returns ``out`` (or a new array/tensor).  A slot outside
    ``[0, S)`` raises ``OpsError`` before anything is written.

    Numpy inputs (C-contiguous ``source``) run the compiled kernel in place on their
    buffers through the library's C entry point (ctypes, GIL released; zero-copy DLPack
    views and the Paddle op when that entry is unavailable).  With the reference
    backend, or a non-contiguous ``source``, they take the vectorised numpy path
    (``np.take`` + one transposed copy).  Packs of 4 MiB and more use up to
    ``$FD_RR_OPS_THREADS`` (default 4) threads in the compiled kernel.
    """
    if isinstance(source, np.ndarray):
        return _pack_numpy(source, slots, out)
    if is_tensor(source):
        return _pack_paddle(source, slots, out)
    raise OpsError(f"source must be a numpy array or a paddle.Tensor, got {type(source).__name__}")


def _pack_numpy(source: np.ndarray, slots: IndexLike, out: np.ndarray | None) -> np.ndarray:
    """pack_routing on numpy arrays: the C entry, else the Paddle op, else numpy."""
    if source.dtype not in ref.ROUTING_DTYPES:
        raise OpsError(f"source must be uint8, uint16 or uint32, got {source.dtype}")
    if source.ndim != 3:
        raise OpsError(f"source must be 3-D [num_slots, num_layers, top_k], got shape {list(source.shape)}")
    index = index_array(slots, "slots")
    num_slots, num_layers, top_k = source.shape
    expected = (num_layers, index.shape[0], top_k)
    if out is None:
        out = np.empty(expected, dtype=source.dtype)
    else:
        if not isinstance(out, np.ndarray):
            raise OpsError(f"out must be a numpy array when source is one, got {type(out).__name__}")
        if out.dtype != source.dtype:
            raise OpsError(f"out dtype {out.dtype} differs from source dtype {source.dtype}")
        if out.shape != expected:
            raise OpsError(f"out must have shape {list(expected)}, got {list(out.shape)}")
        if not (out.flags.c_contiguous and out.flags.writeable):
            raise OpsError("out must be a writeable C-contiguous array")
    host_pack = ACTIVE.host_pack  # read per call: a test may switch the C entry off
    if host_pack is not None and ACTIVE.host_pack_small is not None and out.nbytes < SMALL_PACK_BYTES:
        host_pack = ACTIVE.host_pack_small   # cheaper than a GIL round trip (and its wait)
    if out.size and host_pack is not None and source.flags.c_contiguous:
        # The compiled kernel straight on the numpy buffers (ctypes, GIL released); it
        # checks every slot before writing anything.
        index = np.ascontiguousarray(index)
        status = host_pack(source.ctypes.data, num_slots, num_layers, top_k, source.itemsize,
                           index.ctypes.data, index.itemsize, index.shape[0], out.ctypes.data)
        if status == -1:
            return out
        if status >= 0:
            raise OpsError(f"slots[{status}] = {int(index[status])} is out of range [0, {num_slots})")
        # -2 / -3: an unsupported size or a failure inside: the paths below still work
    check_range(index, num_slots, "slots")
    if out.size == 0:
        return out
    if ACTIVE.name == "compiled" and source.flags.c_contiguous:
        # Zero-copy DLPack wrappers, alive only for this call and freed on this thread.
        try:
            views = (from_dlpack(out), from_dlpack(source), from_dlpack(np.ascontiguousarray(index)))
        except (BufferError, TypeError, ValueError, RuntimeError):
            views = None  # this numpy/Paddle pair cannot share the buffers: numpy path
        if views is not None:
            run("fdrr_pack_routing_into_", *views)
            return out
    return ref.pack_routing_np(source, index, out)


def _pack_paddle(source: Any, slots: IndexLike, out: Any) -> Any:
    """pack_routing on Paddle tensors: the compiled op, else numpy on CPU views."""
    routing_dtype_of(source, "source")
    shape = shape_of(source, "source", 3)
    (index,) = indices(source.place if eager() else None, (slots, "slots", shape[0]))
    if out is not None:
        tensor(out, "out")
        if out.dtype != source.dtype:
            raise OpsError(f"out dtype {dtype_text(out.dtype)} differs from source dtype {dtype_text(source.dtype)}")
        expected = [shape[1], index.shape[0], shape[2]]
        if list(out.shape) != expected:
            raise OpsError(f"out must have shape {expected}, got {list(out.shape)}")
        check_inplace(out, "out")
    if ACTIVE.name == "compiled":
        if out is None:
            return run("fdrr_pack_routing", source, index)[0]
        return run("fdrr_pack_routing_into_", out, source, index)[0]
    result = ref.pack_routing_np(
        host_view(source, "source"), np.from_dlpack(index), None if out is None else host_view(out, "out")
    )
    return out if out is not None else to_paddle(result)


# ---------------------------------------------------------------------------------------
# gather_routing_rows / clear_routing_rows

@unified
def gather_routing_rows(table: paddle.Tensor, batch_ids: IndexLike, positions: IndexLike) -> paddle.Tensor:
    """Rows ``table[batch_ids[i], positions[i], :, :]`` as a new ``[N, L, K]`` tensor.

    The per-step offload: one gather of this step's tokens on the table's device, then
    one device->host copy of the result, instead of one copy per sequence.  Index
    tensors are int32/int64 (numpy arrays and sequences are copied to the table's
    place); an index out of range raises ``OpsError`` before anything is written.
    """
    routing_dtype_of(tensor(table, "table"), "table")
    shape = shape_of(table, "table", 4)
    place = table.place if eager() else None
    b, p = indices(place, (batch_ids, "batch_ids", shape[0]), (positions, "positions", shape[1]))
    if b.shape[0] != p.shape[0] and min(b.shape[0], p.shape[0]) >= 0:
        raise OpsError(f"batch_ids has {b.shape[0]} entries but positions has {p.shape[0]}")
    if ACTIVE.name == "compiled":
        return run("fdrr_gather_routing_rows", table, b, p)[0]
    rows = ref.gather_routing_rows_np(host_view(table, "table"), np.from_dlpack(b), np.from_dlpack(p))
    return to_paddle(rows)


@unified
def clear_routing_rows(table: paddle.Tensor, batch_ids: IndexLike) -> None:
    """Refill whole sequences ``table[batch_ids[i]]`` with the fill value, in place.

    Used when a request is aborted or preempted and before a slot is reused.  Works for
    every routing dtype, including a real uint16 (whose Paddle CPU ``fill_`` would go
    through bfloat16).  A batch id out of range raises ``OpsError`` before any write.
    """
    routing_dtype_of(tensor(table, "table"), "table")
    shape = shape_of(table, "table", 4)
    check_inplace(table, "table")
    (b,) = indices(table.place if eager() else None, (batch_ids, "batch_ids", shape[0]))
    if ACTIVE.name == "compiled":
        run("fdrr_clear_routing_rows_", table, b)
        return
    ref.clear_routing_rows_np(host_view(table, "table"), np.from_dlpack(b))
