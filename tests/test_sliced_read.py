"""Sliced reads (a rank's layers and tokens), list_rollouts and latest_turn."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from fd_routing_replay.codec import RoutingRecord, encode_record
from fd_routing_replay.codec.record import Provenance, tokens_digest
from fd_routing_replay.errors import RecordError
from fd_routing_replay.reader import RoutingReader
from fd_routing_replay.store import open_store

LAYERS = (1, 3, 5, 7)
LABELS = {"namespace": "sl", "store": "local", "rank": ""}


def _record(rng, rollout_id="exp_s:0:0", tokens=40, top_k=4, experts=300):
    ids = np.stack([np.argsort(rng.random((tokens, experts)), axis=-1)[:, :top_k]
                    for _ in LAYERS]).astype(np.uint16)
    ids[:, tokens // 3] = np.iinfo(np.uint16).max                 # a position without routing
    token_ids = rng.integers(0, 1000, size=tokens + 1)
    return RoutingRecord(rollout_id, np.ascontiguousarray(ids), experts, layers=LAYERS,
                         metadata={"m": 1},
                         provenance=Provenance(num_decoder_layers=8, weights_version="w",
                                               tokens_hash=tokens_digest(token_ids[:tokens])))


@pytest.fixture
def local(tmp_path):
    registry = CollectorRegistry()
    store = open_store(f"local://{tmp_path}", "sl", metrics_registry=registry)
    yield store, registry
    store.close()


@pytest.mark.parametrize("layers, tokens", [
    ([3, 7], slice(5, 20)), (None, slice(0, 40)), ([1], None), ([7, 1], slice(30, None)),
    (None, slice(35, 100)), ([5], slice(20, 20)), (None, slice(-8, None)),
])
def test_ranged_slice_equals_numpy_slicing(local, seed, layers, tokens):
    store, registry = local
    record = _record(np.random.default_rng(seed))
    store.put("exp_s:0:0", encode_record(record))
    sliced = RoutingReader(store).get_slice("exp_s:0:0", layers=layers, tokens=tokens)
    rows = [LAYERS.index(layer) for layer in sorted(layers)] if layers else list(range(len(LAYERS)))
    span = tokens if tokens is not None else slice(None)
    np.testing.assert_array_equal(sliced.ids, record.ids[rows][:, span])
    assert sliced.layers == tuple(LAYERS[row] for row in rows)
    assert sliced.num_experts == 300 and sliced.fill_value == record.fill_value
    start = span.indices(40)[0]
    whole = sliced.num_tokens == 40
    assert sliced.tokens_hash == (record.tokens_hash if whole else None)
    assert sliced.metadata == ({"m": 1} if whole else {"m": 1, "token_offset": start})
    assert sliced.num_decoder_layers == 8 and sliced.weights_version == "w"
    # only the header and the wanted bytes were read
    read = registry.get_sample_value("fd_rr_store_read_bytes_total", LABELS)
    assert read <= 4096 + sliced.ids.nbytes
    assert registry.get_sample_value("fd_rr_store_operation_seconds_count",
                                     {**LABELS, "op": "get"}) == 0


def test_stores_without_ranges_and_other_formats_fall_back_to_a_whole_read(local, seed):
    from fd_routing_replay.codec import encode_record_parts

    rng = np.random.default_rng(seed)
    record = _record(rng)
    memory = open_store("memory://sliced", "sl")
    memory.put("exp_s:0:0", encode_record(record))
    got = RoutingReader(memory).get_slice("exp_s:0:0", layers=[5], tokens=slice(3, 9))
    np.testing.assert_array_equal(got.ids, record.ids[2:3, 3:9])
    store, _ = local
    record = _record(rng, "exp_s:1:0")
    head, payload = encode_record_parts(record, encoding="set")          # bit-packed rows
    store.put("exp_s:1:0", head + bytes(payload))
    got = RoutingReader(store).get_slice("exp_s:1:0", layers=[1, 3], tokens=slice(0, 12))
    np.testing.assert_array_equal(got.ids, np.sort(record.ids[:2, :12], axis=-1))


def test_missing_bad_arguments_and_truncated_records(local, seed, tmp_path):
    store, _ = local
    reader = RoutingReader(store)
    assert reader.get_slice("exp_s:0:0", layers=[1]) is None
    record = _record(np.random.default_rng(seed))
    store.put("exp_s:0:0", encode_record(record))
    with pytest.raises(ValueError, match=r"decoder layers \[2\] are not in the record"):
        reader.get_slice("exp_s:0:0", layers=[1, 2])
    with pytest.raises(ValueError, match="step 1"):
        reader.get_slice("exp_s:0:0", tokens=slice(0, 10, 2))
    store.put("exp_s:2:0", encode_record(record)[:-100])                   # truncated
    with pytest.raises(RecordError, match="truncated"):
        reader.get_slice("exp_s:2:0", layers=[7])
    bad = record.ids.copy()
    bad[0, 0, 0] = 299
    store.put("exp_s:3:0", encode_record(RoutingRecord("exp_s:3:0", bad, 299, layers=LAYERS,
                                                       fill_value=record.fill_value)))
    with pytest.raises(RecordError, match="≥ num_experts"):
        reader.get_slice("exp_s:3:0", layers=[1], tokens=slice(0, 2))
    store.put("exp_s:5:0", encode_record(record))          # exp_s:0:0's record, wrong key
    with pytest.raises(RecordError, match="belongs to rollout"):
        reader.get_slice("exp_s:5:0", layers=[1])


def test_empty_record_slices_to_empty(local):
    store, _ = local
    empty = RoutingRecord("exp_e:0:0", np.zeros((2, 0, 4), dtype=np.uint8), 8, layers=(0, 1))
    store.put("exp_e:0:0", encode_record(empty))
    got = RoutingReader(store).get_slice("exp_e:0:0", layers=[1], tokens=slice(0, 5))
    assert got.ids.shape == (1, 0, 4)


def test_list_rollouts_and_latest_turn(local, seed):
    store, _ = local
    rng = np.random.default_rng(seed)
    for rollout_id in ("job:0:0", "job:3:0", "job:2:1", "job_x:9:0", "jobs:7:0"):
        store.put(rollout_id, encode_record(_record(rng, rollout_id, tokens=2)))
    one_layer = RoutingRecord("job:5:0", np.zeros((1, 2, 4), dtype=np.uint16), 300)
    store.put("job:5:0_0", encode_record(one_layer))                        # per-layer key
    reader = RoutingReader(store)
    # the store's boundary-safe prefix: "job" also names bases that extend it with "_"
    assert reader.list_rollouts("job") == ["job:0:0", "job:2:1", "job:3:0", "job:5:0", "job_x:9:0"]
    assert reader.list_rollouts("job:3") == ["job:3:0"]
    assert reader.latest_turn("job") == 5
    assert reader.latest_turn("job", segment=1) == 2
    assert reader.latest_turn("jobs") == 7 and reader.latest_turn("nope") is None


def test_wait_many_returns_all_in_order_or_names_the_missing(local, seed):
    import threading

    store, _ = local
    rng = np.random.default_rng(seed)
    reader = RoutingReader(store)
    store.put("w:1:0", encode_record(_record(rng, "w:1:0", tokens=3)))
    late = _record(rng, "w:0:0", tokens=3)
    writer = threading.Timer(0.2, lambda: store.put("w:0:0", encode_record(late)))
    writer.start()
    try:
        got = reader.wait_many(["w:0:0", "w:1:0"], timeout=60)
    finally:
        writer.join()
    assert list(got) == ["w:0:0", "w:1:0"]
    np.testing.assert_array_equal(got["w:0:0"].ids, late.ids)
    with pytest.raises(TimeoutError, match=r"1 of 2 routing records .* w:9:0"):
        reader.wait_many(["w:1:0", "w:9:0"], timeout=0.1)
