"""What a finished request's response carries in FastDeploy 2.6's ``response`` mode.

The engine side encodes the request's record on the token processor's thread (the
response needs it now); :class:`ResponseRoutes` turns that record into the bytes the
response carries (FastDeploy's OpenAI layer base64-encodes them as ``routed_experts``):

* ``response.routes: payload`` -- the record itself;
* ``response.routes: reference`` -- the record goes to the sink (the background writer, so
  the engine never waits for the store) and the response carries a small JSON
  :class:`~fd_routing_replay.codec.reference.RecordReference`: the store key and the
  checksum and size of the record's payload.  The reference is returned before the record
  is durable; :func:`~fd_routing_replay.reader.references.resolve_reference` waits for it.

:meth:`ResponseRoutes.stream_text` is the same bytes as base64 text, for the last chunk of
a streaming response (``response.stream``).  Free of FastDeploy: the glue is
:mod:`fd_routing_replay.integrations.fastdeploy.engine`.
"""

from __future__ import annotations

import base64
import logging
import threading
from typing import Any

import numpy as np

from fd_routing_replay.codec.reference import reference_for_header
from fd_routing_replay.codec.rr_v1 import decode_record, read_header
from fd_routing_replay.core.redact import redact_url

__all__ = ["PAYLOAD", "REFERENCE", "ResponseRoutes", "as_bytes", "store_text"]

logger = logging.getLogger(__name__)

PAYLOAD = "payload"
REFERENCE = "reference"


def as_bytes(encoded: Any) -> bytes:
    """``encoded`` (an encoded record as bytes, or a uint8 array over them) as ``bytes``,
    without a copy when the array is a view of a whole ``bytes`` object.

    ``bytes`` is what survives every FastDeploy transport from the engine to the API
    server unchanged: msgpack packs it as binary, while an array becomes a list of ints
    (inter_communicator/zmq_server.py:34-47) that the OpenAI layer turns into int64
    (serving_chat.py:730-733), eight bytes for each byte of the record.
    """
    if isinstance(encoded, bytes):
        return encoded
    base = getattr(encoded, "base", None)
    if isinstance(base, bytes) and len(base) == getattr(encoded, "nbytes", -1):
        return base
    return np.ascontiguousarray(encoded, dtype=np.uint8).tobytes()


def store_text(store: Any) -> str:
    """Which store a config names, without secrets: its URL, else its type."""
    return redact_url(store.url) if getattr(store, "url", None) else str(store.type)


class ResponseRoutes:
    """Encoded records -> what the response carries (see the module docstring).

    ``config`` is the :class:`~fd_routing_replay.config.RoutingReplayConfig`; ``sink`` (a
    :class:`~fd_routing_replay.capture.sink.RecordSink`) is where records go in reference
    mode.  :meth:`deliver` never raises.
    """

    def __init__(self, config: Any, sink: Any = None) -> None:
        self.mode = config.response.routes
        self.stream = bool(config.response.stream)
        if self.mode not in (PAYLOAD, REFERENCE):
            raise ValueError(f"response.routes must be {PAYLOAD!r} or {REFERENCE!r}, got {self.mode!r}")
        if self.mode == REFERENCE and sink is None:
            raise ValueError("response.routes 'reference' needs a sink to store the records in")
        self.sink = sink if self.mode == REFERENCE else None
        self.namespace = config.store.namespace
        self.store = store_text(config.store)
        self._lock = threading.Lock()
        self.counters = {"references_returned": 0, "references_failed": 0}

    def deliver(self, encoded: Any) -> bytes | None:
        """The bytes the response carries for this encoded record (None for None).

        In reference mode the record is handed to the sink first; when that fails (or the
        writer drops it: ``put`` returns False) the failure is counted and logged with the
        rollout id, and None is returned: the response then carries no routes rather than a
        reference to nothing.
        """
        if encoded is None:
            return None
        data = as_bytes(encoded)
        if self.mode == PAYLOAD:
            return data
        rollout_id = "?"
        try:
            header = read_header(data)
            rollout_id = header.rollout_id
            reference = reference_for_header(header, namespace=self.namespace, store=self.store)
            if self.sink.put(header.rollout_id, decode_record(data, verify=False)) is False:
                raise RuntimeError("the background writer dropped it (writer.full_policy)")
        except Exception as exc:
            self._count("references_failed")
            logger.error("routing replay: the record of rollout %s could not be handed to the store, "
                         "its response carries no routes: %r", rollout_id, exc)
            return None
        self._count("references_returned")
        return reference.to_json().encode("ascii")

    @staticmethod
    def stream_text(data: bytes) -> str:
        """``data`` as the base64 text a stream chunk carries (what ``routed_experts`` is)."""
        return base64.b64encode(data).decode("ascii")

    def _count(self, name: str) -> None:
        with self._lock:
            self.counters[name] += 1
