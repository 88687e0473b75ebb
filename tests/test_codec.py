"""Record format rr-v1 and fastdeploy-raw (fd_routing_replay.codec), checked against numpy."""

from __future__ import annotations

import math
import os
import struct
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fd_routing_replay import __version__
from fd_routing_replay.codec import (
    MAGIC,
    MAX_HEADER_BYTES,
    RoutingRecord,
    check_expert_range,
    decode_fastdeploy_raw,
    decode_record,
    encode_fastdeploy_raw,
    encode_record,
    encode_record_parts,
    header_region_length,
    read_header,
    routing_dtype,
)
from fd_routing_replay.errors import RecordError

# dtype name -> (numpy dtype, num_experts used in tests): uint16/uint32 exceed the smaller
# types' ranges so a narrowing or bfloat16 mix-up cannot hide.
DTYPES = {"uint8": (np.uint8, 200), "uint16": (np.uint16, 3000), "uint32": (np.uint32, 70000)}
ROLLOUT = "exp_epoch_3_data00042:gen7:0:0"


@pytest.fixture
def nprng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


def make_record(nprng, dtype="uint16", shape=(3, 17, 4), *, rollout=ROLLOUT, fill_rows=0,
                **kwargs) -> RoutingRecord:
    np_dtype, num_experts = DTYPES[dtype]
    ids = nprng.integers(0, num_experts, size=shape, dtype=np.int64).astype(np_dtype)
    record = RoutingRecord(rollout_id=rollout, ids=ids, num_experts=num_experts, **kwargs)
    if fill_rows and shape[1]:
        ids[:, -fill_rows:, :] = record.fill_value
    return record


# --------------------------------------------------------------------- layout reference


def split_layout(buffer: bytes) -> tuple[int, int, dict, int, bytes]:
    """Parse a record by the documented byte layout, independently of the codec: version 2
    has an 8-byte xxh3_64 of bytes [0, 10 + H) after the header, version 1 none."""
    magic, version, header_len = struct.unpack_from("<4sHI", buffer, 0)
    header = msgpack.unpackb(buffer[10 : 10 + header_len], raw=False)
    region_end = 10 + header_len
    if version == 2:
        (stored,) = struct.unpack_from("<Q", buffer, region_end)
        assert stored == xxhash.xxh3_64_intdigest(buffer[:region_end])
        region_end += 8
    payload_offset = (region_end + 63) // 64 * 64
    assert not any(buffer[region_end:payload_offset])
    return magic, version, header, payload_offset, bytes(buffer[payload_offset:])


def rebuild(header: dict, payload: bytes, *, magic: bytes = MAGIC, version: int = 2,
            padding_byte: int = 0) -> bytes:
    """Assemble a record by hand from a header dict (to test the decoder on variants):
    version 2 (the default) gets a correct header checksum, version 1 none."""
    packed = msgpack.packb(header, use_bin_type=True)
    start = struct.pack("<4sHI", magic, version, len(packed)) + packed
    if version == 2:
        start += struct.pack("<Q", xxhash.xxh3_64_intdigest(start))
    pad = (-len(start)) % 64
    return start + bytes([padding_byte]) * pad + payload


def base_header(nprng) -> tuple[dict, bytes]:
    buffer = bytes(encode_record(make_record(nprng, created=1.5e9)))
    _, _, header, _, payload = split_layout(buffer)
    return header, payload


# --------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_round_trip_every_dtype(nprng, dtype):
    for _ in range(20):
        shape = tuple(int(d) for d in nprng.integers(0, 9, size=3))
        record = make_record(nprng, dtype, shape, fill_rows=int(shape[1] > 2))
        buffer = encode_record(record)
        decoded = decode_record(buffer, check_range=True)
        assert decoded.ids.dtype == np.dtype(DTYPES[dtype][0])
        assert decoded.ids.shape == shape
        np.testing.assert_array_equal(decoded.ids, record.ids)
        assert decoded.num_experts == record.num_experts
        assert decoded.fill_value == np.iinfo(DTYPES[dtype][0]).max
        # Independent reference: the documented layout and numpy's own bytes.
        magic, version, header, offset, payload = split_layout(bytes(buffer))
        assert (magic, version, offset % 64) == (MAGIC, 2, 0)
        assert payload == record.ids.astype(record.ids.dtype.newbyteorder("<")).tobytes()
        assert header["cs"] == xxhash.xxh3_64_intdigest(payload)


