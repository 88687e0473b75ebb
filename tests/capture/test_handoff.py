"""The hand-off: a request's rows from the host slot cache straight into the writer's ring,
through the real writer (inline mode) into a memory store, against NumPy gathers of the same
slots; and the encoded record of FastDeploy's ``response`` mode."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from fd_routing_replay.capture.handoff import Handoff, gather_request
from fd_routing_replay.capture.slots import HostSlotCache
from fd_routing_replay.codec import decode_fastdeploy_raw, decode_record
from fd_routing_replay.codec.record import tokens_digest
from fd_routing_replay.errors import RecordError
from fd_routing_replay.reader import RoutingReader
from fd_routing_replay.store import open_store

NUM_EXPERTS = 16
BLOCK = 4


def filled_cache(rng: np.random.Generator, num_layers: int, blocks: int = 16) -> HostSlotCache:
    cache = HostSlotCache(blocks * BLOCK, num_layers, 4, np.uint8, 255)
    cache.write(np.arange(blocks * BLOCK),
                rng.integers(0, NUM_EXPERTS, (blocks * BLOCK, num_layers, 4)).astype(np.uint8))
    return cache


def random_layer_map(rng: np.random.Generator, num_layers: int) -> list[int]:
    """Leading dense layers (like DeepSeek-V3's first_k_dense_replace) and random gaps."""
    first_dense = int(rng.integers(0, 5))
    gaps = rng.integers(1, 3, size=num_layers)
    return [first_dense + int(x) for x in np.cumsum(gaps) - gaps[0]]


def numpy_gather(cache: HostSlotCache, row: np.ndarray, length: int, start: int = 0) -> np.ndarray:
    """The reference: positions' KV slots through the block row, rows transposed to [L, T, K]."""
    positions = np.arange(start, length)
    slots = row[positions // BLOCK] * BLOCK + positions % BLOCK
    return np.ascontiguousarray(cache.read(slots).transpose(1, 0, 2))


@pytest.fixture
def memory(make_writer):
    def memory(**options):
        url = f"memory://handoff-{uuid.uuid4().hex[:12]}"
        return make_writer(url, **options), open_store(url)
    return memory


def test_a_finished_request_becomes_one_record_with_its_layer_map_and_provenance(seed, memory):
    rng = np.random.default_rng(seed)
    num_layers = int(rng.integers(1, 9))
    layer_map = random_layer_map(rng, num_layers)
    cache = filled_cache(rng, num_layers)
    writer, store = memory()
    handoff = Handoff(cache, writer, num_experts=NUM_EXPERTS, layer_map=layer_map,
                      metadata={"engine": "test"}, num_decoder_layers=layer_map[-1] + 1,
                      weights_version="step-7")
    row = rng.permutation(16)[:8]
    length = int(rng.integers(1, 8 * BLOCK + 1))
    tokens = rng.integers(0, 1000, length + 1).tolist()
    assert handoff.finish("exp_1:0:0", "chatcmpl-exp_1:0:0-x", row, length, BLOCK, tokens)
    record = RoutingReader(store).get("exp_1:0:0")
    np.testing.assert_array_equal(record.ids, numpy_gather(cache, row, length))
    assert record.layers == tuple(layer_map) and record.token_convention == "forwarded"
    assert record.metadata == {"engine": "test", "request_id": "chatcmpl-exp_1:0:0-x", "num_tokens": length}
    assert record.tokens_hash == tokens_digest(np.asarray(tokens[:length]))
    assert record.num_decoder_layers == layer_map[-1] + 1 and record.weights_version == "step-7"
    assert handoff.counters["records_submitted"] == 1 and handoff.counters["records_failed"] == 0


def test_per_layer_records_carry_their_layers_global_index_and_retire_the_previous_turn(seed, memory):
    rng = np.random.default_rng(seed)
    layer_map = [3, 4, 5, 6]  # DeepSeek-V3-like: decoder layers 0-2 are dense
    cache = filled_cache(rng, len(layer_map))
    writer, store = memory(only_last_turn=True)
    store.put("exp_2:0:0_0", b"turn 0's layer 0")
    store.put("exp_2:0:0_9:0:0", b"another rollout")
    handoff = Handoff(cache, writer, num_experts=NUM_EXPERTS, layer_map=layer_map, fused=False)
    row = np.array([5, 1, 9])
    assert handoff.finish("exp_2:1:0", None, row, 10, BLOCK)
    # Keys keep FastDeploy's {rollout_id}_{row} naming; the header says which decoder layer.
    assert store.list() == ["exp_2:0:0_9:0:0"] + [f"exp_2:1:0_{r}" for r in range(4)]
    expected = numpy_gather(cache, row, 10)
    for r in range(4):
        decoded = decode_record(store.get(f"exp_2:1:0_{r}"))
        assert decoded.layers == (layer_map[r],)
        assert decoded.metadata["layer"] == r and decoded.metadata["num_layers"] == 4
        np.testing.assert_array_equal(decoded.ids[0], expected[r])


def test_fastdeploy_raw_records_are_padded_to_max_model_len(seed, memory):
    rng = np.random.default_rng(seed)
    cache = filled_cache(rng, 3)
    writer, store = memory(record_format="fastdeploy-raw")
    handoff = Handoff(cache, writer, num_experts=NUM_EXPERTS, layer_map=(0, 1, 2),
                      record_format="fastdeploy-raw", pad_to=32)
    row = rng.permutation(16)[:4]
    assert handoff.finish("exp_3:0:0", None, row, 13, BLOCK)
    ids = decode_fastdeploy_raw(store.get("exp_3:0:0"), 3, 32, 4, np.uint8)
    np.testing.assert_array_equal(ids[:, :13], numpy_gather(cache, row, 13))
    assert (ids[:, 13:] == 255).all()


def test_rows_without_routing_are_stored_with_the_fill_and_counted(seed, memory):
    rng = np.random.default_rng(seed)
    cache = filled_cache(rng, 2)
    cache.invalidate(np.array([5, 9]))           # slots 5 and 9 lost their routing
    writer, store = memory()
    handoff = Handoff(cache, writer, num_experts=NUM_EXPERTS, layer_map=(0, 1), pad_to=16)
    assert handoff.finish("exp_4:0:0", None, np.array([1, 2, 3]), 11, BLOCK)    # slots 4..14
    record = RoutingReader(store).get("exp_4:0:0")
    assert record.ids.shape == (2, 16, 4) and (record.ids[:, 11:] == 255).all()
    assert record.metadata["missing_tokens"] == 2 and record.metadata["num_tokens"] == 11
    assert writer.stats()["records_incomplete"] == 1


def test_a_cache_laid_out_with_extra_rows_hands_over_our_layers_only(seed, memory):
    """layer_columns (FastDeploy 2.6's view counts leading dense layers as rows): writes land
    in the given rows, the others keep the fill value, records hold our layers."""
    from fd_routing_replay.errors import OpsError

    rng = np.random.default_rng(seed)
    num_rows, num_layers = int(rng.integers(3, 9)), 0
    while num_layers == 0:
        columns = np.sort(rng.choice(num_rows, size=int(rng.integers(1, num_rows)), replace=False))
        num_layers = len(columns)
    cache = HostSlotCache(40, num_rows, 4, np.uint8, 255, layer_columns=columns)
    assert cache.num_layers == num_layers
    slots = np.arange(40)
    rows = rng.integers(0, NUM_EXPERTS, (40, num_layers, 4)).astype(np.uint8)
    cache.write(slots, rows)
    reference = np.full((40, num_rows, 4), 255, np.uint8)        # numpy, one row at a time
    for slot in slots:
        for j, column in enumerate(columns):
            reference[slot, column] = rows[slot, j]
    np.testing.assert_array_equal(cache.array, reference)
    layer_map = [int(c) + 1 for c in columns]
    writer, store = memory()
    block_row = rng.permutation(10)
    length = int(rng.integers(1, 40))
    handoff = Handoff(cache, writer, num_experts=NUM_EXPERTS, layer_map=layer_map)
    assert handoff.finish("exp_5:0:0", None, block_row, length, BLOCK)
    record = RoutingReader(store).get("exp_5:0:0")
    positions = np.arange(length)
    expected = rows[block_row[positions // BLOCK] * BLOCK + positions % BLOCK].transpose(1, 0, 2)
    np.testing.assert_array_equal(record.ids, expected)
    assert "missing_tokens" not in record.metadata and record.layers == tuple(layer_map)
    with pytest.raises(OpsError, match="do not fit"):
        cache.write(slots, rng.integers(0, 4, (len(slots), num_rows + 1, 4)).astype(np.uint8))
    for bad in ([num_rows], [0, 0], []):
        with pytest.raises(OpsError, match="layer_columns"):
            HostSlotCache(4, num_rows, 4, np.uint8, 255, layer_columns=bad)
    assert HostSlotCache(4, 3, 4, np.uint8, 255, layer_columns=[0, 1, 2]).layer_columns is None


@pytest.mark.parametrize(("layer_map", "problem"), [
    ([0, 1], "has 2 entries for 3 layers"),
    ([0, 2, 1], "strictly increasing"),
    ([0, 1, 70000], "not an int in [0, 65535]"),
    ([0, 1, 2.0], "not an int"),
    ({0, 1, 2}, "must be a sequence of ints"),
])
def test_a_bad_layer_map_is_refused_naming_it(seed, layer_map, problem):
    cache = filled_cache(np.random.default_rng(seed), 3)
    with pytest.raises(RecordError) as info:
        Handoff(cache, None, num_experts=NUM_EXPERTS, layer_map=layer_map)
    assert "capture layer map" in str(info.value) and problem in str(info.value)


def test_gather_request_matches_numpy_and_refuses_what_it_cannot_gather(seed):
    rng = np.random.default_rng(seed)
    cache = filled_cache(rng, 5)
    row = rng.permutation(16)[:6].astype(np.int32)
    for start, length in ((0, 0), (0, 1), (3, 17), (0, 24)):
        out = np.empty((5, length - start, 4), np.uint8)
        assert gather_request(cache, row, start, length, BLOCK, out) is out
        np.testing.assert_array_equal(out, numpy_gather(cache, row, length, start))
    with pytest.raises(ValueError, match="blocks; the block table has 6"):
        gather_request(cache, row, 0, 25, BLOCK)
    with pytest.raises(ValueError, match="have no KV block"):
        gather_request(cache, np.array([2, -1]), 0, 8, BLOCK)
    with pytest.raises(ValueError, match="out must be"):
        gather_request(cache, row, 0, 8, BLOCK, np.empty((5, 7, 4), np.uint8))


def test_response_mode_encodes_the_record_on_this_thread(seed):
    rng = np.random.default_rng(seed)
    cache = filled_cache(rng, 3)
    handoff = Handoff(cache, None, num_experts=NUM_EXPERTS, layer_map=(1, 2, 3),
                      metadata={"engine": "test"})
    row = rng.permutation(16)[:5]
    data = handoff.encoded("exp_6:0:0", "chatcmpl-exp_6:0:0-y", row, 18, BLOCK, list(range(19)))
    record = decode_record(data)
    np.testing.assert_array_equal(record.ids, numpy_gather(cache, row, 18))
    assert record.metadata["num_tokens"] == 18 and record.layers == (1, 2, 3)
    assert record.tokens_hash == tokens_digest(np.arange(18))
    assert handoff.encoded("exp_6:0:0", None, np.array([-1]), 3, BLOCK) is None      # no KV block
    assert handoff.counters["records_returned"] == 1 and handoff.counters["records_failed"] == 1


def test_a_record_the_writer_drops_is_counted_lost(seed, memory, caplog):
    rng = np.random.default_rng(seed)
    cache = filled_cache(rng, 4)
    writer, store = memory(capacity_bytes=64, full_policy="drop")
    handoff = Handoff(cache, writer, num_experts=NUM_EXPERTS, layer_map=(0, 1, 2, 3))
    assert not handoff.finish("exp_7:0:0", None, np.arange(16), 20, BLOCK)      # 320 bytes > 64
    assert handoff.counters["records_failed"] == 1 and writer.stats()["dropped"] == 1
    assert "exp_7:0:0" in caplog.text and store.list() == []
