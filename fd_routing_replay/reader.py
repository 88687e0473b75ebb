"""Trainer-side API: fetch a rollout's routing as ``[layers, tokens, top_k]`` arrays.

Records are validated (format, checksum, expert-id range, and that the record belongs
to the rollout asked for) before they are handed out.  Conversions to Paddle, Torch and
Megatron's per-layer replay list live here too; none of those frameworks is imported
unless its helper is called.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from fd_routing_replay.codec import RoutingRecord, check_expert_range, decode_record
from fd_routing_replay.errors import RecordError
from fd_routing_replay.keys import check_key, parse_rollout_id
from fd_routing_replay.store import RoutingStore, open_store


class RoutingReader:
    """Reads records by rollout id from a store (or anything :func:`open_store` takes)."""

    def __init__(self, store_or_config: Any, *, namespace: str | None = None,
                 verify: bool = True) -> None:
        if isinstance(store_or_config, RoutingStore):
            self.store = store_or_config
            self._owns_store = False
        else:
            self.store = open_store(store_or_config, namespace)
            self._owns_store = True
        self.verify = verify

    def get(self, rollout_id: str) -> RoutingRecord | None:
        """The record of ``rollout_id``, or None when it has not been stored (yet)."""
        parse_rollout_id(rollout_id)
        buffer = self.store.get(rollout_id)
        if buffer is None:
            return None
        return self._decode(rollout_id, buffer)

    def get_many(self, rollout_ids: Iterable[str]) -> dict[str, RoutingRecord | None]:
        """Records of several rollouts, in the order given; missing ones map to None."""
        return {rid: self.get(rid) for rid in rollout_ids}

    def get_layer(self, rollout_id: str, layer: int) -> RoutingRecord | None:
        """A per-layer record (FastDeploy's non-fused mode stores ``{id}_{layer}``)."""
        parse_rollout_id(rollout_id)
        key = check_key(f"{rollout_id}_{layer}")
        buffer = self.store.get(key)
        return None if buffer is None else self._decode(rollout_id, buffer)

    def wait(self, rollout_id: str, timeout: float, poll_interval: float = 0.05) -> RoutingRecord:
        """Poll until the record exists; ``TimeoutError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            record = self.get(rollout_id)
            if record is not None:
                return record
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"no routing record for rollout {rollout_id!r} in {self.store.describe()} "
                    f"after {timeout:g} s")
            time.sleep(min(poll_interval, remaining))

    def close(self) -> None:
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> RoutingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _decode(self, rollout_id: str, buffer: Any) -> RoutingRecord:
        try:
            record = decode_record(buffer, verify=self.verify)
        except RecordError as exc:
            raise RecordError(f"record of rollout {rollout_id!r}: {exc}") from exc
        if record.rollout_id != rollout_id:
            raise RecordError(
                f"record stored under {rollout_id!r} belongs to rollout "
                f"{record.rollout_id!r}; the store is inconsistent (run fd-rr fsck)")
        check_expert_range(record)
        return record


def pad_to(ids: np.ndarray, length: int, fill_value: int | None = None) -> np.ndarray:
    """Pad ``[L, T, K]`` ids along tokens to ``length`` with the fill (default: dtype max)."""
    layers, tokens, top_k = ids.shape
    if length < tokens:
        raise ValueError(f"pad_to: length {length} is shorter than the record's {tokens} tokens")
    fill = np.iinfo(ids.dtype).max if fill_value is None else fill_value
    out = np.full((layers, length, top_k), fill, dtype=ids.dtype)
    out[:, :tokens] = ids
    return out


def to_paddle(ids: np.ndarray, dtype: str = "int64") -> Any:
    """A Paddle tensor of ``ids`` (int64 by default, what routers index with)."""
    import paddle

    return paddle.to_tensor(np.ascontiguousarray(ids, dtype=dtype))


def to_torch(ids: np.ndarray, dtype: str = "int64") -> Any:
    """A Torch tensor of ``ids``; needs torch installed (extra ``torch``)."""
    try:
        import torch
    except ImportError as exc:
        raise ImportError("to_torch needs torch: pip install 'fd-routing-replay[torch]'") from exc
    return torch.from_numpy(np.ascontiguousarray(ids, dtype=dtype))


def to_replay_list(record: RoutingRecord, *, fill_as: int = -1,
                   dtype: str = "int64") -> list[np.ndarray]:
    """Per-layer ``[T, K]`` arrays for Megatron-style ``set_replay_data``.

    "No routing" entries become ``fill_as`` (-1: NeMo-RL falls back to the live router).
    """
    ids = record.ids.astype(dtype)
    ids[record.ids == record.fill_value] = fill_as
    return [ids[layer] for layer in range(ids.shape[0])]