def test_large_values_survive(nprng):
    for dtype, low in (("uint16", 256), ("uint32", 65536)):
        record = make_record(nprng, dtype, (4, 64, 8))
        assert record.ids.max() > low
        np.testing.assert_array_equal(decode_record(encode_record(record)).ids, record.ids)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.tuples(st.integers(0, 6), st.integers(0, 40), st.integers(0, 9)),
       dtype=st.sampled_from(sorted(DTYPES)), seed=st.integers(0, 2**32 - 1))
def test_round_trip_random_shapes(shape, dtype, seed):
    record = make_record(np.random.default_rng(seed), dtype, shape)
    decoded = decode_record(encode_record(record))
    assert decoded.ids.shape == shape
    np.testing.assert_array_equal(decoded.ids, record.ids)


@pytest.mark.parametrize("shape", [(0, 10, 8), (5, 0, 8), (5, 10, 0), (0, 0, 0)])
def test_empty_records_round_trip(nprng, shape):
    record = make_record(nprng, "uint8", shape)
    buffer = encode_record(record)
    assert len(buffer) % 64 == 0  # header padded; empty payload
    decoded = decode_record(buffer)
    assert decoded.ids.shape == shape and decoded.ids.dtype == np.uint8
    assert (decoded.num_layers, decoded.num_tokens, decoded.top_k) == shape


def test_decode_is_zero_copy_and_read_only(nprng):
    record = make_record(nprng, "uint16", (4, 50, 8))
    for buffer in (encode_record(record), bytes(encode_record(record))):
        decoded = decode_record(buffer)
        assert np.shares_memory(decoded.ids, np.frombuffer(buffer, dtype=np.uint8))
        assert not decoded.ids.flags.writeable
        with pytest.raises(ValueError):
            decoded.ids[0, 0, 0] = 1


def test_decode_accepts_memoryview_and_numpy_buffers(nprng):
    record = make_record(nprng, "uint32", (2, 9, 3))
    raw = bytes(encode_record(record))
    padded = b"xx" + raw + b"yy"
    for buffer in (memoryview(raw), memoryview(padded)[2:-2], np.frombuffer(raw, np.uint8)):
        np.testing.assert_array_equal(decode_record(buffer).ids, record.ids)


def test_parts_concatenate_to_the_record(nprng):
    record = make_record(nprng, "uint16", (3, 33, 6), created=1.7e9, metadata={"step": 3})
    head, payload = encode_record_parts(record)
    assert isinstance(head, bytes) and isinstance(payload, memoryview)
    assert payload.readonly and np.shares_memory(np.frombuffer(payload, np.uint8), record.ids)
    full = encode_record(record)
    assert isinstance(full, bytes) and head + bytes(payload) == full
    assert len(head) % 64 == 0


def test_header_fits_in_256_bytes(nprng):
    rollout = "exp_epoch_3_data00042:gen7:1:0:0".ljust(40, "x")
    assert len(rollout) == 40
    # Dims below 128 pack as one msgpack byte whatever their value, so small L and K give
    # the same header size as production's 60 layers x top-8 without allocating GBs.
    record = make_record(nprng, "uint16", (1, 32768, 1), rollout=rollout, layers=[120])
    head, _ = encode_record_parts(record)
    assert len(head) <= 256
    long_host = dict(v=__version__, h="h" * 64, p=4194304)  # longest host name, large pid
    head, _ = encode_record_parts(make_record(nprng, "uint32", (1, 131072, 1), rollout=rollout,
                                              producer=long_host))
    assert len(head) <= 320


def test_header_stays_small_with_200_layers(nprng):
    """The layer map of a 200-layer model: compact when evenly spaced, bounded when not."""
    rollout = "exp_epoch_3_data00042:gen7:1:0:0".ljust(40, "x")
    contiguous = make_record(nprng, "uint8", (200, 2, 1), rollout=rollout, layers=range(3, 203))
    head, _ = encode_record_parts(contiguous)
    assert len(head) <= 256
    irregular = sorted(int(i) for i in nprng.choice(2**16, size=200, replace=False))
    record = make_record(nprng, "uint8", (200, 2, 1), rollout=rollout, layers=irregular)
    head, _ = encode_record_parts(record)
    assert len(head) <= 1024 < MAX_HEADER_BYTES  # at most 3 bytes per explicit index
    assert decode_record(head + bytes(record.ids)).layers == tuple(irregular)


# --------------------------------------------------------------------- header fields


def test_field_rollout_id(nprng):
    assert read_header(encode_record(make_record(nprng, rollout="r:1:2"))).rollout_id == "r:1:2"
    assert decode_record(encode_record(make_record(nprng, rollout="实验:0:0"))).rollout_id == "实验:0:0"


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_field_dtype(nprng, dtype):
    assert read_header(encode_record(make_record(nprng, dtype))).dtype == dtype


