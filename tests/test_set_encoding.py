"""The ``set`` payload encoding of rr-v1 (fd_routing_replay.codec.setcodec through the codec),
and the internals of the NumPy oracle (tests/set_oracle.py) the compiled codec is checked against.

References are independent of the implementation: sorted rows (numpy) for what a reader
gets back, and a pure-Python encoder (``math.comb``, one Python int as the bit stream)
written from docs/record-format.md for the exact bytes.
"""

from __future__ import annotations

import itertools
import math
import struct

import msgpack
import numpy as np
import pytest
import xxhash

from fd_routing_replay.codec import (
    MAGIC,
    RoutingRecord,
    decode_record,
    encode_record,
    encode_record_parts,
    read_header,
    routing_dtype,
)
from fd_routing_replay.codec.setcodec import (
    SetEncodingError,
    decode_sets,
    encode_sets,
    rank_bits,
)
from fd_routing_replay.errors import RecordError
from tests.set_oracle import (
    binomial_columns,
    extended_columns,
    sorting_network,
    unrank_column,
)

ROLLOUT = "exp_set:gen3:0:0"


@pytest.fixture
def nprng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


def random_sets(nprng, layers: int, tokens: int, num_experts: int, top_k: int,
                dtype: np.dtype) -> np.ndarray:
    """``[L, T, K]`` rows of ``top_k`` distinct ids in random order."""
    keys = nprng.random((layers * tokens, num_experts))
    rows = np.argsort(keys, axis=1)[:, :top_k]
    return rows.astype(dtype).reshape(layers, tokens, top_k)


