"""Every single-bit flip anywhere in an rr-v1 record is refused (issue #21).

Format version 2 covers every byte: prefix and msgpack header by the header checksum, the
header checksum by comparison, the padding by the zero check, the payload by ``cs``.  The
tests flip each bit of small records of both encodings, with and without a layer map,
metadata and provenance, and require a RecordError each time.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash

from fd_routing_replay.codec.record import Provenance, RoutingRecord
from fd_routing_replay.codec.rr_v1 import decode_record, encode_record, read_header
from fd_routing_replay.errors import RecordError
from tests.test_codec import rebuild, split_layout


@pytest.fixture
def nprng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


def set_rows(nprng, shape: tuple[int, int, int], num_experts: int, fill: int,
             padding_rows: int = 1) -> np.ndarray:
    """``[L, T, K]`` of distinct ids per row (storable as sets), the last tokens padding."""
    layers, tokens, top_k = shape
    ids = np.argsort(nprng.random((layers, tokens, num_experts)), axis=-1)[..., :top_k]
    ids = ids.astype(np.uint8)
    if padding_rows:
        ids[:, tokens - padding_rows:] = fill
    return np.ascontiguousarray(ids)


VARIANTS = {
    "plain, bare": dict(encoding="plain"),
    "plain, layer map": dict(encoding="plain", layers=(1, 2, 4)),
    "plain, everything": dict(encoding="plain", layers=(3, 5, 7), metadata={"step": 12, "t": "x"},
                              provenance=Provenance(num_decoder_layers=9, weights_version="w-7",
                                                    tokens_hash=2**63 + 5, segments=(0, 2))),
    "set, bare": dict(encoding="set"),
    "set, layer map": dict(encoding="set", layers=(0, 2, 4)),
    "set, everything": dict(encoding="set", layers=(10, 11, 12), metadata={"k": [1, 2]},
                            provenance=Provenance(num_decoder_layers=13, weights_version="s",
                                                  tokens_hash=1, segments=(0, 3))),
}


def make(nprng, variant: str) -> tuple[RoutingRecord, bytes]:
    options = dict(VARIANTS[variant])
    encoding = options.pop("encoding")
    ids = set_rows(nprng, (3, 4, 2), 64, 255)
    record = RoutingRecord("a:0:0", ids, 64, created=1.5e9, producer={"v": "1", "h": "n", "p": 7},
                           **options)
    return record, encode_record(record, encoding=encoding)


def flipped(buffer: bytes, bit: int) -> bytes:
    out = bytearray(buffer)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_single_bit_flip_is_refused(nprng, variant):
    record, buffer = make(nprng, variant)
    decoded = decode_record(buffer, check_range=True)
    reference = np.sort(record.ids, axis=-1) if "set" in variant else record.ids
    np.testing.assert_array_equal(decoded.ids, reference)  # the intact record reads back
    assert read_header(buffer).header_verified
    passed = []
    for bit in range(len(buffer) * 8):
        try:
            decode_record(flipped(buffer, bit))
        except RecordError:
            continue
        passed.append((bit // 8, bit % 8))
    assert passed == [], f"{len(passed)} single-bit flips decoded without error: {passed[:10]}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_flip_of_the_header_region_is_refused_by_read_header(nprng, variant):
    """``read_header(..., require_payload=False)`` on a prefix (what sliced reads fetch)
    verifies the header checksum and the padding it holds."""
    _, buffer = make(nprng, variant)
    header = read_header(buffer)
    for length in (10 + header.header_length + 8, header.payload_offset):
        head = buffer[:length]
        assert read_header(head, require_payload=False) == header
        for bit in range(length * 8):
            with pytest.raises(RecordError):
                read_header(flipped(head, bit), require_payload=False)


def test_issue_reproductions_are_refused():
    """The three cases of issue #21: an ``lm`` value, the ``lm`` key, ``ne`` of a set record."""
    record = RoutingRecord("a:0:0", np.zeros((3, 4, 2), np.uint8), 8, layers=(1, 2, 4))
    buffer = encode_record(record)
    at = buffer.index(b"\xa2lm")
    for position in (at + 6, at + 1):           # the value 4 -> 5; "lm" -> "mm"
        with pytest.raises(RecordError, match="header checksum mismatch"):
            decode_record(flipped(buffer, position * 8))
    ids = np.full((1, 2, 2), 255, np.uint8)
    ids[0, 0] = (3, 9)
    sets = encode_record(RoutingRecord("s:0:0", ids, 64), encoding="set")
    at = sets.index(b"\xa2ne") + 3               # 64 (0x40) -> 65
    assert sets[at] == 64
    with pytest.raises(RecordError, match="header checksum mismatch"):
        decode_record(flipped(sets, at * 8))


def test_version_1_records_are_reported_unverified():
    """A version-1 record (no header checksum) still decodes, flagged: the flip of issue
    #21 goes through there, which is what ``header_verified`` False warns of."""
    record = RoutingRecord("a:0:0", np.zeros((3, 4, 2), np.uint8), 8, layers=(1, 2, 4))
    _, version, header, _, payload = split_layout(encode_record(record))
    assert version == 2
    old = rebuild(header, payload, version=1)
    assert struct.unpack_from("<H", old, 4) == (1,)
    assert read_header(old).header_verified is False
    at = old.index(b"\xa2lm") + 6
    corrupted = decode_record(flipped(old, at * 8))
    assert corrupted.layers == (1, 2, 5)             # silently wrong: nothing covers v1 headers
    assert header["cs"] == xxhash.xxh3_64_intdigest(payload)


def test_downgrade_needs_two_flips(nprng):
    """Versions 1 and 2 differ in two bits; writing 1 over a version-2 record is refused."""
    assert bin(1 ^ 2).count("1") == 2
    for variant in sorted(VARIANTS):
        _, buffer = make(nprng, variant)
        downgraded = bytearray(buffer)
        downgraded[4] = 1
        with pytest.raises(RecordError):
            decode_record(bytes(downgraded))
