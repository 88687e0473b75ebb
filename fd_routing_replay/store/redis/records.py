"""How the redis store lays out one record: a HASH ``rr:{ns/KEY}`` with fields ``n`` (chunk
count), ``s`` (total size) and ``0`` … ``n-1``, the record cut into chunks of at most
``chunk_bytes``.

Cutting (:func:`cut_chunks`), reassembling (:func:`assemble`) and checking the layout of
stored records without reading their data (:func:`record_problems`, for ``fd-rr fsck``)
live here, apart from the store's commands, so the layout is written down in one place.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from fd_routing_replay.errors import PermanentStoreError
from fd_routing_replay.store.base import Buffer

__all__ = ["COUNT_FIELD", "DEFAULT_CHUNK_BYTES", "KEY_PREFIX", "SIZE_FIELD", "assemble",
           "cut_chunks", "decimal", "payload_key", "record_problems"]

KEY_PREFIX = "rr"
DEFAULT_CHUNK_BYTES = 2**20  # store.redis.chunk_bytes's default (docs/stores.md: why)
COUNT_FIELD, SIZE_FIELD = b"n", b"s"


def payload_key(namespace: str, key: str, key_prefix: str = KEY_PREFIX) -> str:
    """The Redis key of a record's HASH: ``rr:{ns/KEY}`` (hash tag = namespace and key)."""
    return f"{key_prefix}:{{{namespace}/{key}}}"


def cut_chunks(parts: Sequence[Buffer], chunk_bytes: int) -> Iterator[bytes | memoryview]:
    """Cut the concatenation of ``parts`` into chunks without joining what needs no join."""
    pending: list[memoryview] = []
    pending_size = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while view.nbytes:
            room = chunk_bytes - pending_size
            piece, view = view[:room], view[room:]
            pending.append(piece)
            pending_size += piece.nbytes
            if pending_size == chunk_bytes:
                yield pending[0] if len(pending) == 1 else b"".join(pending)
                pending, pending_size = [], 0
    if pending:
        yield pending[0] if len(pending) == 1 else b"".join(pending)


def decimal(value: Any) -> int | None:
    """``value`` (a Redis reply) as a non-negative int, or None."""
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    return int(text) if isinstance(text, str) and text.isdigit() and text.isascii() else None


def assemble(key: str, fields: dict[bytes, bytes]) -> bytes:
    """The record ``key`` from its HASH's ``fields`` (``HGETALL``); ``PermanentStoreError``
    when they do not add up."""
    try:
        count, size = int(fields[COUNT_FIELD]), int(fields[SIZE_FIELD])
        chunks = [fields[str(number).encode()] for number in range(count)]
    except (KeyError, ValueError) as exc:
        raise PermanentStoreError(
            f"redis record {key!r} is malformed (fields {sorted(fields)[:8]}): missing or bad "
            f"{exc}; delete it and write it again") from exc
    value = chunks[0] if count == 1 else b"".join(chunks)
    if len(value) != size:
        raise PermanentStoreError(
            f"redis record {key!r} has {len(value)} bytes but its header says {size}")
    return value


def record_problems(client: Any, pkeys: Sequence[str]) -> list[str | None]:
    """For each record HASH ``pkeys[i]``, why it cannot be read back, or None (intact or
    gone).

    Checks the layout without reading the data: a HASH whose ``n`` and ``s`` are decimal,
    with chunks ``0`` … ``n-1`` all present and holding ``s`` bytes together.  Two
    pipelined round trips (``TYPE`` + ``HLEN`` + ``HMGET n s``, then one ``HSTRLEN`` per
    chunk).
    """
    pipe = client.pipeline(transaction=False)
    for pkey in pkeys:
        pipe.type(pkey)
        pipe.hlen(pkey)
        pipe.hmget(pkey, [COUNT_FIELD, SIZE_FIELD])
    replies = pipe.execute(raise_on_error=False)
    problems: list[str | None] = []
    headers: dict[int, tuple[int, int]] = {}
    for number in range(len(pkeys)):
        kind, fields, header = replies[3 * number:3 * number + 3]
        kind = kind.decode() if isinstance(kind, bytes) else str(kind)
        problems.append(None)
        if kind == "none":
            continue  # deleted since the scan
        if kind != "hash":
            problems[number] = (f"wrong Redis type {kind!r} (a record is a hash with "
                                "fields n, s, 0..n-1)")
            continue
        count, size = decimal(header[0]), decimal(header[1])
        if count is None or size is None:
            problems[number] = (f"bad record header: n={header[0]!r}, s={header[1]!r} "
                                "(both must be decimal)")
        elif int(fields) - 2 < count:
            problems[number] = (f"{count - (int(fields) - 2)} of its {count} chunk(s) are "
                                "missing")
        else:
            headers[number] = (count, size)
    if headers:
        pipe = client.pipeline(transaction=False)
        for number, (count, _) in headers.items():
            for chunk in range(count):
                pipe.hstrlen(pkeys[number], str(chunk))
        lengths = iter(pipe.execute())
        for number, (count, size) in headers.items():
            chunk_sizes = [int(next(lengths)) for _ in range(count)]
            missing = [chunk for chunk, length in enumerate(chunk_sizes) if length == 0]
            if missing:
                problems[number] = (f"chunk(s) {missing[:5]} of 0..{count - 1} are missing "
                                    "or empty")
            elif sum(chunk_sizes) != size:
                problems[number] = (f"its chunks hold {sum(chunk_sizes)} bytes but its "
                                    f"header says {size}")
    return problems