def reference_payload(ids: np.ndarray, num_experts: int, fill_value: int) -> bytes:
    """docs/record-format.md, "set" encoding, in plain Python."""
    top_k = ids.shape[2]
    rows = ids.reshape(-1, top_k).tolist()
    if not rows or top_k == 0:
        return b""
    padding_rank = math.comb(num_experts, top_k)
    bits = padding_rank.bit_length()
    stream = 0
    for n, row in enumerate(rows):
        if all(v == fill_value for v in row):
            rank = padding_rank
        else:
            rank = sum(math.comb(c, i + 1) for i, c in enumerate(sorted(row)))
        stream |= rank << (n * bits)
    return stream.to_bytes(-(-len(rows) * bits // 8), "little")


def reference_ranks(payload: bytes, count: int, bits: int) -> list[int]:
    stream = int.from_bytes(payload, "little")
    return [(stream >> (n * bits)) & ((1 << bits) - 1) for n in range(count)]


def rebuild(header: dict, payload: bytes) -> bytes:
    packed = msgpack.packb(header, use_bin_type=True)
    end = 10 + len(packed)
    return struct.pack("<4sHI", MAGIC, 1, len(packed)) + packed + bytes(-end % 64) + payload


def split(buffer: bytes) -> tuple[dict, bytes]:
    _, _, length = struct.unpack_from("<4sHI", buffer, 0)
    header = msgpack.unpackb(buffer[10:10 + length], raw=False)
    return header, bytes(buffer[(10 + length + 63) // 64 * 64:])


# --------------------------------------------------------------------- round trips


@pytest.mark.parametrize("num_experts", [8, 64, 160, 256])
@pytest.mark.parametrize("top_k", [1, 2, 6, 8])
def test_round_trip_returns_sorted_input(nprng, num_experts, top_k):
    dtype = routing_dtype(num_experts)
    for _ in range(3):
        layers, tokens = int(nprng.integers(1, 4)), int(nprng.integers(0, 200))
        ids = random_sets(nprng, layers, tokens, num_experts, top_k, dtype)
        fill = int(np.iinfo(dtype).max)
        if tokens:
            padded = nprng.random((layers, tokens)) < 0.1
            ids[padded] = fill
        original = ids.copy()
        record = RoutingRecord(ROLLOUT, ids, num_experts, metadata={"m": 1}, layers=None)
        buffer = encode_record(record, encoding="set")
        decoded = decode_record(buffer, check_range=True)
        np.testing.assert_array_equal(ids, original)  # the input is left alone
        assert decoded.ids.dtype == ids.dtype and decoded.ids.shape == ids.shape
        np.testing.assert_array_equal(decoded.ids, np.sort(original, axis=2))
        assert not decoded.ids.flags.writeable
        assert decoded.fill_value == fill and decoded.metadata == {"m": 1}
        header, payload = split(buffer)
        assert header["co"] == "set"
        assert payload == reference_payload(original, num_experts, fill)
        assert read_header(buffer).encoding == "set"


@pytest.mark.parametrize(("num_experts", "top_k", "dtype"),
                         [(8, 3, np.uint8), (160, 6, np.uint32), (256, 8, np.uint16),
                          (1000, 4, np.uint16), (64, 32, np.uint8)])
def test_payload_is_the_documented_bit_stream(nprng, num_experts, top_k, dtype):
    ids = random_sets(nprng, 2, 157, num_experts, top_k, dtype)  # 314 rows: a partial group
    fill = num_experts  # the smallest legal fill value
    ids[1, 3] = fill
    payload = encode_sets(ids, num_experts, fill)
    assert payload.tobytes() == reference_payload(ids, num_experts, fill)
    decoded = decode_sets(payload.tobytes(), ids.shape, num_experts, fill, np.dtype(dtype))
    np.testing.assert_array_equal(decoded, np.sort(ids, axis=2))


def test_the_documented_example():
    """docs/record-format.md, "Payload encoding set", Example."""
    ids = np.array([[[5, 1, 3], [255, 255, 255]]], dtype=np.uint8)
    header, payload = split(encode_record(RoutingRecord(ROLLOUT, ids, 8), encoding="set"))
    assert header["pl"] == 2 and payload == bytes.fromhex("0e0e")
    decoded = decode_record(rebuild(header, payload))
    assert decoded.ids.tolist() == [[[1, 3, 5], [255, 255, 255]]]


def test_ranks_enumerate_every_set_in_colex_order():
    num_experts, top_k = 9, 4
    sets = sorted(itertools.combinations(range(num_experts), top_k), key=lambda c: c[::-1])
    ids = np.array(sets, dtype=np.uint8)[None]
    bits = rank_bits(num_experts, top_k)
    ranks = reference_ranks(encode_sets(ids, num_experts, 255).tobytes(), len(sets), bits)
    assert ranks == list(range(math.comb(num_experts, top_k)))


def test_order_inside_a_row_does_not_matter(nprng):
    ids = random_sets(nprng, 2, 50, 64, 6, np.uint8)
    shuffled = np.ascontiguousarray(ids[:, :, nprng.permutation(6)])
    assert encode_sets(ids, 64, 255).tobytes() == encode_sets(shuffled, 64, 255).tobytes()


# --------------------------------------------------------------------- edge cases


def test_k_equals_num_experts_needs_one_bit_per_row(nprng):
    ids = np.stack([nprng.permutation(8) for _ in range(10)]).astype(np.uint8)[None]
    ids[0, 4] = 255
    buffer = encode_record(RoutingRecord(ROLLOUT, ids, 8), encoding="set")
    header, payload = split(buffer)
    assert header["pl"] == 2 and payload == bytes([0b00010000, 0])
    expected = np.tile(np.arange(8, dtype=np.uint8), (10, 1))[None].copy()
    expected[0, 4] = 255
    np.testing.assert_array_equal(decode_record(buffer).ids, expected)


def test_k_one_and_maximal_ids(nprng):
    ids = np.array([[[0], [63], [255], [62]]], dtype=np.uint8)
    decoded = decode_record(encode_record(RoutingRecord(ROLLOUT, ids, 64), encoding="set"))
    np.testing.assert_array_equal(decoded.ids, ids)
    top = np.arange(248, 256, dtype=np.uint16)[::-1]  # the largest set: rank C(256, 8) - 1
    ids = np.stack([top, np.arange(8, dtype=np.uint16), np.full(8, 256, np.uint16)])[None]
    record = RoutingRecord(ROLLOUT, ids.copy(), 256, fill_value=256)
    buffer = encode_record(record, encoding="set")
    ranks = reference_ranks(split(buffer)[1], 3, 49)
    assert ranks == [math.comb(256, 8) - 1, 0, math.comb(256, 8)]
    np.testing.assert_array_equal(decode_record(buffer, check_range=True).ids,
                                  np.sort(ids, axis=2))


@pytest.mark.parametrize("shape", [(0, 0, 8), (3, 0, 8), (0, 5, 2), (2, 3, 0)])
def test_empty_records(shape):
    ids = np.zeros(shape, dtype=np.uint8)
    buffer = encode_record(RoutingRecord(ROLLOUT, ids, 64), encoding="set")
    header, payload = split(buffer)
    assert header["co"] == "set" and header["pl"] == 0 and payload == b""
    decoded = decode_record(buffer)
    assert decoded.ids.shape == shape and decoded.ids.dtype == np.uint8


def test_padding_rows_survive_exactly_with_any_fill_value(nprng):
    ids = random_sets(nprng, 3, 40, 100, 5, np.uint8)
    ids[:, 10:20] = 200
    ids[2, 39] = 200
    record = RoutingRecord(ROLLOUT, ids, 100, fill_value=200)
    decoded = decode_record(encode_record(record, encoding="set"))
    assert decoded.fill_value == 200
    np.testing.assert_array_equal(decoded.ids == 200, ids == 200)
    np.testing.assert_array_equal(decoded.ids, np.sort(ids, axis=2))


@pytest.mark.parametrize(("row", "what"), [
    ([3, 3, 7], "distinct"),
    ([3, 255, 7], "distinct"),      # partly padding
    ([3, 64, 7], "below num_experts 64"),
    ([3, 100, 7], "below num_experts 64"),
])
def test_rows_that_are_not_sets_are_refused_by_name(nprng, row, what):
    ids = random_sets(nprng, 2, 5, 64, 3, np.uint8)
    ids[1, 2] = row
    with pytest.raises(SetEncodingError, match=r"\[layer 1, token 2\]") as info:
        encode_record_parts(RoutingRecord(ROLLOUT, ids, 64), encoding="set")
    assert what in str(info.value) and "plain" in str(info.value)
    assert isinstance(info.value, RecordError)
    # the plain encoding keeps such a record exactly
    np.testing.assert_array_equal(decode_record(encode_record(RoutingRecord(ROLLOUT, ids, 64))).ids,
                                  ids)


def test_too_wide_ranks_and_too_many_experts_are_refused():
    ids = np.zeros((1, 1, 32), dtype=np.uint16)
    bits = math.comb(256, 32).bit_length()  # 136: above the 128 supported
    with pytest.raises(SetEncodingError, match=rf"C\(256, 32\) needs {bits} bits per row"):
        encode_record(RoutingRecord(ROLLOUT, ids, 256), encoding="set")
    ids = np.zeros((1, 1, 2), dtype=np.uint32)
    with pytest.raises(SetEncodingError, match="num_experts 70000 is above the 65536"):
        encode_record(RoutingRecord(ROLLOUT, ids, 70000), encoding="set")


def test_unknown_encoding_on_encode():
    with pytest.raises(RecordError, match="unknown encoding 'zip'"):
        encode_record(RoutingRecord(ROLLOUT, np.zeros((1, 1, 1), np.uint8), 8), encoding="zip")


# --------------------------------------------------------------------- bad input


def set_record(nprng) -> tuple[dict, bytes]:
    ids = random_sets(nprng, 2, 30, 64, 2, np.uint8)
    return split(encode_record(RoutingRecord(ROLLOUT, ids, 64), encoding="set"))


def test_unknown_encoding_is_refused_by_name(nprng):
    header, payload = set_record(nprng)
    header["co"] = "nosuch"
    for call in (decode_record, read_header):
        with pytest.raises(RecordError, match=r"unknown encoding 'nosuch'.*'raw' \(plain\), "
                                              r"'set' \(set\)"):
            call(rebuild(header, payload))


def test_corrupt_payload_fails_the_checksum(nprng):
    header, payload = set_record(nprng)
    damaged = bytearray(payload)
    damaged[3] ^= 0x10
    with pytest.raises(RecordError, match="checksum mismatch"):
        decode_record(rebuild(header, bytes(damaged)))


def test_rank_out_of_range_is_refused_even_without_the_checksum(nprng):
    header, payload = set_record(nprng)  # 60 rows of 11 bits: ranks up to C(64, 2) = 2016
    damaged = b"\xff\xff" + payload[2:]  # row 0 becomes 2047
    header["cs"] = xxhash.xxh3_64_intdigest(damaged)
    with pytest.raises(RecordError, match=r"row 0 holds rank 2047, above the largest"):
        decode_record(rebuild(header, damaged))


def test_non_zero_trailing_bits_are_refused(nprng):
    header, payload = set_record(nprng)  # 660 bits: the last byte has 4 unused bits
    damaged = payload[:-1] + bytes([payload[-1] | 0x80])
    header["cs"] = xxhash.xxh3_64_intdigest(damaged)
    with pytest.raises(RecordError, match="non-zero bits after the last of 60 rows"):
        decode_record(rebuild(header, damaged))


def test_truncated_and_mislabelled_payloads_are_refused(nprng):
    header, payload = set_record(nprng)
    buffer = rebuild(header, payload)
    with pytest.raises(RecordError, match="truncated record"):
        decode_record(buffer[:-1])
    plain_length = dict(header, pl=60 * 2)  # the plain size is not the set size
    with pytest.raises(RecordError, match=r"disagrees with shape .* encoding 'set' \(83 bytes\)"):
        decode_record(rebuild(plain_length, payload))
    too_wide = dict(header, ne=256, k=32, dt="uint16", fv=65535, sh=[2, 30, 32])
    with pytest.raises(RecordError, match="'co'.*needs 136 bits"):
        decode_record(rebuild(too_wide, payload))
    too_many = dict(header, ne=4_000_000_000, dt="uint32", fv=4_000_000_001)
    with pytest.raises(RecordError, match="'co'.*num_experts 4000000000 is above"):
        decode_record(rebuild(too_many, payload))
    with pytest.raises(RecordError, match="set payload has 82 bytes"):
        decode_sets(payload[:-1], (2, 30, 2), 64, 255, np.dtype(np.uint8))


# --------------------------------------------------------------------- internals


@pytest.mark.parametrize(("num_experts", "top_k"),
                         [(1, 1), (2, 2), (8, 8), (64, 8), (160, 8), (256, 8), (1000, 7),
                          (65536, 3)])  # the last one: a coarse table, several steps
def test_unranking_a_column_matches_a_binary_search(nprng, num_experts, top_k):
    binomials = binomial_columns(num_experts, top_k)
    extended = extended_columns(num_experts, top_k)
    for j in range(2, top_k + 1):
        column = binomials[j]
        limit = min(math.comb(num_experts, j), 2**64 - 1)
        edges = np.array([c for n in range(num_experts) for c in (math.comb(n, j) - 1,
                          math.comb(n, j), math.comb(n, j) + 1) if 0 <= c < limit],
                         dtype=np.uint64)
        spread = (nprng.random(5000) * (limit - 1)).astype(np.uint64)
        ranks = np.concatenate([edges, spread, np.array([0, limit - 1], np.uint64)])
        expected = np.searchsorted(column, ranks, side="right") - 1
        np.testing.assert_array_equal(unrank_column(ranks, j, num_experts, extended[j]),
                                      expected)


@pytest.mark.parametrize("size", range(1, 13))
def test_sorting_network_sorts_every_zero_one_input(size):
    rows = np.array(list(itertools.product((0, 1), repeat=size)), dtype=np.uint8)
    columns = list(rows.T.copy())
    for low, high in sorting_network(size):
        columns[low], columns[high] = (np.minimum(columns[low], columns[high]),
                                       np.maximum(columns[low], columns[high]))
    np.testing.assert_array_equal(np.stack(columns, axis=1), np.sort(rows, axis=1))


# --------------------------------------------------------------------- configuration


def test_capture_encoding_config():
    from fd_routing_replay.config import config_from_dict
    from fd_routing_replay.errors import ConfigError

    assert config_from_dict({}).capture.encoding == "plain"
    assert config_from_dict({"capture": {"encoding": "set"}}).capture.encoding == "set"
    with pytest.raises(ConfigError, match=r"capture\.encoding.*'zip'"):
        config_from_dict({"capture": {"encoding": "zip"}})
    with pytest.raises(ConfigError, match="applies to rr-v1 records"):
        config_from_dict({"capture": {"encoding": "set", "record_format": "fastdeploy-raw"},
                          "store": {"local": {"layout": "fastdeploy"}}})