def test_field_shape_and_top_k(nprng):
    header = read_header(encode_record(make_record(nprng, shape=(7, 11, 5))))
    assert header.shape == (7, 11, 5) and header.top_k == 5 and header.layout == "LTK"


def test_field_num_experts(nprng):
    record = make_record(nprng, "uint8")
    record.num_experts = 254
    assert read_header(encode_record(record)).num_experts == 254


def test_field_fill_value(nprng):
    assert read_header(encode_record(make_record(nprng, "uint16"))).fill_value == 65535
    record = make_record(nprng, "uint16", fill_value=3000)
    assert decode_record(encode_record(record)).fill_value == 3000


def test_field_codec_and_checksum(nprng):
    record = make_record(nprng)
    header = read_header(encode_record(record))
    assert header.codec == "raw" and header.checksum_algorithm == "xxh3_64"
    assert header.checksum == xxhash.xxh3_64_intdigest(record.ids.tobytes())
    assert header.payload_length == record.ids.nbytes
    assert header.format == "rr-v1" and header.version == 2 and header.header_verified
    assert header.record_length == len(encode_record(record)) == header.payload_offset + 408
    assert header.as_dict()["format"] == "rr-v1" and header.as_dict()["shape"] == [3, 17, 4]


def test_field_created(nprng):
    assert decode_record(encode_record(make_record(nprng, created=123.25))).created == 123.25
    before = time.time()
    created = read_header(encode_record(make_record(nprng))).created
    assert before <= created <= time.time()


def test_field_producer(nprng):
    producer = read_header(encode_record(make_record(nprng))).producer
    assert producer["v"] == __version__ and producer["p"] == os.getpid() and producer["h"]
    mine = {"v": "9", "h": "trainer-3", "p": 1}
    assert decode_record(encode_record(make_record(nprng, producer=mine))).producer == mine


def test_field_metadata(nprng):
    metadata = {"step": 12, "tags": ["a", "b"], "nested": {"x": 1.5, "y": None}, "blob": b"\x00\x01"}
    decoded = decode_record(encode_record(make_record(nprng, metadata=metadata)))
    assert decoded.metadata == metadata
    assert decode_record(encode_record(make_record(nprng))).metadata == {}


def random_layer_map(nprng, num_layers: int, *, contiguous: bool) -> list[int]:
    if contiguous:
        start = int(nprng.integers(0, 2**16 - num_layers))
        return list(range(start, start + num_layers))
    return sorted(int(i) for i in nprng.choice(2**16, size=num_layers, replace=False))


@pytest.mark.parametrize("contiguous", [True, False])
def test_field_layer_map_round_trip(nprng, contiguous):
    for _ in range(20):
        num_layers = int(nprng.integers(0, 70))
        layers = random_layer_map(nprng, num_layers, contiguous=contiguous)
        record = make_record(nprng, shape=(num_layers, int(nprng.integers(0, 9)), 4), layers=layers)
        buffer = encode_record(record)
        decoded = decode_record(buffer)
        assert decoded.layers == tuple(layers) == decoded.layer_map
        assert read_header(buffer).layer_map == tuple(layers)
        np.testing.assert_array_equal(decoded.ids, record.ids)
        packed = split_layout(bytes(buffer))[2]["lm"]
        if contiguous and num_layers:
            assert packed == {"s": layers[0], "n": num_layers}  # start + count, not the list
        elif num_layers > 2:
            assert packed == layers or packed.get("d", 1) != 1


def test_field_layer_map_evenly_spaced_and_numpy_inputs(nprng):
    # Interleaved MoE (every other decoder layer): the range form with a step.
    record = make_record(nprng, shape=(5, 3, 2), layers=np.arange(1, 11, 2))
    buffer = encode_record(record)
    assert split_layout(bytes(buffer))[2]["lm"] == {"s": 1, "n": 5, "d": 2}
    assert decode_record(buffer).layers == (1, 3, 5, 7, 9)
    assert all(type(layer) is int for layer in decode_record(buffer).layers)
    # A per-layer record: one row, its global decoder-layer index.
    single = make_record(nprng, shape=(1, 3, 2), layers=(61,))
    assert decode_record(encode_record(single)).layers == (61,)


def test_field_layer_map_defaults_to_range(nprng):
    record = make_record(nprng, shape=(4, 3, 2))
    assert record.layers is None and record.layer_map == (0, 1, 2, 3)
    assert decode_record(encode_record(record)).layers == (0, 1, 2, 3)


