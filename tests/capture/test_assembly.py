"""RecordAssembler's layer map: fused and per-layer records carry global decoder-layer indices."""

from __future__ import annotations

import numpy as np
import pytest

from fd_routing_replay.capture.assembly import RecordAssembler
from fd_routing_replay.capture.host_cache import HostSlotCache
from fd_routing_replay.codec import decode_record, encode_record
from fd_routing_replay.errors import RecordError

NUM_EXPERTS = 16


def filled_cache(rng: np.random.Generator, num_layers: int, slots: int = 32) -> HostSlotCache:
    cache = HostSlotCache(slots, num_layers, 4, np.uint8, 255)
    cache.write(np.arange(slots), rng.integers(0, NUM_EXPERTS, (slots, num_layers, 4)).astype(np.uint8))
    return cache


def random_layer_map(rng: np.random.Generator, num_layers: int) -> list[int]:
    """Leading dense layers (like DeepSeek-V3's first_k_dense_replace) and random gaps."""
    first_dense = int(rng.integers(0, 5))
    gaps = rng.integers(1, 3, size=num_layers)
    return [first_dense + int(x) for x in np.cumsum(gaps) - gaps[0]]


def test_fused_record_carries_the_layer_map(seed):
    rng = np.random.default_rng(seed)
    num_layers = int(rng.integers(1, 9))
    layer_map = random_layer_map(rng, num_layers)
    cache = filled_cache(rng, num_layers)
    slots = rng.permutation(32)[: int(rng.integers(1, 20))]
    (key, record), = RecordAssembler(cache, num_experts=NUM_EXPERTS,
                                     layer_map=layer_map).assemble("exp_1:0:0", slots).items
    assert key == "exp_1:0:0" and record.layers == tuple(layer_map)
    decoded = decode_record(encode_record(record))
    assert decoded.layers == tuple(layer_map) and decoded.token_convention == "forwarded"
    np.testing.assert_array_equal(decoded.ids, cache.array[slots].transpose(1, 0, 2))


def test_per_layer_records_carry_their_layers_global_index(seed):
    rng = np.random.default_rng(seed)
    layer_map = [3, 4, 5, 6]  # DeepSeek-V3-like: decoder layers 0-2 are dense
    cache = filled_cache(rng, len(layer_map))
    slots = np.array([5, 1, 9])
    items = RecordAssembler(cache, num_experts=NUM_EXPERTS, fused=False,
                            layer_map=layer_map).assemble("exp_2:0:0", slots).items
    # Keys keep FastDeploy's {rollout_id}_{row} naming; the header says which decoder layer.
    assert [key for key, _ in items] == [f"exp_2:0:0_{row}" for row in range(4)]
    for row, (_, record) in enumerate(items):
        decoded = decode_record(encode_record(record))
        assert decoded.layers == (layer_map[row],)
        assert decoded.metadata["layer"] == row and decoded.metadata["num_layers"] == 4
        np.testing.assert_array_equal(decoded.ids[0], cache.array[slots, row])


def test_default_layer_map_is_range(seed):
    rng = np.random.default_rng(seed)
    cache = filled_cache(rng, 3)
    assembler = RecordAssembler(cache, num_experts=NUM_EXPERTS, fused=False)
    assert assembler.layer_map == (0, 1, 2)
    items = assembler.assemble("exp_3:0:0", np.array([0, 1])).items
    assert [decode_record(encode_record(r)).layers for _, r in items] == [(0,), (1,), (2,)]
    (_, fused), = RecordAssembler(cache, num_experts=NUM_EXPERTS).assemble(
        "exp_3:0:0", np.array([0, 1])).items
    assert decode_record(encode_record(fused)).layers == (0, 1, 2)


def test_layer_map_accepts_numpy_and_ranges(seed):
    cache = filled_cache(np.random.default_rng(seed), 3)
    assert RecordAssembler(cache, num_experts=NUM_EXPERTS, layer_map=np.array([1, 3, 5])).layer_map == (1, 3, 5)
    assert RecordAssembler(cache, num_experts=NUM_EXPERTS, layer_map=range(3, 6)).layer_map == (3, 4, 5)


@pytest.mark.parametrize(("layer_map", "problem"), [
    ([0, 1], "has 2 entries for 3 layers"),
    ([0, 2, 1], "strictly increasing"),
    ([0, 1, 70000], "not an int in [0, 65535]"),
    ([0, 1, 2.0], "not an int"),
    ({0, 1, 2}, "must be a sequence of ints"),
])
def test_bad_layer_map_is_refused_naming_it(seed, layer_map, problem):
    cache = filled_cache(np.random.default_rng(seed), 3)
    with pytest.raises(RecordError) as info:
        RecordAssembler(cache, num_experts=NUM_EXPERTS, layer_map=layer_map)
    assert "RecordAssembler layer_map" in str(info.value) and problem in str(info.value)


def test_a_cache_laid_out_with_extra_rows_takes_and_returns_our_layers_only(seed):
    """layer_columns (FastDeploy 2.6's view counts leading dense layers as rows): writes land
    in the given rows, the others keep the fill value, reads and records hold our layers."""
    from fd_routing_replay.errors import OpsError

    rng = np.random.default_rng(seed)
    num_rows, num_layers = int(rng.integers(3, 9)), 0
    while num_layers == 0:
        columns = np.sort(rng.choice(num_rows, size=int(rng.integers(1, num_rows)), replace=False))
        num_layers = len(columns)
    cache = HostSlotCache(40, num_rows, 4, np.uint8, 255, layer_columns=columns)
    assert cache.num_layers == num_layers
    slots = rng.permutation(40)[: int(rng.integers(1, 30))]
    rows = rng.integers(0, NUM_EXPERTS, (len(slots), num_layers, 4)).astype(np.uint8)
    cache.write(slots, rows)
    reference = np.full((40, num_rows, 4), 255, np.uint8)        # numpy, one row at a time
    for i, slot in enumerate(slots):
        for j, column in enumerate(columns):
            reference[slot, column] = rows[i, j]
    np.testing.assert_array_equal(cache.array, reference)
    np.testing.assert_array_equal(cache.read(slots), rows)
    layer_map = [int(c) + 1 for c in columns]
    (_, record), = RecordAssembler(cache, num_experts=NUM_EXPERTS, layer_map=layer_map).assemble(
        "exp_1:0:0", slots).items
    np.testing.assert_array_equal(record.ids, rows.transpose(1, 0, 2))
    assert "missing_tokens" not in record.metadata and record.layers == tuple(layer_map)
    with pytest.raises(OpsError, match="do not fit"):
        cache.write(slots, rng.integers(0, 4, (len(slots), num_rows + 1, 4)).astype(np.uint8))
    for bad in ([num_rows], [0, 0], []):
        with pytest.raises(OpsError, match="layer_columns"):
            HostSlotCache(4, num_rows, 4, np.uint8, 255, layer_columns=bad)
    assert HostSlotCache(4, 3, 4, np.uint8, 255, layer_columns=[0, 1, 2]).layer_columns is None
