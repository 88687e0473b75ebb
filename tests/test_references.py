"""Routes by reference (``rr-ref``) and the client side of FastDeploy's response mode:
the reference format, resolving it against a store, and ``routes_from_response``."""

from __future__ import annotations

import base64
import itertools
import json

import numpy as np
import pytest
import xxhash

from fd_routing_replay import routes_from_response
from fd_routing_replay.codec import RoutingRecord, encode_record, read_header
from fd_routing_replay.codec.reference import (
    REFERENCE_FORMAT,
    RecordReference,
    looks_like_reference,
    parse_reference,
    reference_for_header,
)
from fd_routing_replay.errors import RecordError
from fd_routing_replay.reader import RoutingReader
from fd_routing_replay.reader.references import resolve_reference, routed_experts_of
from fd_routing_replay.store import open_store

_names = itertools.count()


def memory_store(namespace: str = "routing_replay"):
    return open_store(f"memory://test-references-{next(_names)}", namespace)


def random_record(gen: np.random.Generator, rollout_id: str = "exp_3:1:0", *, num_experts: int = 300,
                  shape: tuple[int, int, int] | None = None) -> RoutingRecord:
    layers, tokens, top_k = shape or (int(gen.integers(1, 5)), int(gen.integers(1, 40)), 4)
    dtype = np.uint8 if num_experts < 255 else np.uint16
    ids = np.stack([np.stack([gen.choice(num_experts, size=top_k, replace=False) for _ in range(tokens)])
                    for _ in range(layers)]).astype(dtype) if tokens else np.zeros((layers, 0, top_k), dtype)
    return RoutingRecord(rollout_id, ids, num_experts, int(np.iinfo(dtype).max), {})


