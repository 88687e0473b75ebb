"""The client side of FastDeploy 2.6's ``response`` mode: routes out of a response.

A response carries either the record itself (``response.routes: payload``) or a reference
to it in the store (``response.routes: reference``, :mod:`fd_routing_replay.codec.reference`),
base64-encoded in ``routed_experts`` (non-streaming) or, with ``response.stream``, in the
last stream chunk's ``metrics.routed_experts``.  :func:`routes_from_response` takes
either and returns the validated record.

A reference is returned as soon as the request finishes, while the background writer
may still be storing the record, so :func:`resolve_reference` waits for it (up to a
timeout).  It refuses -- RecordError naming the key and the expected and actual values --
a record that stays missing (not written yet, dropped by the writer, or deleted since:
``only_last_turn``, retention), or one whose header differs from the reference
(another version under the same key), and a payload that does not hash to its checksum.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Mapping
from typing import Any

from fd_routing_replay.codec.header import MAGIC
from fd_routing_replay.codec.record import RoutingRecord, check_expert_range
from fd_routing_replay.codec.reference import (
    RecordReference,
    looks_like_reference,
    parse_reference,
)
from fd_routing_replay.codec.rr_v1 import decode_record, read_header
from fd_routing_replay.errors import RecordError

__all__ = ["DEFAULT_RESOLVE_TIMEOUT_S", "ROUTED_EXPERTS", "resolve_reference", "routed_experts_of",
           "routes_from_response"]

#: How long :func:`resolve_reference` waits for a record by default (the background
#: writer stores a record within milliseconds when the store is healthy).
DEFAULT_RESOLVE_TIMEOUT_S = 30.0
#: The response field (and, in stream chunks, the ``metrics`` field) that carries the routes.
ROUTED_EXPERTS = "routed_experts"


def _describe(store: Any) -> str:
    describe = getattr(store, "describe", None)
    return describe() if callable(describe) else type(store).__name__


def _check(store: Any, reference: RecordReference, buffer: Any) -> str | None:
    """What is wrong with the value stored under the reference's key (None: it matches)."""
    if bytes(memoryview(buffer)[:len(MAGIC)]) != MAGIC:
        return "the stored value is not an rr-v1 record"
    try:
        header = read_header(buffer)
    except RecordError as exc:
        return f"the stored record is unreadable: {exc}"
    return reference.mismatch(header)


def resolve_reference(store: Any, reference: RecordReference | Mapping[str, Any] | str | bytes, *,
                      timeout: float = DEFAULT_RESOLVE_TIMEOUT_S,
                      poll_interval: float = 0.05) -> RoutingRecord:
    """The record a reference names, read from ``store`` (a
    :class:`~fd_routing_replay.store.RoutingStore` on the namespace the engine writes).

    Polls until a record matching the reference is stored, for up to ``timeout`` seconds
    (0: look once); then RecordError naming the key, the store and what was found instead
    (nothing, or the checksum / size / shape that differ).  The payload is checked against
    its checksum and the ids against ``num_experts`` before the record is returned.
    """
    ref = parse_reference(reference)
    namespace = getattr(store, "namespace", ref.namespace)
    if namespace != ref.namespace:
        raise RecordError(f"reference to {ref.key!r} is in namespace {ref.namespace!r} (store "
                          f"{ref.store or '?'}), this reader reads namespace {namespace!r} of "
                          f"{_describe(store)}")
    deadline = time.monotonic() + max(float(timeout), 0.0)
    while True:
        buffer = store.get(ref.key)
        problem = "no record is stored under it" if buffer is None else _check(store, ref, buffer)
        if problem is None:
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RecordError(
                f"reference to record {ref.key!r} (namespace {ref.namespace!r}, written to "
                f"{ref.store or '?'}) does not resolve in {_describe(store)} after {timeout:g} s: "
                f"{problem}")
        time.sleep(min(poll_interval, remaining))
    try:
        record = decode_record(buffer, verify=True)
    except RecordError as exc:
        raise RecordError(f"reference to record {ref.key!r}: {exc}") from exc
    check_expert_range(record)
    return record


def routed_experts_of(response: Any) -> str | None:
    """The ``routed_experts`` text of a response: the field itself (non-streaming, also as an
    object with that attribute), or ``metrics.routed_experts`` of a stream chunk; None when
    neither is there."""
    if isinstance(response, (str, bytes)):
        return response.decode("ascii") if isinstance(response, bytes) else response
    if isinstance(response, Mapping):
        value = response.get(ROUTED_EXPERTS)
        metrics = response.get("metrics")
        if value is None and isinstance(metrics, Mapping):
            value = metrics.get(ROUTED_EXPERTS)
        return value
    return getattr(response, ROUTED_EXPERTS, None)


def routes_from_response(response: Any, reader: Any = None, *,
                         timeout: float = DEFAULT_RESOLVE_TIMEOUT_S) -> RoutingRecord:
    """The record a FastDeploy response carries, as it carries it.

    ``response``: the ``routed_experts`` text (base64), a parsed response or stream chunk
    (:func:`routed_experts_of`).  An rr-v1 record is decoded and verified; a reference is
    resolved through ``reader`` (a :class:`~fd_routing_replay.reader.RoutingReader`: its
    :meth:`~fd_routing_replay.reader.RoutingReader.resolve`; or a store:
    :func:`resolve_reference`).  RecordError when there are no routes, the text
    is not base64, or it is neither.
    """
    text = routed_experts_of(response)
    if not text:
        raise RecordError("the response carries no routes (no routed_experts; a stream carries them "
                          "in its last chunk's metrics, with response.stream on and collect_metrics "
                          "set in the request)")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RecordError(f"routed_experts is not base64: {exc}") from None
    if data[:len(MAGIC)] == MAGIC:
        record = decode_record(data, verify=True)
        check_expert_range(record)
        return record
    if looks_like_reference(data):
        if reader is None:
            raise RecordError("the response carries a reference to a stored record; pass a "
                              "RoutingReader (or store) on the engine's store to resolve it")
        resolve = getattr(reader, "resolve", None)        # a RoutingReader: its own checks too
        if callable(resolve):
            return resolve(data, timeout=timeout)
        return resolve_reference(reader, data, timeout=timeout)
    raise RecordError(f"routed_experts is neither an rr-v1 record (magic {MAGIC!r}) nor a "
                      f"reference (first bytes {data[:8]!r}): FastDeploy's own routing data?")
