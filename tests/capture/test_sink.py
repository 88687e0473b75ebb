"""StoreSink against the real memory store: formats, per-layer keys, only_last_turn."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from fd_routing_replay.capture.assembly import RecordAssembler
from fd_routing_replay.capture.host_cache import HostSlotCache
from fd_routing_replay.capture.sink import StoreSink
from fd_routing_replay.codec import RoutingRecord, decode_fastdeploy_raw, decode_record
from fd_routing_replay.store import open_store


@pytest.fixture
def store():
    with open_store(f"memory://sink-{uuid.uuid4().hex[:12]}") as opened:
        yield opened


def record(rollout_id: str, rng: np.random.Generator, tokens: int = 5) -> RoutingRecord:
    return RoutingRecord(rollout_id, rng.integers(0, 16, (3, tokens, 4)).astype(np.uint8), 16)


def test_rr_v1_round_trip(store, seed):
    rng = np.random.default_rng(seed)
    sink = StoreSink(store)
    original = record("exp_1:0:0:0", rng)
    sink.put("exp_1:0:0:0", original)
    got = decode_record(store.get("exp_1:0:0:0"))
    np.testing.assert_array_equal(got.ids, original.ids)
    assert sink.stats()["puts"] == 1 and sink.stats()["bytes"] > original.ids.nbytes


def test_set_encoding_stores_sorted_sets_and_falls_back_to_plain(store, seed, caplog):
    from fd_routing_replay.codec import read_header

    rng = np.random.default_rng(seed)
    sink = StoreSink(store, encoding="set")
    ids = np.argsort(rng.random((3, 7, 16)), axis=-1)[..., :4].astype(np.uint8)  # distinct
    ids[:, 2] = 255                                                           # a padding row
    sink.put("exp_1:0:0:0", RoutingRecord("exp_1:0:0:0", ids, 16))
    data = store.get("exp_1:0:0:0")
    assert read_header(data).encoding == "set"
    np.testing.assert_array_equal(decode_record(data).ids, np.sort(ids, axis=-1))
    repeated = ids.copy()
    repeated[0, 0, 1] = repeated[0, 0, 0]                        # not a set: kept plain
    sink.put("exp_2:0:0:0", RoutingRecord("exp_2:0:0:0", repeated, 16))
    data = store.get("exp_2:0:0:0")
    assert read_header(data).encoding == "plain" and "exp_2:0:0:0" in caplog.text
    np.testing.assert_array_equal(decode_record(data).ids, repeated)


def test_fastdeploy_raw_is_padded_to_max_model_len(store, seed):
    rng = np.random.default_rng(seed)
    sink = StoreSink(store, record_format="fastdeploy-raw", max_model_len=32)
    original = record("exp_2:0:0:0", rng)
    sink.put("exp_2:0:0:0", original)
    ids = decode_fastdeploy_raw(store.get("exp_2:0:0:0"), 3, 32, 4, np.uint8)
    np.testing.assert_array_equal(ids, original.ids)
    with pytest.raises(ValueError, match="max_model_len"):
        StoreSink(store, record_format="fastdeploy-raw")


def test_only_last_turn_deletes_previous_turn_after_the_put(store, seed):
    rng = np.random.default_rng(seed)
    sink = StoreSink(store, only_last_turn=True)
    for key in ("exp_3:0:0:0", "exp_3:0:0:0_0", "exp_30:0:0:0"):
        store.put(key, b"x")
    sink.put("exp_3:0:1:0", record("exp_3:0:1:0", rng))
    assert store.list() == ["exp_30:0:0:0", "exp_3:0:1:0"]
    assert sink.stats()["deleted_previous_turns"] == 2


def test_per_layer_records_delete_previous_turn_after_the_last_layer(store, seed):
    rng = np.random.default_rng(seed)
    cache = HostSlotCache(16, 3, 4, np.uint8, 255)
    cache.write(np.arange(16), rng.integers(0, 16, (16, 3, 4)).astype(np.uint8))
    assembled = RecordAssembler(cache, num_experts=16, fused=False).assemble(
        "exp_4:0:1:0", np.array([3, 1, 2]))
    assert [key for key, _ in assembled.items] == ["exp_4:0:1:0_0", "exp_4:0:1:0_1", "exp_4:0:1:0_2"]
    store.put("exp_4:0:0:0_0", b"x")
    sink = StoreSink(store, only_last_turn=True)
    for index, (key, rec) in enumerate(assembled.items):
        sink.put(key, rec)
        assert store.exists("exp_4:0:0:0_0") == (index < 2)
    layer1 = decode_record(store.get("exp_4:0:1:0_1"))
    np.testing.assert_array_equal(layer1.ids[0], cache.array[[3, 1, 2], 1])


def test_assembler_pads_and_reports_missing_tokens():
    cache = HostSlotCache(8, 2, 2, np.uint8, 255)
    cache.write(np.array([0, 1]), np.zeros((2, 2, 2), np.uint8))
    assembled = RecordAssembler(cache, num_experts=4, pad_to=6).assemble("exp_5:0:0:0", np.array([0, 1, 5]))
    (key, rec), = assembled.items
    assert rec.ids.shape == (2, 6, 2) and assembled.missing_tokens == 1
    assert rec.metadata["missing_tokens"] == 1 and rec.metadata["num_tokens"] == 3
    assert (rec.ids[:, 2:] == 255).all()
