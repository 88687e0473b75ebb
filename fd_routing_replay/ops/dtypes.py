"""Routing and index dtypes of the ops, between Paddle and NumPy.

A routing table or step buffer holds expert ids in the smallest unsigned dtype that holds
``num_experts + 1`` values (``routing_dtype``); its maximum is the "no routing" fill
(``fill_value``).  Index tensors are int32 or int64.  Paddle's dtype string "uint16"
means bfloat16, so every mapping here is between real dtype objects.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle

from fd_routing_replay import codec
from fd_routing_replay.errors import OpsError, RecordError
from fd_routing_replay.ops import reference as ref

__all__ = [
    "FILL",
    "NP_INDEX",
    "NP_ROUTING",
    "PD_INDEX",
    "PD_ROUTING",
    "DtypeMap",
    "as_routing_np_dtype",
    "dtype_text",
    "fill_value",
    "routing_dtype",
]


class DtypeMap:
    """Paddle dtype -> value.  Paddle dtypes are singletons, so an identity lookup
    (~0.1 us) answers the hot path; equality (~1 us per compare) is the fallback."""

    def __init__(self, items: dict[Any, Any]) -> None:
        self._by_eq = dict(items)
        self._by_id = {id(k): v for k, v in items.items()}

    def get(self, dtype: Any) -> Any:
        """The value for ``dtype``, or None when it is not in the map."""
        value = self._by_id.get(id(dtype))
        return self._by_eq.get(dtype) if value is None else value


# Paddle routing dtype -> NumPy dtype (None for anything else, bfloat16 included).
PD_ROUTING = DtypeMap({paddle.uint8: np.dtype(np.uint8), paddle.uint16: np.dtype(np.uint16),
                       paddle.uint32: np.dtype(np.uint32)})
# NumPy routing dtype -> the real Paddle dtype (paddle.uint16, never the string "uint16").
NP_ROUTING = {np.dtype(np.uint8): paddle.uint8, np.dtype(np.uint16): paddle.uint16,
              np.dtype(np.uint32): paddle.uint32}
# Paddle index dtype -> NumPy dtype (int32 / int64 only).
PD_INDEX = DtypeMap({paddle.int32: np.dtype(np.int32), paddle.int64: np.dtype(np.int64)})
# The NumPy index dtypes the ops accept.
NP_INDEX = (np.dtype(np.int32), np.dtype(np.int64))
# NumPy routing dtype -> its fill value ("no routing": all bits set).
FILL = {dtype: ref.fill_of(dtype) for dtype in ref.ROUTING_DTYPES}


def routing_dtype(num_experts: int) -> np.dtype:
    """Smallest of uint8/uint16/uint32 holding ``num_experts + 1`` values (ids + fill)."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) or num_experts < 1:
        raise OpsError(f"num_experts must be a positive integer, got {num_experts!r}")
    try:  # the record format owns the dtype rule; the table must match the records
        return codec.routing_dtype(int(num_experts))
    except RecordError as exc:
        raise OpsError(f"num_experts={num_experts}: {exc}") from exc


def as_routing_np_dtype(dtype: Any, name: str = "dtype") -> np.dtype:
    """``dtype`` (a Paddle dtype object or anything ``np.dtype`` takes) as a NumPy
    routing dtype; ``OpsError`` naming ``name`` when it is not uint8/uint16/uint32."""
    np_dtype = PD_ROUTING.get(dtype)  # paddle dtype objects (the real uint16, not the string)
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
    return ref.fill_of(as_routing_np_dtype(dtype))


def dtype_text(dtype: Any) -> str:
    """A Paddle dtype as error messages name it (bfloat16 with a hint about "uint16")."""
    if dtype == paddle.uint16:
        return "uint16"
    if dtype == paddle.bfloat16:
        return "bfloat16 (Paddle's dtype string 'uint16' means bfloat16; use new_routing_table)"
    return str(dtype).replace("paddle.", "")