def test_records_without_layer_map_or_token_convention_decode_with_defaults(nprng):
    """Records written before ``lm`` and ``tc`` existed."""
    header, payload = base_header(nprng)
    del header["lm"], header["tc"]
    decoded = decode_record(rebuild(header, payload))
    assert decoded.layers == tuple(range(header["sh"][0]))
    assert decoded.token_convention == "forwarded"
    assert read_header(rebuild(header, payload)).layer_map == tuple(range(header["sh"][0]))


def test_field_token_convention(nprng):
    buffer = encode_record(make_record(nprng))
    assert split_layout(bytes(buffer))[2]["tc"] == "forwarded"
    assert read_header(buffer).token_convention == "forwarded"
    assert decode_record(buffer).token_convention == "forwarded"


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ([0, 1], "has 2 entries for 3 layers"),
        ([0, 1, 2, 3], "has 4 entries for 3 layers"),
        ([0, 2, 2], "strictly increasing"),
        ([5, 4, 6], "strictly increasing"),
        ([0, 1, 2**16], "not an int in [0, 65535]"),
        ([-1, 0, 1], "not an int in [0, 65535]"),
        ([0, 1.0, 2], "not an int"),
        ([0, True, 2], "not an int"),
        ([0, "1", 2], "not an int"),
        ("0,1,2", "expected a list of layer indices or a range map"),
        (7, "expected a list of layer indices or a range map"),
        ({"s": 0, "n": 2}, "range of 2 layers disagrees"),
        ({"s": 0}, "range field 'n' must be an int"),
        ({"n": 3}, "range field 's' must be an int"),
        ({"s": 0, "n": 3, "d": 0}, "range field 'd' must be an int"),
        ({"s": -1, "n": 3}, "range field 's' must be an int"),
        ({"s": 65534, "n": 3}, "goes past layer 65535"),
        ({"s": 0, "n": 3, "x": 1}, "unknown keys ['x']"),
    ],
)
def test_bad_layer_map_in_header(nprng, value, problem):
    header, payload = base_header(nprng)  # shape [3, 17, 4]
    header["lm"] = value
    with pytest.raises(RecordError) as info:
        decode_record(rebuild(header, payload))
    assert "'lm' (layer_map)" in str(info.value) and problem in str(info.value)


@pytest.mark.parametrize("value", ["all", "", 1, ["forwarded"]])
def test_unknown_token_convention_is_refused(nprng, value):
    header, payload = base_header(nprng)
    header["tc"] = value
    with pytest.raises(RecordError, match=r"'tc' \(token_convention\): unknown token convention"):
        decode_record(rebuild(header, payload))


def test_too_many_layers_without_a_map_is_refused():
    header = {"id": "r:0:0", "dt": "uint8", "sh": [70000, 0, 0], "lo": "LTK", "ne": 8, "k": 0,
              "fv": 255, "co": "raw", "ca": "xxh3_64", "cs": xxhash.xxh3_64_intdigest(b""),
              "pl": 0}
    with pytest.raises(RecordError, match="70000 layers exceed the layer map's limit"):
        decode_record(rebuild(header, b""))


@pytest.mark.parametrize(
    ("layers", "problem"),
    [
        ([0, 1], "layers has 2 entries for 3 layers"),
        ([2, 1, 0], "layers must be strictly increasing"),
        ([0, 1, 65536], "not an int in [0, 65535]"),
        ([0, 1, 2.5], "not an int"),
        ({0, 1, 2}, "layers must be a sequence of ints, got set"),
        ("012", "layers must be a sequence of ints, got str"),
    ],
)
def test_encode_rejects_bad_layer_maps(nprng, layers, problem):
    record = make_record(nprng, shape=(3, 4, 2), layers=layers)
    with pytest.raises(RecordError) as info:
        encode_record(record)
    assert problem in str(info.value) and ROLLOUT in str(info.value)


def test_encode_rejects_unknown_token_convention(nprng):
    with pytest.raises(RecordError, match="token_convention 'all' is not one of"):
        encode_record(make_record(nprng, token_convention="all"))


def test_unknown_header_fields_are_ignored(nprng):
    header, payload = base_header(nprng)
    header["zz_future"] = {"anything": [1, 2, 3]}
    header["x"] = 7
    decoded = decode_record(rebuild(header, payload))
    assert decoded.ids.tobytes() == payload


def test_optional_fields_may_be_absent(nprng):
    header, payload = base_header(nprng)
    for key in ("ct", "pr", "md", "lm", "tc"):
        header.pop(key, None)
    decoded = decode_record(rebuild(header, payload))
    assert decoded.created is None and decoded.producer is None and decoded.metadata == {}


