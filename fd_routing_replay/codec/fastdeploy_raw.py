"""The ``fastdeploy-raw`` compatibility format: FastDeploy's own routing bytes.

What FastDeploy ≥ 2.4 stores today: the raw little-endian bytes of ``[layers,
max_model_len, top_k]`` (or ``[max_model_len, top_k]`` per layer), padded with the fill
value, and nothing else: shape and dtype come from elsewhere.  Existing trainers keep
reading what they read.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fd_routing_replay.codec.header import MAGIC, byte_view
from fd_routing_replay.codec.record import MAX_DIM, is_int
from fd_routing_replay.errors import RecordError

__all__ = ["decode_fastdeploy_raw", "encode_fastdeploy_raw"]


def _compat_dtype(dtype: object) -> np.dtype:
    try:
        dt = np.dtype(dtype)  # type: ignore[call-overload]
    except (TypeError, ValueError) as exc:
        raise RecordError(f"fastdeploy-raw: {dtype!r} is not a dtype") from exc
    if dt.kind != "u" or dt.itemsize not in (1, 2, 4):
        raise RecordError(f"fastdeploy-raw: dtype {dt} is not uint8, uint16 or uint32")
    return dt.newbyteorder("<")


def _compat_fill(fill_value: int | None, dtype: np.dtype) -> int:
    max_value = int(np.iinfo(dtype).max)
    if fill_value is None:
        return max_value
    if not is_int(fill_value) or not 0 <= fill_value <= max_value:
        raise RecordError(f"fastdeploy-raw: fill_value {fill_value!r} does not fit {dtype}")
    return fill_value


def encode_fastdeploy_raw(ids: np.ndarray, max_model_len: int, fill_value: int | None = None) -> bytes:
    """Write ``ids`` the way FastDeploy ≥ 2.4 stores routing today: raw bytes only.

    ``ids`` is ``[layers, tokens, top_k]`` (fused) or ``[tokens, top_k]`` (one layer);
    tokens are padded to ``max_model_len`` with ``fill_value`` (default: the dtype's
    maximum, FastDeploy's ``-1``), little-endian, C order.  The reader must know shape
    and dtype from elsewhere.  The ids are copied once (one ``bytes.join`` of each
    layer's rows and a shared padding block).
    """
    if not isinstance(ids, np.ndarray) or ids.ndim not in (2, 3):
        raise RecordError("fastdeploy-raw: ids must be a 2-D [tokens, top_k] or 3-D [layers, tokens, top_k] array")
    dtype = _compat_dtype(ids.dtype)
    fill = _compat_fill(fill_value, dtype)
    if not is_int(max_model_len) or max_model_len < 0:
        raise RecordError(f"fastdeploy-raw: max_model_len must be a non-negative int, got {max_model_len!r}")
    tokens = ids.shape[-2]
    if tokens > max_model_len:
        raise RecordError(f"fastdeploy-raw: {tokens} tokens do not fit max_model_len {max_model_len}")
    num_layers = ids.shape[0] if ids.ndim == 3 else 1
    layers = np.ascontiguousarray(ids, dtype=dtype).reshape(num_layers, tokens, ids.shape[-1])
    padding = np.full((max_model_len - tokens, ids.shape[-1]), fill, dtype=dtype).tobytes()
    parts: list[Any] = []
    for layer in layers:
        parts.append(memoryview(layer.reshape(-1).view(np.uint8)))
        parts.append(padding)
    return b"".join(parts)


def decode_fastdeploy_raw(
    buffer: bytes | bytearray | memoryview,
    num_layers: int,
    max_model_len: int,
    top_k: int,
    dtype: object,
    *,
    trim: bool = True,
    fill_value: int | None = None,
) -> np.ndarray:
    """Read a fastdeploy-raw value as a read-only ``[num_layers, max_model_len, top_k]`` view.

    A per-layer value is read with ``num_layers=1``.  With ``trim`` the trailing tokens
    whose every slot holds the fill value are dropped; the result is then a view that is
    not C-contiguous when ``num_layers > 1`` (``np.ascontiguousarray`` before building a
    RoutingRecord).  A wrong byte count raises RecordError naming both sizes.
    """
    view = byte_view(buffer, "fastdeploy-raw value")
    dt = _compat_dtype(dtype)
    fill = _compat_fill(fill_value, dt)
    for name, value in (("num_layers", num_layers), ("max_model_len", max_model_len), ("top_k", top_k)):
        if not is_int(value) or not 0 <= value <= MAX_DIM:
            raise RecordError(f"fastdeploy-raw: {name} must be an int in [0, {MAX_DIM}], got {value!r}")
    count = num_layers * max_model_len * top_k
    if view.nbytes != count * dt.itemsize:
        hint = " (it starts with the rr-v1 magic: use decode_record)" if bytes(view[:4]) == MAGIC else ""
        raise RecordError(
            f"fastdeploy-raw value has {view.nbytes} bytes, but [{num_layers}, {max_model_len}, "
            f"{top_k}] {dt} needs {count * dt.itemsize}; check layers, max_model_len, top_k and dtype{hint}"
        )
    ids = np.frombuffer(view, dtype=dt, count=count).reshape(num_layers, max_model_len, top_k)
    ids.flags.writeable = False
    if not trim or ids.size == 0:
        return ids
    used = np.zeros(max_model_len, dtype=bool)
    for layer in ids:
        used |= (layer != fill).any(axis=1)
    nonzero = np.flatnonzero(used)
    tokens = int(nonzero[-1]) + 1 if nonzero.size else 0
    return ids[:, :tokens, :]
