"""Python face of the routing custom ops: capture, offload, pack, clear.

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

Backends: the compiled ops (custom_ops/, loaded at import by ops_loader: the
ahead-of-time build, else a JIT build) or, when they cannot load, the numpy reference
in ops_reference (CPU tensors only) — with one warning that says why.  Set
``FD_RR_OPS=reference`` to force the reference, ``FD_RR_OPS=compiled`` to make a missing
build an import error.  Arguments are validated here, before any op runs; every
problem is an ``OpsError`` naming the argument.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import paddle
from paddle import _C_ops
from paddle.utils.dlpack import from_dlpack

from fd_routing_replay import codec
from fd_routing_replay import ops_reference as ref
from fd_routing_replay.errors import OpsError, RecordError
from fd_routing_replay.ops_loader import bound_module, host_pack_function, load_ops

try:  # marks functions that already work in dygraph and static mode (no re-tracing)
    from paddle.jit.marker import unified
except ImportError:  # pragma: no cover - older Paddle
    def unified(fn):  # type: ignore[no-redef]
        return fn

__all__ = [
    "bind_step_recorder",
    "clear_routing_rows",
    "fill_value",
    "gather_routing_rows",
    "new_routing_table",
    "new_step_buffer",
    "ops_backend",
    "ops_backend_reason",
    "pack_routing",
    "plan_step",
    "record_routing",
    "record_rows",
    "routing_dtype",
    "scatter_rows",
]


class _DtypeMap:
    """Paddle dtype -> value.  Paddle dtypes are singletons, so an identity lookup
    (~0.1 us) answers the hot path; equality (~1 us per compare) is the fallback."""

    def __init__(self, items: dict[Any, Any]) -> None:
        self._by_eq = dict(items)
        self._by_id = {id(k): v for k, v in items.items()}

    def get(self, dtype: Any) -> Any:
        value = self._by_id.get(id(dtype))
        return self._by_eq.get(dtype) if value is None else value


_PD_ROUTING = _DtypeMap({paddle.uint8: np.dtype(np.uint8), paddle.uint16: np.dtype(np.uint16),
                         paddle.uint32: np.dtype(np.uint32)})
_NP_ROUTING = {np.dtype(np.uint8): paddle.uint8, np.dtype(np.uint16): paddle.uint16,
               np.dtype(np.uint32): paddle.uint32}
_PD_INDEX = _DtypeMap({paddle.int32: np.dtype(np.int32), paddle.int64: np.dtype(np.int64)})
_NP_INDEX = (np.dtype(np.int32), np.dtype(np.int64))
_FILL = {dtype: ref.fill_of(dtype) for dtype in ref.ROUTING_DTYPES}
IndexLike = Any  # paddle.Tensor | np.ndarray | Sequence[int]


# ---------------------------------------------------------------------------------------
# Backend selection (once, at import)

def _select_backend() -> tuple[str, str, Path | None]:
    mode = os.environ.get("FD_RR_OPS", "auto").strip().lower() or "auto"
    if mode not in ("auto", "compiled", "reference"):
        raise OpsError(f"FD_RR_OPS={mode!r} is not one of 'auto', 'compiled', 'reference'")
    if mode == "reference":
        reason = "forced by FD_RR_OPS=reference"
    else:
        result = load_ops()
        if result.loaded:
            return "compiled", result.reason, result.library
        if mode == "compiled":
            raise OpsError(f"FD_RR_OPS=compiled but the compiled routing ops cannot load: {result.reason}")
        reason = result.reason
    warnings.warn(
        "fd_routing_replay: using the numpy reference routing ops (slower, CPU tensors only) "
        f"instead of the compiled ones: {reason}",
        RuntimeWarning,
        stacklevel=3,
    )
    return "reference", reason, None


_BACKEND, _BACKEND_REASON, _LIBRARY = _select_backend()
_HOST_PACK = host_pack_function(_LIBRARY) if _BACKEND == "compiled" else None
_BOUND, _BOUND_REASON = bound_module(_LIBRARY) if _BACKEND == "compiled" else (None, "reference backend")


def ops_backend() -> str:
    """``"compiled"`` or ``"reference"``: which implementation the ops use in this process."""
    return _BACKEND


def ops_backend_reason() -> str:
    """Why ``ops_backend()`` is what it is (which library was loaded, or what failed)."""
    return _BACKEND_REASON


def bound_backend() -> str:
    """``"bound"`` (the library's pybind11 entry points) or ``"reference"``, and why."""
    return "bound" if _BOUND is not None else f"reference ({_BOUND_REASON})"


# ---------------------------------------------------------------------------------------
# Dtypes and tables

def routing_dtype(num_experts: int) -> np.dtype:
    """Smallest of uint8/uint16/uint32 holding ``num_experts + 1`` values (ids + fill)."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) or num_experts < 1:
        raise OpsError(f"num_experts must be a positive integer, got {num_experts!r}")
    try:  # the record format owns the dtype rule; the table must match the records
        return codec.routing_dtype(int(num_experts))
    except RecordError as exc:
        raise OpsError(f"num_experts={num_experts}: {exc}") from exc


def _as_routing_np_dtype(dtype: Any, name: str = "dtype") -> np.dtype:
    np_dtype = _PD_ROUTING.get(dtype)  # paddle dtype objects (the real uint16, not the string)
    if np_dtype is not None:
        return np_dtype
    try:
        np_dtype = np.dtype(dtype)
    except TypeError as exc:
        raise OpsError(f"{name} {dtype!r} is not a routing dtype (uint8, uint16, uint32)") from exc
    if np_dtype not in ref.ROUTING_DTYPES:
        raise OpsError(f"{name} {np_dtype} is not a routing dtype (uint8, uint16, uint32)")
    return np_dtype


def fill_value(dtype: Any) -> int:
    """The table's "no routing" value for a routing dtype: its maximum, all bits set.

    FastDeploy pads with -1 cast to the dtype, which is the same value.
    """
    return ref.fill_of(_as_routing_np_dtype(dtype))


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
    for name, value in (("max_num_seqs", max_num_seqs), ("max_len", max_len),
                        ("num_layers", num_layers), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise OpsError(f"{name} must be a positive integer, got {value!r}")
    dtype = routing_dtype(num_experts)
    shape = [int(max_num_seqs), int(max_len), int(num_layers), int(top_k) * dtype.itemsize]
    table = paddle.full(shape, 255, dtype=paddle.uint8, device=place)
    return table if dtype.itemsize == 1 else table.view(_NP_ROUTING[dtype])


def new_step_buffer(max_tokens: int, num_layers: int, top_k: int, num_experts: int,
                    place: Any = None) -> paddle.Tensor:
    """The token-major step buffer ``[max_tokens, num_layers, top_k]``, filled.

    Row ``t`` holds token ``t`` of the current step for every MoE layer (FastDeploy 2.6's
    and vLLM's layout); same dtype and fill rules as :func:`new_routing_table`.
    """
    for name, value in (("max_tokens", max_tokens), ("num_layers", num_layers), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise OpsError(f"{name} must be a positive integer, got {value!r}")
    dtype = routing_dtype(num_experts)
    shape = [int(max_tokens), int(num_layers), int(top_k) * dtype.itemsize]
    buffer = paddle.full(shape, 255, dtype=paddle.uint8, device=place)   # 0xFF: the fill of every dtype
    return buffer if dtype.itemsize == 1 else buffer.view(_NP_ROUTING[dtype])


# ---------------------------------------------------------------------------------------
# Validation helpers

_Tensor = paddle.Tensor


def _is_tensor(x: Any) -> bool:
    return isinstance(x, (paddle.Tensor, paddle.pir.Value))


def _eager() -> bool:
    return paddle.in_dynamic_mode()


def _dtype_text(dtype: Any) -> str:
    if dtype == paddle.uint16:
        return "uint16"
    if dtype == paddle.bfloat16:
        return "bfloat16 (Paddle's dtype string 'uint16' means bfloat16; use new_routing_table)"
    return str(dtype).replace("paddle.", "")


def _tensor(x: Any, name: str) -> Any:
    if not _is_tensor(x):
        raise OpsError(f"{name} must be a paddle.Tensor, got {type(x).__name__}")
    return x


def _routing_dtype_of(t: Any, name: str) -> np.dtype:
    dtype = _PD_ROUTING.get(t.dtype)
    if dtype is None:
        if not _eager() and t.dtype == paddle.bfloat16:
            # A static graph declares a real uint16 input as bfloat16 (Paddle's dtype
            # mapping); the op checks the runtime dtype, so let it through here.
            return np.dtype(np.uint16)
        raise OpsError(f"{name} must be uint8, uint16 or uint32, got {_dtype_text(t.dtype)}")
    return dtype


def _shape(t: Any, name: str, rank: int) -> list[int]:
    shape = list(t.shape)
    if len(shape) != rank:
        raise OpsError(f"{name} must be {rank}-D, got shape {shape}")
    return shape


def _vector_len(t: Any, name: str) -> int:
    """Length of a 1-D tensor, also accepting FastDeploy's ``[n, 1]`` column layout."""
    shape = list(t.shape)
    if len(shape) == 1 or (len(shape) == 2 and shape[1] == 1):
        return shape[0]
    raise OpsError(f"{name} must be 1-D (or [n, 1]), got shape {shape}")


def _index_dtype_of(t: Any, name: str) -> Any:
    dtype = t.dtype
    if _PD_INDEX.get(dtype) is None:
        raise OpsError(f"{name} must be int32 or int64, got {_dtype_text(dtype)}")
    return dtype


def _check_inplace(t: Any, name: str) -> None:
    """An in-place target must be contiguous: Paddle hands a custom op a contiguous copy
    of a strided view, so the writes would land in a temporary and be lost."""
    if type(t) is _Tensor and not t.is_contiguous():
        raise OpsError(f"{name} must be contiguous: an op writing into a strided view would write into a copy")


def _check_int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise OpsError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value < high:
        raise OpsError(f"{name}={value} is out of range [{low}, {high})")
    return int(value)


def _check_range(index: np.ndarray, bound: int, name: str) -> None:
    bad = np.flatnonzero((index < 0) | (index >= bound))
    if bad.size:
        i = int(bad[0])
        raise OpsError(f"{name}[{i}] = {int(index[i])} is out of range [0, {bound})")


def _host_view(t: paddle.Tensor, name: str) -> np.ndarray:
    """Zero-copy numpy view of a CPU tensor (the reference backend works on these)."""
    if not t.place.is_cpu_place():
        raise OpsError(
            f"{name} is on {t.place}, but the reference routing ops run on CPU tensors only "
            f"(compiled ops unavailable: {_BACKEND_REASON})"
        )
    return np.from_dlpack(t)


def _to_paddle(array: np.ndarray) -> paddle.Tensor:
    """A Paddle-owned CPU copy of a routing array, in its real dtype.

    Not ``from_dlpack``: a Paddle tensor borrowing numpy memory that is later freed on a
    worker thread of Paddle's multi-threaded static executor can deadlock the process
    (its deleter needs the GIL).  ``to_tensor`` would turn uint16 into bfloat16.
    """
    dtype = _NP_ROUTING[array.dtype]
    if array.dtype == np.uint8:
        return paddle.to_tensor(np.ascontiguousarray(array))
    if array.size == 0:
        return paddle.to_tensor(array.astype(np.int64)).cast(dtype)
    shape = list(array.shape)
    shape[-1] *= array.dtype.itemsize
    tensor = paddle.empty(shape, dtype=paddle.uint8).view(dtype)
    np.from_dlpack(tensor)[...] = array
    return tensor


def _index_array(x: Any, name: str) -> np.ndarray:
    """Host int32/int64 1-D array from a numpy array, a sequence or a CPU tensor."""
    if _is_tensor(x):
        _index_dtype_of(x, name)
        _vector_len(x, name)
        arr = np.from_dlpack(x) if x.place.is_cpu_place() else x.numpy()
        return arr.reshape(-1)
    arr = np.asarray(x)
    if arr.size == 0 and arr.dtype not in _NP_INDEX:
        arr = arr.astype(np.int64)
    if arr.dtype not in _NP_INDEX:
        if isinstance(x, np.ndarray) or arr.dtype.kind not in "iu":
            raise OpsError(f"{name} must hold int32 or int64 indices, got dtype {arr.dtype}")
        arr = arr.astype(np.int64)
    if arr.ndim != 1:
        raise OpsError(f"{name} must be 1-D, got shape {list(arr.shape)}")
    return arr


def _indices(place: Any, *specs: tuple[Any, str, int]) -> list[Any]:
    """Index arguments ``(value, name, bound)`` as 1-D int32/int64 tensors on ``place``.

    Tensors are used as they are (all of one dtype); numpy arrays and sequences are
    checked against ``[0, bound)`` here and copied to ``place`` together, in one
    transfer.  In eager mode a CPU index tensor is range-checked here too; device
    indices are checked by the op before it writes anything.
    """
    tensors: dict[int, Any] = {}
    host: dict[int, np.ndarray] = {}
    for i, (value, name, bound) in enumerate(specs):
        if _is_tensor(value):
            _index_dtype_of(value, name)
            if len(value.shape) != 1:
                raise OpsError(f"{name} must be 1-D, got shape {list(value.shape)}")
            if _eager() and value.place.is_cpu_place():
                _check_range(np.from_dlpack(value), bound, name)
            tensors[i] = value
        elif not _eager():
            raise OpsError(f"{name} must be a tensor inside a static graph, got {type(value).__name__}")
        else:
            host[i] = _index_array(value, name)
            _check_range(host[i], bound, name)
    first = next(iter(tensors.values()), None)
    for t in tensors.values():
        if t.dtype is not first.dtype and t.dtype != first.dtype:
            names = ", ".join(f"{specs[i][1]} {_dtype_text(u.dtype)}" for i, u in tensors.items())
            raise OpsError(f"index tensors must share one dtype, got {names}")
    if host:
        if first is not None:
            np_dtype = _PD_INDEX.get(first.dtype)
        else:
            np_dtype = np.dtype(np.int64) if any(a.dtype == np.int64 for a in host.values()) else np.dtype(np.int32)
        lengths = {a.shape[0] for a in host.values()}
        if len(host) > 1 and len(lengths) == 1:  # one host->device copy for all of them
            stacked = paddle.Tensor(np.stack([host[i].astype(np_dtype, copy=False) for i in host]), place)
            for row, i in enumerate(host):
                tensors[i] = stacked[row]
        else:
            for i, arr in host.items():
                tensors[i] = paddle.Tensor(np.ascontiguousarray(arr, dtype=np_dtype), place)
    return [tensors[i] for i in range(len(specs))]


def _run(op: str, *args: Any) -> Any:
    """Call a compiled op, turning its "fdrr: ..." errors into OpsError."""
    try:
        return _C_ops._run_custom_op(op, *args)
    except (OSError, RuntimeError, ValueError) as exc:
        text = str(exc)
        if "fdrr:" not in text:
            raise
        raise OpsError(text.split("fdrr:", 1)[1].splitlines()[0].strip()) from exc


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
        if type(t) is not _Tensor and not _is_tensor(t):
            raise OpsError(f"{name} must be a paddle.Tensor, got {type(t).__name__}")
    dtype = _routing_dtype_of(table, "table")
    shape = table.shape
    if len(shape) != 4:
        raise OpsError(f"table must be 4-D [max_num_seqs, max_len, num_layers, top_k], got shape {list(shape)}")
    ids_shape = topk_ids.shape
    if len(ids_shape) != 2:
        raise OpsError(f"topk_ids must be 2-D [num_tokens, top_k], got shape {list(ids_shape)}")
    _index_dtype_of(topk_ids, "topk_ids")
    if ids_shape[1] != shape[3] and min(ids_shape[1], shape[3]) >= 0:
        raise OpsError(f"topk_ids has top_k={ids_shape[1]} but the table has top_k={shape[3]}")
    index_dtype = _index_dtype_of(batch, "batch_id_per_token")
    num_tokens = _vector_len(batch, "batch_id_per_token")
    if num_tokens != ids_shape[0] and min(num_tokens, ids_shape[0]) >= 0:
        raise OpsError(f"batch_id_per_token has {num_tokens} tokens but topk_ids has {ids_shape[0]}")
    for name, t in (("cu_seqlens_q", cu), ("seq_lens_decoder", dec)):
        _vector_len(t, name)
        other = t.dtype
        if other is not index_dtype and other != index_dtype:
            raise OpsError(
                f"{name} is {_dtype_text(other)} but batch_id_per_token is {_dtype_text(index_dtype)}; "
                "the three index tensors must share one dtype"
            )
    count_dtype = error_count.dtype
    count_shape = error_count.shape
    if (count_dtype is not paddle.int64 and count_dtype != paddle.int64) or len(count_shape) > 1 or (
        count_shape and count_shape[0] != 1
    ):
        raise OpsError(
            f"error_count must be an int64 tensor of shape [] or [1], got {_dtype_text(count_dtype)} {list(count_shape)}"
        )
    _check_inplace(table, "table")
    _check_inplace(error_count, "error_count")
    return _layer_and_fill(layer, shape[2], dtype, num_experts)


def _layer_and_fill(layer: Any, num_layers: int, dtype: Any, num_experts: Any) -> tuple[int, int]:
    """The validated layer index (below ``num_layers`` when known, i.e. >= 0) and the
    expert-id bound: ``num_experts``, or the dtype's fill value when it is not given."""
    layer = _check_int(layer, "layer", 0, num_layers if num_layers >= 0 else 2**62)
    fill = _FILL[dtype]
    return layer, fill if num_experts is None else _check_int(num_experts, "num_experts", 0, fill + 1)


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
    if _BACKEND == "compiled":
        _run("fdrr_record_routing_", table, topk_ids, batch_id_per_token, cu_seqlens_q,
             seq_lens_decoder, error_count, layer, experts)
        return
    errors = ref.record_routing_np(
        _host_view(table, "table"), _host_view(topk_ids, "topk_ids"),
        _host_view(batch_id_per_token, "batch_id_per_token"), _host_view(cu_seqlens_q, "cu_seqlens_q"),
        _host_view(seq_lens_decoder, "seq_lens_decoder"), layer, experts,
    )
    if errors:
        _host_view(error_count, "error_count")[...] += errors


# ---------------------------------------------------------------------------------------
# pack_routing

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
    if _is_tensor(source):
        return _pack_paddle(source, slots, out)
    raise OpsError(f"source must be a numpy array or a paddle.Tensor, got {type(source).__name__}")


def _pack_numpy(source: np.ndarray, slots: IndexLike, out: np.ndarray | None) -> np.ndarray:
    if source.dtype not in ref.ROUTING_DTYPES:
        raise OpsError(f"source must be uint8, uint16 or uint32, got {source.dtype}")
    if source.ndim != 3:
        raise OpsError(f"source must be 3-D [num_slots, num_layers, top_k], got shape {list(source.shape)}")
    index = _index_array(slots, "slots")
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
    if out.size and _HOST_PACK is not None and source.flags.c_contiguous:
        # The compiled kernel straight on the numpy buffers (ctypes, GIL released); it
        # checks every slot before writing anything.
        index = np.ascontiguousarray(index)
        status = _HOST_PACK(source.ctypes.data, num_slots, num_layers, top_k, source.itemsize,
                            index.ctypes.data, index.itemsize, index.shape[0], out.ctypes.data)
        if status == -1:
            return out
        if status >= 0:
            raise OpsError(f"slots[{status}] = {int(index[status])} is out of range [0, {num_slots})")
        # -2 / -3: an unsupported size or a failure inside: the paths below still work
    _check_range(index, num_slots, "slots")
    if out.size == 0:
        return out
    if _BACKEND == "compiled" and source.flags.c_contiguous:
        # Zero-copy DLPack wrappers, alive only for this call and freed on this thread.
        try:
            views = (from_dlpack(out), from_dlpack(source), from_dlpack(np.ascontiguousarray(index)))
        except (BufferError, TypeError, ValueError, RuntimeError):
            views = None  # this numpy/Paddle pair cannot share the buffers: numpy path
        if views is not None:
            _run("fdrr_pack_routing_into_", *views)
            return out
    return ref.pack_routing_np(source, index, out)


def _pack_paddle(source: Any, slots: IndexLike, out: Any) -> Any:
    _routing_dtype_of(source, "source")
    shape = _shape(source, "source", 3)
    (index,) = _indices(source.place if _eager() else None, (slots, "slots", shape[0]))
    if out is not None:
        _tensor(out, "out")
        if out.dtype != source.dtype:
            raise OpsError(f"out dtype {_dtype_text(out.dtype)} differs from source dtype {_dtype_text(source.dtype)}")
        expected = [shape[1], index.shape[0], shape[2]]
        if list(out.shape) != expected:
            raise OpsError(f"out must have shape {expected}, got {list(out.shape)}")
        _check_inplace(out, "out")
    if _BACKEND == "compiled":
        if out is None:
            return _run("fdrr_pack_routing", source, index)[0]
        return _run("fdrr_pack_routing_into_", out, source, index)[0]
    result = ref.pack_routing_np(
        _host_view(source, "source"), np.from_dlpack(index), None if out is None else _host_view(out, "out")
    )
    return out if out is not None else _to_paddle(result)


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
    _routing_dtype_of(_tensor(table, "table"), "table")
    shape = _shape(table, "table", 4)
    place = table.place if _eager() else None
    b, p = _indices(place, (batch_ids, "batch_ids", shape[0]), (positions, "positions", shape[1]))
    if b.shape[0] != p.shape[0] and min(b.shape[0], p.shape[0]) >= 0:
        raise OpsError(f"batch_ids has {b.shape[0]} entries but positions has {p.shape[0]}")
    if _BACKEND == "compiled":
        return _run("fdrr_gather_routing_rows", table, b, p)[0]
    rows = ref.gather_routing_rows_np(_host_view(table, "table"), np.from_dlpack(b), np.from_dlpack(p))
    return _to_paddle(rows)


@unified
def clear_routing_rows(table: paddle.Tensor, batch_ids: IndexLike) -> None:
    """Refill whole sequences ``table[batch_ids[i]]`` with the fill value, in place.

    Used when a request is aborted or preempted and before a slot is reused.  Works for
    every routing dtype, including a real uint16 (whose Paddle CPU ``fill_`` would go
    through bfloat16).  A batch id out of range raises ``OpsError`` before any write.
    """
    _routing_dtype_of(_tensor(table, "table"), "table")
    shape = _shape(table, "table", 4)
    _check_inplace(table, "table")
    (b,) = _indices(table.place if _eager() else None, (batch_ids, "batch_ids", shape[0]))
    if _BACKEND == "compiled":
        _run("fdrr_clear_routing_rows_", table, b)
        return
    ref.clear_routing_rows_np(_host_view(table, "table"), np.from_dlpack(b))


# The token-major step buffer's ops (record_rows, the bound recorder, the step plan and
# scatter) live in ops_step; imported last, once every helper above exists.
from fd_routing_replay.ops_step import (  # noqa: E402, F401  (re-exported)
    _ReferenceStepRecorder,
    bind_step_recorder,
    plan_step,
    record_rows,
    scatter_rows,
)