@pytest.mark.parametrize("key", ["id", "dt", "sh", "lo", "ne", "k", "fv", "co", "ca", "cs", "pl"])
def test_missing_required_field(nprng, key):
    header, payload = base_header(nprng)
    del header[key]
    with pytest.raises(RecordError, match=f"lacks required field '{key}'"):
        decode_record(rebuild(header, payload))


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("id", 5, "non-empty str"),
        ("id", "", "non-empty str"),
        ("dt", "int8", "not one of"),
        ("dt", "float32", "not one of"),
        ("dt", ["uint8"], "not one of"),
        ("sh", [3, 17], "expected [layers, tokens, top_k]"),
        ("sh", "3,17,4", "expected [layers, tokens, top_k]"),
        ("sh", [3, -17, 4], "dimensions must be ints"),
        ("sh", [3, 2**40, 4], "dimensions must be ints"),
        ("sh", [3, 17.0, 4], "dimensions must be ints"),
        ("sh", [3, True, 4], "dimensions must be ints"),
        ("lo", "TLK", "unsupported layout"),
        ("ne", 0, "outside"),
        ("ne", 65536, "outside"),
        ("ne", "3000", "expected an int"),
        ("k", 5, "disagrees with shape"),
        ("fv", 70000, "outside"),
        ("fv", 12, "outside"),  # a valid expert id cannot be the fill value
        ("fv", None, "expected an int"),
        ("co", "zstd", "unknown encoding 'zstd'"),
        ("ca", "crc32", "unsupported checksum algorithm"),
        ("cs", -1, "outside"),
        ("cs", "abc", "expected an int"),
        ("pl", 1, "disagrees with shape"),
        ("pl", -5, "disagrees with shape"),
        ("ct", "yesterday", "expected a unix time"),
        ("pr", [1], "expected a map"),
        ("md", [1], "expected a map"),
    ],
)
def test_wrong_header_values(nprng, key, value, problem):
    header, payload = base_header(nprng)
    header[key] = value
    with pytest.raises(RecordError) as info:
        decode_record(rebuild(header, payload))
    assert f"'{key}'" in str(info.value) and problem in str(info.value)


def test_shape_inconsistent_with_payload_length(nprng):
    header, payload = base_header(nprng)
    header["sh"] = [3, 18, 4]
    with pytest.raises(RecordError, match=r"'pl' \(payload_length\): 408 disagrees with shape \[3, 18, 4\]"):
        decode_record(rebuild(header, payload))
    header["pl"] = 432  # consistent header, but the buffer holds 24 bytes less
    with pytest.raises(RecordError, match="truncated record"):
        decode_record(rebuild(header, payload))


# --------------------------------------------------------------------- corruption


def test_bad_magic(nprng):
    header, payload = base_header(nprng)
    with pytest.raises(RecordError, match="bad magic"):
        decode_record(rebuild(header, payload, magic=b"PK\x03\x04"))
    with pytest.raises(RecordError, match="decode_fastdeploy_raw"):
        decode_record(encode_fastdeploy_raw(make_record(nprng).ids, 32))


@pytest.mark.parametrize("version", [0, 3, 4, 65535])
def test_unknown_version(nprng, version):
    header, payload = base_header(nprng)
    with pytest.raises(RecordError, match=f"unsupported rr-v1 format version {version}"):
        decode_record(rebuild(header, payload, version=version))


def test_version_1_records_decode_unverified(nprng):
    """Records written before the header checksum: same fields, no checksum after them."""
    record = make_record(nprng, "uint16", (3, 17, 4), created=1.5e9, metadata={"step": 3},
                         layers=(1, 3, 5))
    _, _, header, _, payload = split_layout(bytes(encode_record(record)))
    old = rebuild(header, payload, version=1)
    header_length = struct.unpack_from("<I", old, 6)[0]
    offset = (10 + header_length + 63) // 64 * 64  # no checksum: payload at align64(10 + H)
    assert old[4:6] == b"\x01\x00" and len(old) == offset + len(payload)
    decoded = decode_record(old, check_range=True)
    np.testing.assert_array_equal(decoded.ids, record.ids)
    assert decoded.layers == (1, 3, 5) and decoded.metadata == {"step": 3}
    parsed = read_header(old)
    assert (parsed.version, parsed.header_verified) == (1, False)
    assert parsed.as_dict()["header_verified"] is False
    assert parsed.payload_offset == offset and parsed.record_length == len(old)
    assert read_header(old[:10 + parsed.header_length], require_payload=False).shape == (3, 17, 4)
    # A version-1 reader's view of the new layout: 8 checksum bytes where it wants zeros.
    new = encode_record(record)
    downgraded = bytearray(new)
    downgraded[4] = 1
    with pytest.raises(RecordError):
        decode_record(bytes(downgraded))


