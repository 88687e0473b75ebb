"""How a record is encoded for the store: one rule for the background writer and the
inline ``StoreSink``.

``capture.encoding`` picks the rr-v1 payload encoding; a record the ``set`` encoding
cannot hold is still written, plain, and the caller is told so it can log it.
"""

from __future__ import annotations

from collections.abc import Callable

from fd_routing_replay.codec import RecordFormat, RoutingRecord, encode_record_parts
from fd_routing_replay.codec.setcodec import SetEncodingError

__all__ = ["encode_for_store"]


def encode_for_store(record: RoutingRecord, *, encoding: str, record_format: str,
                     converts: bool,
                     on_fallback: Callable[[SetEncodingError], None]) -> tuple[bytes, memoryview]:
    """The rr-v1 parts (header, payload) of ``record`` in ``encoding``.

    The encoding applies to rr-v1 records for a store that keeps records as they are; a
    store that ``converts`` records (FastDeploy's layouts) decodes them anyway, so it gets
    them plain.  A record the set encoding cannot hold (a row that is not top_k distinct
    expert ids or all fill value, or ranks wider than the codec's ``MAX_RANK_BITS`` = 128,
    e.g. E = 256, k = 32) is encoded plain after ``on_fallback(exc)``.
    """
    if encoding != "plain" and record_format == RecordFormat.RR_V1 and not converts:
        try:
            return encode_record_parts(record, encoding=encoding)
        except SetEncodingError as exc:
            on_fallback(exc)
    return encode_record_parts(record)