@pytest.fixture
def gen(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


def reference_of(record: RoutingRecord, namespace: str = "routing_replay") -> tuple[bytes, RecordReference]:
    encoded = encode_record(record)
    return encoded, reference_for_header(read_header(encoded), namespace=namespace, store="memory://x")


# ------------------------------------------------------------------ the format
@pytest.mark.parametrize("num_experts", [64, 300])
def test_a_reference_pins_the_plain_payload_and_round_trips_through_json(gen, num_experts):
    record = random_record(gen, num_experts=num_experts)
    encoded, ref = reference_of(record)
    # independent reference: XXH3-64 of the ids' little-endian bytes, their length, their shape
    assert ref.checksum == xxhash.xxh3_64_intdigest(record.ids.astype(record.ids.dtype.newbyteorder("<")).tobytes())
    assert ref.size == record.ids.size * record.ids.itemsize
    assert ref.shape == record.ids.shape and ref.dtype == record.ids.dtype.name
    assert ref.key == record.rollout_id and ref.namespace == "routing_replay"
    text = ref.to_json()
    data = json.loads(text)
    assert data["format"] == REFERENCE_FORMAT and data["version"] == 1
    assert data["checksum"] == f"{ref.checksum:016x}" and data["checksum_algorithm"] == "xxh3_64"
    assert parse_reference(text) == ref == parse_reference(text.encode()) == parse_reference(data)
    assert parse_reference(ref) is ref
    assert looks_like_reference(text.encode()) and not looks_like_reference(encoded)
    assert ref.mismatch(read_header(encoded)) is None


def test_unknown_fields_are_ignored_for_newer_writers(gen):
    _, ref = reference_of(random_record(gen))
    data = dict(ref.to_dict(), added_later={"x": 1})
    assert parse_reference(data) == ref


def test_an_empty_record_has_a_reference_too():
    record = RoutingRecord("exp_0:0:0", np.zeros((3, 0, 4), np.uint8), 64, 255, {})
    _, ref = reference_of(record)
    assert ref.size == 0 and ref.shape == (3, 0, 4)
    assert parse_reference(ref.to_json()) == ref


def test_a_set_encoded_record_cannot_be_referenced(gen):
    from fd_routing_replay.codec import encode_record as encode

    record = random_record(gen, num_experts=64)
    with pytest.raises(RecordError, match="plain-encoded payload"):
        reference_for_header(read_header(encode(record, encoding="set")), namespace="ns")


BAD_FIELDS = [
    ({"format": "rr-v1"}, "not a routing reference"),
    ({"version": 2}, "unsupported routing reference version 2"),
    ({"key": None}, "field 'key'"),
    ({"key": "../etc/passwd"}, "routing reference: invalid store key"),
    ({"namespace": "a/b"}, "invalid namespace"),
    ({"checksum": 12345}, "field 'checksum'"),
    ({"checksum": "xyz"}, "16 lowercase hex digits"),
    ({"checksum": "ABCDEF0123456789"}, "16 lowercase hex digits"),
    ({"checksum_algorithm": "crc32"}, "unsupported checksum algorithm 'crc32'"),
    ({"dtype": "int64"}, "field 'dtype'"),
    ({"shape": [1, 2]}, "field 'shape'"),
    ({"shape": [1, 2, -4]}, "field 'shape'"),
    ({"size": True}, "field 'size'"),
    ({"size": 7}, "does not match shape"),
]


@pytest.mark.parametrize(("change", "message"), BAD_FIELDS, ids=[m for _, m in BAD_FIELDS])
def test_a_malformed_reference_names_the_field(gen, change, message):
    _, ref = reference_of(random_record(gen, shape=(2, 3, 4)))
    data = {**ref.to_dict(), **change}
    with pytest.raises(RecordError, match=message):
        parse_reference(data)


@pytest.mark.parametrize(("value", "message"), [
    ("[1, 2]", "must be a JSON object, got list"),
    ("{not json", "not JSON"),
    ("{" + " " * 5000 + "}", "more than 4096"),
    (42, "must be a JSON object, got int"),
])
def test_text_that_is_no_reference_is_refused(value, message):
    with pytest.raises(RecordError, match=message):
        parse_reference(value)


def test_a_missing_field_is_named(gen):
    _, ref = reference_of(random_record(gen))
    for name in ("key", "namespace", "checksum", "size", "shape", "dtype"):
        data = ref.to_dict()
        del data[name]
        with pytest.raises(RecordError, match=f"lacks field '{name}'"):
            parse_reference(data)


# ------------------------------------------------------------------ resolving
def test_resolve_returns_the_stored_record(gen):
    store = memory_store()
    record = random_record(gen)
    encoded, ref = reference_of(record)
    store.put(record.rollout_id, encoded)
    for resolved in (resolve_reference(store, ref.to_json(), timeout=0),
                     RoutingReader(store).resolve(ref, timeout=0)):
        np.testing.assert_array_equal(resolved.ids, record.ids)
        assert resolved.rollout_id == record.rollout_id


class PendingStore:
    """A store whose record appears only after ``misses`` reads: the writer still at work."""

    def __init__(self, store, key, value, misses):
        self.store, self.key, self.value, self.misses = store, key, value, misses
        self.namespace = store.namespace
        self.reads = 0

    def get(self, key):
        self.reads += 1
        if self.reads > self.misses and self.store.get(key) is None:
            self.store.put(self.key, self.value)
        return self.store.get(key)

    def describe(self):
        return self.store.describe()


def test_resolve_waits_for_a_record_the_writer_has_not_stored_yet(gen):
    record = random_record(gen)
    encoded, ref = reference_of(record)
    pending = PendingStore(memory_store(), record.rollout_id, encoded, misses=3)
    resolved = resolve_reference(pending, ref, timeout=60, poll_interval=0.001)
    np.testing.assert_array_equal(resolved.ids, record.ids)
    assert pending.reads == 4


def test_a_missing_record_is_a_clear_error(gen):
    store = memory_store()
    _, ref = reference_of(random_record(gen))
    with pytest.raises(RecordError) as info:
        resolve_reference(store, ref, timeout=0)
    message = str(info.value)
    assert f"record {ref.key!r}" in message and "no record is stored under it" in message
    assert "memory://x" in message and store.describe() in message


def test_a_record_that_differs_names_expected_and_actual_checksum_and_size(gen):
    store = memory_store()
    first = random_record(gen, shape=(2, 5, 4))
    other = random_record(gen, shape=(2, 6, 4))            # another version under the same key
    _, ref = reference_of(first)
    encoded_other, ref_other = reference_of(other)
    store.put(first.rollout_id, encoded_other)
    with pytest.raises(RecordError) as info:
        resolve_reference(store, ref, timeout=0.01, poll_interval=0.001)
    message = str(info.value)
    assert f"checksum {ref_other.checksum:016x} (expected {ref.checksum:016x})" in message
    assert f"size {ref_other.size} bytes (expected {ref.size})" in message
    assert "shape [2, 6, 4] (expected [2, 5, 4])" in message
    assert repr(first.rollout_id) in message


def test_a_damaged_payload_under_a_matching_header_is_refused(gen):
    store = memory_store()
    record = random_record(gen)
    encoded, ref = reference_of(record)
    damaged = bytearray(encoded)
    damaged[-1] ^= 0x01                                    # the header still says the old cs
    store.put(record.rollout_id, bytes(damaged))
    with pytest.raises(RecordError, match=f"reference to record {ref.key!r}: checksum mismatch"):
        resolve_reference(store, ref, timeout=0)


def test_a_value_that_is_no_record_and_another_namespace_are_refused(gen):
    store = memory_store()
    record = random_record(gen)
    _, ref = reference_of(record)
    store.put(record.rollout_id, b"\x00" * 64)
    with pytest.raises(RecordError, match="not an rr-v1 record"):
        resolve_reference(store, ref, timeout=0)
    with pytest.raises(RecordError, match="in namespace 'routing_replay'.*reads namespace 'other'"):
        resolve_reference(memory_store("other"), ref, timeout=0)


def test_a_record_whose_ids_exceed_num_experts_is_refused(gen):
    """A writer that stored ids its header says cannot exist: the range check refuses them."""
    store = memory_store()
    record = random_record(gen, num_experts=300)
    ids = record.ids.copy()
    ids[0, 0, 0] = 299
    encoded, ref = reference_of(RoutingRecord(record.rollout_id, ids, 200, record.fill_value, {}))
    store.put(record.rollout_id, encoded)
    with pytest.raises(RecordError, match="299"):
        resolve_reference(store, ref, timeout=0)


# ------------------------------------------------------------------ routes_from_response
def test_routes_from_a_payload_response_need_no_store(gen):
    record = random_record(gen)
    text = base64.b64encode(encode_record(record)).decode()
    for response in (text, text.encode(), {"routed_experts": text},
                     {"choices": [], "metrics": {"first_token_time": 0.1, "routed_experts": text}}):
        got = routes_from_response(response)
        np.testing.assert_array_equal(got.ids, record.ids)


def test_routes_from_a_reference_response_resolve_through_the_reader(gen):
    store = memory_store()
    record = random_record(gen)
    encoded, ref = reference_of(record)
    store.put(record.rollout_id, encoded)
    text = base64.b64encode(ref.to_json().encode()).decode()
    with pytest.raises(RecordError, match="carries a reference to a stored record; pass a RoutingReader"):
        routes_from_response({"routed_experts": text})
    for reader in (RoutingReader(store), store):
        got = routes_from_response({"metrics": {"routed_experts": text}}, reader, timeout=0)
        np.testing.assert_array_equal(got.ids, record.ids)


@pytest.mark.parametrize(("response", "message"), [
    ({"choices": []}, "carries no routes"),
    ({"routed_experts": None, "metrics": None}, "carries no routes"),
    ("", "carries no routes"),
    ("not base64!", "not base64"),
    (base64.b64encode(b"\x01\x02\x03\x04").decode(), "neither an rr-v1 record"),
])
def test_responses_without_usable_routes_are_clear_errors(response, message):
    with pytest.raises(RecordError, match=message):
        routes_from_response(response)


def test_routed_experts_of_reads_attributes_too():
    class Response:
        routed_experts = "abc"

    assert routed_experts_of(Response()) == "abc"
    assert routed_experts_of(object()) is None