def test_header_checksum_mismatch(nprng):
    buffer = bytearray(encode_record(make_record(nprng)))
    header_length = struct.unpack_from("<I", buffer, 6)[0]
    buffer[10 + header_length + 3] ^= 0x40  # inside the stored header checksum
    with pytest.raises(RecordError, match="header checksum mismatch"):
        decode_record(bytes(buffer))
    with pytest.raises(RecordError, match="header checksum mismatch"):
        read_header(bytes(buffer[:10 + header_length + 8]), require_payload=False)


def test_header_length_past_end(nprng):
    buffer = bytearray(encode_record(make_record(nprng)))
    struct.pack_into("<I", buffer, 6, len(buffer))
    with pytest.raises(RecordError, match="truncated record: header length"):
        decode_record(buffer)


def test_oversized_header_length(nprng):
    buffer = bytearray(encode_record(make_record(nprng)))
    struct.pack_into("<I", buffer, 6, MAX_HEADER_BYTES + 1)
    with pytest.raises(RecordError, match="exceeds the limit"):
        decode_record(buffer)
    struct.pack_into("<I", buffer, 6, 2**32 - 1)
    with pytest.raises(RecordError, match="exceeds the limit"):
        read_header(buffer)


def test_oversized_metadata_is_refused_on_encode(nprng):
    record = make_record(nprng, metadata={"blob": "x" * MAX_HEADER_BYTES})
    with pytest.raises(RecordError, match="keep metadata small"):
        encode_record(record)


@pytest.mark.parametrize("garbage", [b"\xc1", b"\x91", b"\xdd\xff\xff\xff\xff", b"\x81\x01\x02",
                                     b"\x82\xa1a\x01", b"\x92\x01\x02"])
def test_bad_msgpack(garbage):
    buffer = struct.pack("<4sHI", MAGIC, 1, len(garbage)) + garbage
    buffer += bytes((-len(buffer)) % 64)
    with pytest.raises(RecordError, match="msgpack"):
        decode_record(buffer)
    start = struct.pack("<4sHI", MAGIC, 2, len(garbage)) + garbage  # checksummed garbage
    buffer = start + struct.pack("<Q", xxhash.xxh3_64_intdigest(start))
    buffer += bytes((-len(buffer)) % 64)
    with pytest.raises(RecordError, match="msgpack"):
        decode_record(buffer)


def test_checksum_mismatch(nprng):
    record = make_record(nprng, "uint16", (2, 30, 8))
    buffer = bytearray(encode_record(record))
    buffer[-1] ^= 0x01
    with pytest.raises(RecordError, match="checksum mismatch in record"):
        decode_record(buffer)
    unchecked = decode_record(buffer, verify=False)  # verify=False trusts the payload
    assert not np.array_equal(unchecked.ids, record.ids)


def test_trailing_bytes_and_padding(nprng):
    buffer = encode_record(make_record(nprng))
    with pytest.raises(RecordError, match="unexpected bytes after the payload"):
        decode_record(bytes(buffer) + b"\x00")
    header, payload = base_header(nprng)
    with pytest.raises(RecordError, match="non-zero padding"):
        decode_record(rebuild(header, payload, padding_byte=0x20))


def test_truncated_everywhere(nprng):
    buffer = bytes(encode_record(make_record(nprng, "uint8", (2, 3, 2))))
    for length in range(len(buffer)):
        with pytest.raises(RecordError):
            decode_record(buffer[:length])


def test_read_header_without_payload(nprng):
    buffer = bytes(encode_record(make_record(nprng, "uint16", (4, 100, 8))))
    offset = read_header(buffer).payload_offset
    assert read_header(buffer[:offset], require_payload=False).shape == (4, 100, 8)
    with pytest.raises(RecordError, match="truncated record"):
        read_header(buffer[:offset])
    needed = header_region_length(buffer[:10])  # 10 + H + 8 for version 2
    assert needed == 10 + struct.unpack_from("<I", buffer, 6)[0] + 8 <= offset
    assert read_header(buffer[:needed], require_payload=False).header_verified
    with pytest.raises(RecordError, match="truncated record: header length"):
        read_header(buffer[:needed - 1], require_payload=False)


