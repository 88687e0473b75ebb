"""Argument checks of the routing ops, run before any op does.

Every problem is an ``OpsError`` naming the argument.  Index arguments may be tensors,
NumPy arrays or sequences; :func:`indices` turns them into tensors on the op's place
(host indices range-checked here, in one host->device copy).  Some checks sit on the
per-layer hot path, so they read each attribute once and match dtypes by identity.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle

from fd_routing_replay.errors import OpsError
from fd_routing_replay.ops.dtypes import FILL, NP_INDEX, PD_INDEX, PD_ROUTING, dtype_text

__all__ = [
    "check_inplace",
    "check_int",
    "check_range",
    "eager",
    "index_array",
    "index_dtype_of",
    "indices",
    "is_tensor",
    "layer_and_fill",
    "positive_ints",
    "routing_dtype_of",
    "shape_of",
    "tensor",
    "vector_len",
]

_Tensor = paddle.Tensor


def is_tensor(x: Any) -> bool:
    """Whether ``x`` is a Paddle tensor (eager) or a static-graph value."""
    return isinstance(x, (paddle.Tensor, paddle.pir.Value))


def eager() -> bool:
    """Whether Paddle runs in dygraph (eager) mode, where values can be inspected."""
    return paddle.in_dynamic_mode()


def tensor(x: Any, name: str) -> Any:
    """``x``, or ``OpsError`` when it is not a tensor."""
    if not is_tensor(x):
        raise OpsError(f"{name} must be a paddle.Tensor, got {type(x).__name__}")
    return x


def positive_ints(*specs: tuple[str, Any]) -> None:
    """``OpsError`` for the first ``(name, value)`` that is not a positive int."""
    for name, value in specs:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise OpsError(f"{name} must be a positive integer, got {value!r}")


def routing_dtype_of(t: Any, name: str) -> np.dtype:
    """The NumPy routing dtype of tensor ``t`` (uint8/uint16/uint32), else ``OpsError``."""
    dtype = PD_ROUTING.get(t.dtype)
    if dtype is None:
        if not eager() and t.dtype == paddle.bfloat16:
            # A static graph declares a real uint16 input as bfloat16 (Paddle's dtype
            # mapping); the op checks the runtime dtype, so let it through here.
            return np.dtype(np.uint16)
        raise OpsError(f"{name} must be uint8, uint16 or uint32, got {dtype_text(t.dtype)}")
    return dtype


def shape_of(t: Any, name: str, rank: int) -> list[int]:
    """The shape of ``t`` as a list, which must have ``rank`` dimensions."""
    shape = list(t.shape)
    if len(shape) != rank:
        raise OpsError(f"{name} must be {rank}-D, got shape {shape}")
    return shape


def vector_len(t: Any, name: str) -> int:
    """Length of a 1-D tensor, also accepting FastDeploy's ``[n, 1]`` column layout."""
    shape = list(t.shape)
    if len(shape) == 1 or (len(shape) == 2 and shape[1] == 1):
        return shape[0]
    raise OpsError(f"{name} must be 1-D (or [n, 1]), got shape {shape}")


def index_dtype_of(t: Any, name: str) -> Any:
    """The Paddle dtype of index tensor ``t``, which must be int32 or int64."""
    dtype = t.dtype
    if PD_INDEX.get(dtype) is None:
        raise OpsError(f"{name} must be int32 or int64, got {dtype_text(dtype)}")
    return dtype


def check_inplace(t: Any, name: str) -> None:
    """An in-place target must be contiguous: Paddle hands a custom op a contiguous copy
    of a strided view, so the writes would land in a temporary and be lost."""
    if type(t) is _Tensor and not t.is_contiguous():
        raise OpsError(f"{name} must be contiguous: an op writing into a strided view would write into a copy")


def check_int(value: Any, name: str, low: int, high: int) -> int:
    """``value`` as an int in ``[low, high)``, else ``OpsError``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise OpsError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value < high:
        raise OpsError(f"{name}={value} is out of range [{low}, {high})")
    return int(value)


def check_range(index: np.ndarray, bound: int, name: str) -> None:
    """``OpsError`` naming the first entry of ``index`` outside ``[0, bound)``."""
    bad = np.flatnonzero((index < 0) | (index >= bound))
    if bad.size:
        i = int(bad[0])
        raise OpsError(f"{name}[{i}] = {int(index[i])} is out of range [0, {bound})")


def layer_and_fill(layer: Any, num_layers: int, dtype: Any, num_experts: Any) -> tuple[int, int]:
    """The validated layer index (below ``num_layers`` when known, i.e. >= 0) and the
    expert-id bound: ``num_experts``, or the dtype's fill value when it is not given."""
    layer = check_int(layer, "layer", 0, num_layers if num_layers >= 0 else 2**62)
    fill = FILL[dtype]
    return layer, fill if num_experts is None else check_int(num_experts, "num_experts", 0, fill + 1)


def index_array(x: Any, name: str) -> np.ndarray:
    """Host int32/int64 1-D array from a numpy array, a sequence or a CPU tensor."""
    if is_tensor(x):
        index_dtype_of(x, name)
        vector_len(x, name)
        arr = np.from_dlpack(x) if x.place.is_cpu_place() else x.numpy()
        return arr.reshape(-1)
    arr = np.asarray(x)
    if arr.size == 0 and arr.dtype not in NP_INDEX:
        arr = arr.astype(np.int64)
    if arr.dtype not in NP_INDEX:
        if isinstance(x, np.ndarray) or arr.dtype.kind not in "iu":
            raise OpsError(f"{name} must hold int32 or int64 indices, got dtype {arr.dtype}")
        arr = arr.astype(np.int64)
    if arr.ndim != 1:
        raise OpsError(f"{name} must be 1-D, got shape {list(arr.shape)}")
    return arr


def indices(place: Any, *specs: tuple[Any, str, int]) -> list[Any]:
    """Index arguments ``(value, name, bound)`` as 1-D int32/int64 tensors on ``place``.

    Tensors are used as they are (all of one dtype); numpy arrays and sequences are
    checked against ``[0, bound)`` here and copied to ``place`` together, in one
    transfer.  In eager mode a CPU index tensor is range-checked here too; device
    indices are checked by the op before it writes anything.
    """
    tensors: dict[int, Any] = {}
    host: dict[int, np.ndarray] = {}
    for i, (value, name, bound) in enumerate(specs):
        if is_tensor(value):
            index_dtype_of(value, name)
            if len(value.shape) != 1:
                raise OpsError(f"{name} must be 1-D, got shape {list(value.shape)}")
            if eager() and value.place.is_cpu_place():
                check_range(np.from_dlpack(value), bound, name)
            tensors[i] = value
        elif not eager():
            raise OpsError(f"{name} must be a tensor inside a static graph, got {type(value).__name__}")
        else:
            host[i] = index_array(value, name)
            check_range(host[i], bound, name)
    first = next(iter(tensors.values()), None)
    for t in tensors.values():
        if t.dtype is not first.dtype and t.dtype != first.dtype:
            names = ", ".join(f"{specs[i][1]} {dtype_text(u.dtype)}" for i, u in tensors.items())
            raise OpsError(f"index tensors must share one dtype, got {names}")
    if host:
        if first is not None:
            np_dtype = PD_INDEX.get(first.dtype)
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
