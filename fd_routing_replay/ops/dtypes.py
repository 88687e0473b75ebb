"""Routing and index dtypes of the ops, between Paddle and NumPy.

A step buffer holds expert ids in the smallest unsigned dtype that holds ``num_experts + 1``
values (``routing_dtype``); its maximum is the "no routing" fill (``fill_value``).  Index
tensors are int32 or int64.  Paddle's dtype string "uint16" means bfloat16, so every
mapping here is between real dtype objects.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle

from fd_routing_replay import codec
from fd_routing_replay.errors import OpsError, RecordError

__all__ = ["NP_ROUTING", "PD_INDEX", "PD_ROUTING", "ROUTING_DTYPES", "DtypeMap", "fill_value", "routing_dtype"]


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


ROUTING_DTYPES: tuple[np.dtype, ...] = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32))
# NumPy routing dtype -> the real Paddle dtype (paddle.uint16, never the string "uint16").
NP_ROUTING = {np.dtype(np.uint8): paddle.uint8, np.dtype(np.uint16): paddle.uint16,
              np.dtype(np.uint32): paddle.uint32}
# Paddle routing dtype -> NumPy dtype (None for anything else, bfloat16 included).
PD_ROUTING = DtypeMap({pd: np_dtype for np_dtype, pd in NP_ROUTING.items()})
# Paddle index dtype -> NumPy dtype (int32 / int64 only).
PD_INDEX = DtypeMap({paddle.int32: np.dtype(np.int32), paddle.int64: np.dtype(np.int64)})


def routing_dtype(num_experts: int) -> np.dtype:
    """Smallest of uint8/uint16/uint32 holding ``num_experts + 1`` values (ids + fill)."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) or num_experts < 1:
        raise OpsError(f"num_experts must be a positive integer, got {num_experts!r}")
    try:  # the record format owns the dtype rule; the buffer must match the records
        return codec.routing_dtype(int(num_experts))
    except RecordError as exc:
        raise OpsError(f"num_experts={num_experts}: {exc}") from exc


def fill_value(dtype: Any) -> int:
    """The "no routing" value of a routing dtype (a NumPy dtype or name, or a Paddle dtype
    object): its maximum, all bits set.  FastDeploy pads with -1 cast to the dtype, which is
    the same value."""
    np_dtype = PD_ROUTING.get(dtype)  # paddle dtype objects (the real uint16, not the string)
    if np_dtype is None:
        try:
            np_dtype = np.dtype(dtype)
        except TypeError as exc:
            raise OpsError(f"dtype {dtype!r} is not a routing dtype (uint8, uint16, uint32)") from exc
    if np_dtype not in ROUTING_DTYPES:
        raise OpsError(f"dtype {np_dtype} is not a routing dtype (uint8, uint16, uint32)")
    return int(np.iinfo(np_dtype).max)