@pytest.mark.parametrize("value", [None, "text", 12, [1, 2]])
def test_non_buffers_are_rejected(value):
    with pytest.raises(RecordError, match="bytes-like"):
        decode_record(value)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_corruption_never_escapes_record_error(nprng, data):
    record = make_record(nprng, data.draw(st.sampled_from(sorted(DTYPES))), (2, 5, 3), created=1.0)
    original = bytes(encode_record(record))
    buffer = bytearray(original)
    in_header = data.draw(st.booleans())
    limit = read_header(original).payload_offset if in_header else len(buffer)
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, limit - 1))
        buffer[position] ^= data.draw(st.integers(1, 255))
    if data.draw(st.booleans()):
        buffer = buffer[: data.draw(st.integers(0, len(buffer)))]
    try:
        decoded = decode_record(bytes(buffer))
    except RecordError:
        return
    np.testing.assert_array_equal(decoded.ids, record.ids)


# --------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda r: setattr(r, "ids", r.ids.astype(np.float32)), "is not allowed"),
        (lambda r: setattr(r, "ids", r.ids.astype(np.int16)), "is not allowed"),
        (lambda r: setattr(r, "ids", r.ids.astype(">u2")), "big-endian"),
        (lambda r: setattr(r, "ids", r.ids[0]), "must be 3-D"),
        (lambda r: setattr(r, "ids", r.ids[:, ::2]), "C-contiguous"),
        (lambda r: setattr(r, "ids", r.ids.tolist()), "numpy array"),
        (lambda r: setattr(r, "num_experts", 0), "positive int"),
        (lambda r: setattr(r, "num_experts", True), "positive int"),
        (lambda r: setattr(r, "num_experts", 65536), "do not fit uint16"),
        (lambda r: setattr(r, "fill_value", 12), "fill_value 12"),
        (lambda r: setattr(r, "fill_value", 65536), "fill_value 65536"),
        (lambda r: setattr(r, "rollout_id", ""), "non-empty str"),
        (lambda r: setattr(r, "metadata", {1: 2}), "str keys"),
        (lambda r: setattr(r, "metadata", {"x": np.int64(3)}), "cannot be packed as msgpack"),
        (lambda r: setattr(r, "created", float("nan")), "finite unix time"),
        (lambda r: setattr(r, "producer", "me"), "producer must be a dict"),
    ],
)
def test_encode_rejects_invalid_records(nprng, change, problem):
    record = make_record(nprng, "uint16")
    change(record)
    with pytest.raises(RecordError, match=problem.replace("(", r"\(")):
        encode_record(record)


def test_num_experts_limits_per_dtype(nprng):
    ids = np.zeros((1, 2, 2), np.uint8)
    RoutingRecord("r:0:0", ids, 255).validate()  # ids 0..254 plus fill 255
    with pytest.raises(RecordError, match="use uint16"):
        RoutingRecord("r:0:0", ids, 256).validate()
    assert routing_dtype(255) == np.uint8 and routing_dtype(256) == np.uint16
    assert routing_dtype(65536) == np.uint32


# --------------------------------------------------------------------- expert range


def test_check_expert_range(nprng):
    record = make_record(nprng, "uint16", (3, 40, 4), fill_rows=5)
    check_expert_range(record)
    ids = record.ids.copy()
    bad = [(2, 7, 1), (1, 30, 3)]
    for position in bad:
        ids[position] = 3000 + position[1]
    reference = np.argwhere((ids >= 3000) & (ids != 65535))[0]  # numpy: first offender
    record.ids = ids
    with pytest.raises(RecordError) as info:
        check_expert_range(record)
    layer, token, k = reference
    assert f"[layer {layer}, token {token}, k {k}]" in str(info.value)
    assert f"expert id {ids[tuple(reference)]}" in str(info.value)
    buffer = encode_record(record)
    decode_record(buffer)  # range is not scanned by default
    with pytest.raises(RecordError, match="num_experts 3000"):
        decode_record(buffer, check_range=True)


def test_check_expert_range_large_record(nprng):
    record = make_record(nprng, "uint8", (8, 40000, 8), fill_rows=1000)  # > one scan chunk
    check_expert_range(record)
    record.ids[7, 39000, 7] = 201
    with pytest.raises(RecordError, match=r"\[layer 7, token 39000, k 7\]"):
        check_expert_range(record)


# --------------------------------------------------------------------- fastdeploy-raw


def fastdeploy_reference(ids: np.ndarray, max_model_len: int, fill: int) -> bytes:
    """What FastDeploy's pad_routing_indices + tobytes produce (numpy concatenate)."""
    pad_shape = list(ids.shape)
    pad_shape[-2] = max_model_len - ids.shape[-2]
    return np.concatenate([ids, np.full(pad_shape, fill, ids.dtype)], axis=-2).tobytes()


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_fastdeploy_raw_round_trip(nprng, dtype):
    np_dtype, num_experts = DTYPES[dtype]
    for tokens in (0, 1, 37, 64):
        ids = nprng.integers(0, num_experts, size=(5, tokens, 8)).astype(np_dtype)
        raw = encode_fastdeploy_raw(ids, 64)
        fill = np.iinfo(np_dtype).max
        assert bytes(raw) == fastdeploy_reference(ids, 64, fill)
        full = decode_fastdeploy_raw(raw, 5, 64, 8, dtype, trim=False)
        assert full.shape == (5, 64, 8) and not full.flags.writeable
        assert (full[:, tokens:] == fill).all()
        trimmed = decode_fastdeploy_raw(raw, 5, 64, 8, np_dtype)
        assert trimmed.shape == (5, tokens, 8)
        np.testing.assert_array_equal(trimmed, ids)


