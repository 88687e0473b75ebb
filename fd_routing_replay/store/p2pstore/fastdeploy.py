"""FastDeploy's own P2PStore keys and values, for trainers that read them directly.

FastDeploy's ``RoutingStoreRDMA`` (2.5 and 2.6) puts each finished request into P2PStore
under the bare rollout id, padded to ``max_model_len`` with its fill (``-1`` cast to the
unsigned dtype, i.e. the dtype's max)::

    {rollout_id}           fused:     padded [layers, max_model_len, top_k] .tobytes()
    {rollout_id}_{layer}   per layer: the padded [max_model_len, top_k] ndarray itself

What it hands ``P2PClient.put`` differs between the two, and so does what a consumer's
``P2PClient.get`` returns: the fused value is ``bytes`` (P2PStore ``object_type`` "object";
get returns those bytes), a per-layer value is an ndarray (``object_type`` "numpy" with its
shape and dtype in the metadata; get returns the ndarray).  This layout does exactly the
same, so a trainer written against FastDeploy reads our keys unchanged.

``put`` takes rr-v1 records (:meth:`converts_records` is True, so the writer hands it
records whatever ``capture.record_format`` says): a per-layer key's single layer becomes
``[tokens, top_k]``, tokens are padded to ``max_model_len`` when the store is given one
(else the record's tokens are stored as they are: records the capture already padded,
``capture.pad_to_max_model_len``), cells holding the record's fill become FastDeploy's.
``get`` returns the stored bytes; they do not say their geometry, so reading them needs
the model's layers, top-k and dtype (:func:`fd_routing_replay.codec.decode_fastdeploy_raw`).

What stays ours: the prefix-bucket index (``rr:idx:{ns}``, namespaced as in the tree
layout) drives ``list``, ``delete_prefix``, ``clear`` and ``only_last_turn``, so they keep
their boundary-safe O(matched) semantics; deletes call P2PStore's exact-key ``delete_batch``
on the bare keys.

Guards:

* P2PStore silently skips (and reports success for) any key containing ``88888888``;
  bare keys cannot be escaped, so such a put is refused with :class:`PermanentStoreError`
  naming the key, before anything is written.  Keys starting ``__p2p_`` (P2PStore's
  internal keys) are refused likewise.
* Bare keys have no namespace, so one metadata server (Redis database) serves one
  namespace in this layout: the first write claims it in :data:`OWNER_KEY` (``SET NX``,
  one round trip per store), and writes or deletes from another namespace are refused.
  FastDeploy's own ``RoutingStoreRDMA`` cannot be detected that way (it writes the same
  bare keys, and its start-up ``clear()`` wipes every P2PStore key of that Redis): do not
  point both at one metadata server.
* FastDeploy's layout cannot carry an empty value (P2PStore refuses ``data_size <= 0``):
  a record of zero tokens without ``max_model_len`` is refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from fd_routing_replay.codec import MAGIC, decode_record, encode_fastdeploy_raw
from fd_routing_replay.codec.pdtensor import fastdeploy_fill, pad_tokens
from fd_routing_replay.errors import InvalidRolloutId, PermanentStoreError, RecordError
from fd_routing_replay.keys import split_layer_key
from fd_routing_replay.store.base import Buffer
from fd_routing_replay.store.p2pstore.store import P2PStoreStore

__all__ = ["OWNER_KEY", "SKIPPED_BY_P2PSTORE", "FastDeployP2PStore", "fastdeploy_value"]

OWNER_KEY = "rr:p2p:fastdeploy-namespace"
"""Redis key naming the namespace that owns the bare key space of this metadata server."""
SKIPPED_BY_P2PSTORE = "88888888"
RESERVED_PREFIX = "__p2p_"


def fastdeploy_value(key: str, record_bytes: Buffer,
                     max_model_len: int | None) -> bytes | np.ndarray:
    """What FastDeploy hands ``P2PClient.put`` for ``key``, built from an rr-v1 record.

    Fused key: the padded ``[layers, max_model_len, top_k]`` array's bytes; per-layer key:
    the padded ``[max_model_len, top_k]`` ndarray.  Raises RecordError (bad record, record
    of another rollout, more than one layer for a per-layer key, too many tokens).
    """
    rollout, layer = split_layer_key(key)
    if bytes(memoryview(record_bytes)[:len(MAGIC)]) != MAGIC:
        raise RecordError(
            "the value is not an rr-v1 record; raw fastdeploy-raw bytes carry no dtype or "
            "shape, so hand this layout rr-v1 records (it converts them)")
    record = decode_record(record_bytes)
    if record.rollout_id != rollout.text:
        raise RecordError(f"the record belongs to rollout {record.rollout_id!r}, not "
                          f"{rollout.text!r}")
    ids = record.ids
    if layer is not None:
        if ids.shape[0] != 1:
            raise RecordError(f"a per-layer key holds one layer; the record has "
                              f"{ids.shape[0]} (shape {list(ids.shape)})")
        ids = ids[0]
    tokens = ids.shape[-2]
    target = max_model_len or tokens
    if tokens > target:
        raise RecordError(f"the record has {tokens} tokens, more than max_model_len {target}")
    if (ids.shape[0] if layer is None else 1) * target * ids.shape[-1] == 0:
        raise RecordError(f"the value would be empty (record {list(record.ids.shape)}, "
                          f"max_model_len {max_model_len}) and P2PStore cannot carry an empty "
                          "value; set max_model_len to pad it like FastDeploy")
    if layer is None and record.fill_value == fastdeploy_fill(ids.dtype):
        return encode_fastdeploy_raw(ids, target)  # one copy, no intermediate array
    padded = pad_tokens(ids, target, record.fill_value)
    return padded if layer is not None else padded.tobytes()


class FastDeployP2PStore(P2PStoreStore):
    """P2PStore with FastDeploy's bare keys and raw padded values (module docstring)."""

    layout = "fastdeploy"

    def __init__(self, *args: Any, max_model_len: int | None = None, **kwargs: Any) -> None:
        if max_model_len is not None and (isinstance(max_model_len, bool)
                                          or not isinstance(max_model_len, int)
                                          or max_model_len < 1):
            raise ValueError(f"max_model_len must be a positive int or None, got "
                             f"{max_model_len!r}")
        super().__init__(*args, **kwargs)
        self.max_model_len = max_model_len
        self._ns_prefix = ""  # P2PStore keys are the store keys themselves
        self._claimed = False

    # -- key mapping ---------------------------------------------------------------------
    def _skey(self, key: str) -> str:
        return key

    def _key_of(self, stored: str) -> str | None:
        """A P2PStore key as a store key when it has FastDeploy's shape (tree-layout keys
        hold ``/`` and never do)."""
        try:
            split_layer_key(stored)
        except InvalidRolloutId:
            return None
        return stored

    # -- writes --------------------------------------------------------------------------
    def put_parts(self, key: str, parts: Sequence[Buffer]) -> None:
        key = self._keys([key])[0]
        if SKIPPED_BY_P2PSTORE in key or key.startswith(RESERVED_PREFIX):
            why = (f"contains {SKIPPED_BY_P2PSTORE!r}, which P2PStore silently does not store"
                   if SKIPPED_BY_P2PSTORE in key else
                   f"starts with {RESERVED_PREFIX!r}, P2PStore's internal keys")
            raise PermanentStoreError(
                f"{self.describe()}: refusing key {key!r}: it {why}, and FastDeploy's layout "
                "stores keys bare (use the tree layout, which escapes keys, or another "
                "rollout id)")
        record_bytes = parts[0] if len(parts) == 1 else b"".join(parts)
        try:
            value = fastdeploy_value(key, record_bytes, self.max_model_len)
        except (RecordError, InvalidRolloutId) as exc:
            raise PermanentStoreError(f"{self.describe()}: cannot store key {key!r}: "
                                      f"{exc}") from exc
        self._claim_namespace(create=True)
        self._publish(key, value)

    def delete(self, keys: Iterable[str]) -> int:
        checked = self._keys(keys)
        self._claim_namespace(create=False)
        return super().delete(checked)

    def delete_prefix(self, prefixes: Iterable[str]) -> dict[str, int]:
        checked = self._prefixes(prefixes)
        self._claim_namespace(create=False)
        return super().delete_prefix(checked)

    def clear(self) -> int:
        self._claim_namespace(create=False)
        return super().clear()

    def _claim_namespace(self, *, create: bool) -> None:
        """Refuse writes and deletes when another namespace owns the bare key space."""
        if self._claimed:
            return
        with self.translate_errors("claim the bare key space"):
            if create:
                pipe = self.redis.pipeline(transaction=False)
                pipe.set(OWNER_KEY, self.namespace, nx=True)
                pipe.get(OWNER_KEY)
                owner = pipe.execute()[1]
            else:
                owner = self.redis.get(OWNER_KEY)
        if owner is None:
            return  # nobody writes bare keys here yet: nothing of another namespace to hit
        owner = owner.decode("utf-8", "replace") if isinstance(owner, bytes) else str(owner)
        if owner != self.namespace:
            raise PermanentStoreError(
                f"{self.describe()}: the bare P2PStore keys of this metadata server belong to "
                f"namespace {owner!r} (Redis key {OWNER_KEY}), not {self.namespace!r}; "
                "FastDeploy's layout has no namespace in its keys, so use one metadata server "
                f"(or Redis database) per namespace, or delete {OWNER_KEY} once that "
                "namespace's records are gone")
        self._claimed = True

    # -- reads ----------------------------------------------------------------------------
    def _payload(self, key: str, value: Any) -> memoryview:
        """The raw bytes: as stored (fused) or the ndarray's buffer (per layer)."""
        if isinstance(value, np.ndarray):
            return memoryview(np.ascontiguousarray(value).reshape(-1).view(np.uint8))
        if isinstance(value, bytes | bytearray | memoryview):
            return memoryview(value)
        raise PermanentStoreError(
            f"{self.describe()}: P2PStore returned a {type(value).__name__} for {key!r}, "
            "neither FastDeploy's bytes nor its ndarray")

    def converts_records(self) -> bool:
        return True

    def describe(self) -> str:
        padding = f", max_model_len={self.max_model_len}" if self.max_model_len else ""
        return (f"p2pstore(namespace={self.namespace}, layout=fastdeploy{padding}, "
                f"metadata={self.location}, transport={self.transport})")