def test_fastdeploy_raw_per_layer_and_custom_fill(nprng):
    ids = nprng.integers(0, 3000, size=(20, 6)).astype(np.uint16)
    raw = encode_fastdeploy_raw(ids, 50, fill_value=4000)
    assert bytes(raw) == fastdeploy_reference(ids, 50, 4000)
    out = decode_fastdeploy_raw(raw, 1, 50, 6, "uint16", fill_value=4000)
    np.testing.assert_array_equal(out[0], ids)
    zero_fill = encode_fastdeploy_raw(ids + 1, 50, fill_value=0)
    assert bytes(zero_fill) == fastdeploy_reference(ids + 1, 50, 0)


def test_fastdeploy_raw_trim_keeps_tokens_routed_in_any_layer(nprng):
    ids = np.full((3, 10, 2), 255, np.uint8)
    ids[:, :4] = 1
    ids[2, 7, 1] = 9  # only layer 2 has routing for token 7
    out = decode_fastdeploy_raw(encode_fastdeploy_raw(ids, 16), 3, 16, 2, np.uint8)
    assert out.shape == (3, 8, 2)
    np.testing.assert_array_equal(out, ids[:, :8])


def test_fastdeploy_raw_errors(nprng):
    ids = nprng.integers(0, 200, size=(2, 10, 4)).astype(np.uint8)
    with pytest.raises(RecordError, match="do not fit max_model_len 8"):
        encode_fastdeploy_raw(ids, 8)
    with pytest.raises(RecordError, match="not uint8, uint16 or uint32"):
        encode_fastdeploy_raw(ids.astype(np.int32), 16)
    with pytest.raises(RecordError, match="does not fit"):
        encode_fastdeploy_raw(ids, 16, fill_value=256)
    with pytest.raises(RecordError, match="2-D"):
        encode_fastdeploy_raw(ids[0, 0], 16)
    raw = encode_fastdeploy_raw(ids, 16)
    with pytest.raises(RecordError, match="has 128 bytes, but \\[2, 16, 4\\] uint16 needs 256"):
        decode_fastdeploy_raw(raw, 2, 16, 4, "uint16")
    with pytest.raises(RecordError, match="needs 124"):
        decode_fastdeploy_raw(raw, 1, 31, 4, np.uint8)
    with pytest.raises(RecordError, match="num_layers must be"):
        decode_fastdeploy_raw(raw, -2, 16, 4, np.uint8)
    with pytest.raises(RecordError, match="is not a dtype"):
        decode_fastdeploy_raw(raw, 2, 16, 4, "nonsense")
    record = bytes(encode_record(make_record(nprng, "uint8", (2, 3, 4))))
    with pytest.raises(RecordError, match="use decode_record"):
        decode_fastdeploy_raw(record, 2, 16, 4, np.uint8)


def test_fastdeploy_raw_big_endian_input_is_written_little_endian(nprng):
    ids = nprng.integers(0, 3000, size=(2, 5, 3)).astype(">u2")
    raw = encode_fastdeploy_raw(ids, 8)
    assert bytes(raw) == fastdeploy_reference(ids.astype("<u2"), 8, 65535)
    assert math.prod((2, 8, 3)) * 2 == len(raw)


def test_documented_example_is_exact():
    """docs/record-format.md shows the bytes of its example record; keep them true."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "record-format.md").read_text()
    dump = doc.split("The 204 bytes:\n\n```\n", 1)[1].split("```", 1)[0]
    documented = bytes.fromhex("".join(line[6:54] for line in dump.splitlines()))
    ids = np.array([[[3, 7], [1, 0], [255, 255]], [[2, 5], [6, 4], [255, 255]]], dtype=np.uint8)
    record = RoutingRecord("exp_a_1:0:0", ids, num_experts=8, metadata={"step": 12},
                           created=1767225600.0, producer={"v": "0.1.0", "h": "node-3", "p": 4242})
    assert encode_record(record) == documented
    np.testing.assert_array_equal(decode_record(documented).ids, ids)
