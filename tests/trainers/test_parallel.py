"""Routes, layer selection and the PP / CP / SP slicing helpers against plain loops."""

from __future__ import annotations

import numpy as np
import pytest

from fd_routing_replay.trainers import (
    context_parallel_indices,
    pipeline_layer_ranges,
    rank_moe_layers,
    routed_length,
    routes,
    sequence_parallel_slice,
    shard_tokens,
    slice_layers,
)
from tests.trainers.records import make_record


def test_routes_are_int64_without_fill_and_masked(seed):
    gen = np.random.default_rng(seed)
    record = make_record(gen, tokens=9, unrouted=(0, 4), top_k=3, num_experts=6)
    record.ids.flags.writeable = True
    record.ids[1, 6, 1] = record.fill_value          # one slot of one layer missing
    ids, valid = routes(record)
    assert ids.dtype == np.int64 and ids.shape == (3, 9, 3)
    assert ids.min() >= 0 and ids.max() < 6           # never the fill, never -1
    for layer in range(3):
        for t in range(9):
            row = record.ids[layer, t]
            expected_valid = not (row == record.fill_value).any()
            assert valid[layer, t] == expected_valid
            expected = row.astype(np.int64) if expected_valid else np.arange(3)
            assert (ids[layer, t] == expected).all()


def test_routes_select_decoder_layers_by_the_layer_map(seed):
    gen = np.random.default_rng(seed)
    record = make_record(gen, layers=(3, 5, 7, 9))
    ids, _ = routes(record, [9, 3])
    assert (ids[0] == record.ids[3]).all() and (ids[1] == record.ids[0]).all()
    with pytest.raises(ValueError, match=r"decoder layer\(s\) \[4\]"):
        routes(record, [3, 4])


def test_routes_of_a_padded_record_stop_at_num_tokens_and_extend_unrouted(seed):
    gen = np.random.default_rng(seed)
    record = make_record(gen, tokens=5, pad_to=12)
    assert routed_length(record) == 5
    ids, valid = routes(record)
    assert ids.shape[1] == 5 and valid.all()
    ids, valid = routes(record, length=8)              # a longer trainer sequence
    assert valid[:, :5].all() and not valid[:, 5:].any()
    assert (ids[:, 5:] == np.arange(record.top_k)).all()
    ids, valid = routes(record, length=0)
    assert ids.shape == (3, 0, 2) and valid.shape == (3, 0)


def _megatron_pp_reference(num_layers, pp, rank, vp=None, first=None, last=None):
    """Layer ownership by brute force: deal layers to (chunk, rank) as Megatron does."""
    if vp is None:
        if first is None and last is None:
            sizes = [num_layers // pp] * pp
        else:
            middle = pp - (first is not None) - (last is not None)
            rest = num_layers - (first or 0) - (last or 0)
            sizes = [rest // middle if middle else 0] * pp
            if first is not None:
                sizes[0] = first
            if last is not None:
                sizes[-1] = last
        owner = [r for r in range(pp) for _ in range(sizes[r])]
        return [[layer for layer in range(num_layers) if owner[layer] == rank]]
    chunk = num_layers // (pp * vp)
    owner = [(layer // chunk) % pp for layer in range(num_layers)]       # round robin chunks
    model_chunk = [layer // (chunk * pp) for layer in range(num_layers)]
    return [[layer for layer in range(num_layers) if owner[layer] == rank and model_chunk[layer] == v]
            for v in range(vp)]


@pytest.mark.parametrize("num_layers,pp,vp,first,last", [
    (8, 1, None, None, None), (8, 2, None, None, None), (12, 4, None, None, None),
    (10, 3, None, 2, 2), (9, 2, None, 4, None), (16, 2, 2, None, None), (24, 2, 3, None, None),
])
def test_pipeline_layer_ranges_match_megatron_split(num_layers, pp, vp, first, last):
    for rank in range(pp):
        got = [list(r) for r in pipeline_layer_ranges(num_layers, pp, rank, vp_size=vp,
                                                       first_stage_layers=first,
                                                       last_stage_layers=last)]
        assert got == _megatron_pp_reference(num_layers, pp, rank, vp, first, last)
    every = sorted(layer for rank in range(pp) for r in pipeline_layer_ranges(
        num_layers, pp, rank, vp_size=vp, first_stage_layers=first, last_stage_layers=last)
        for layer in r)
    assert every == list(range(num_layers))


def test_pipeline_layer_ranges_refuse_bad_splits():
    with pytest.raises(ValueError, match="not divisible"):
        pipeline_layer_ranges(10, 4, 0)
    with pytest.raises(ValueError, match="pp_rank"):
        pipeline_layer_ranges(8, 2, 2)
    with pytest.raises(ValueError, match="cannot be split"):
        pipeline_layer_ranges(11, 4, 0, first_stage_layers=3, last_stage_layers=3)


def test_rank_gets_only_its_moe_layers(seed):
    gen = np.random.default_rng(seed)
    # DeepSeek-like: 8 decoder layers, 0..2 dense, MoE 3..7; 2 pipeline stages.
    record = make_record(gen, layers=(3, 4, 5, 6, 7), tokens=6)
    stage0 = pipeline_layer_ranges(8, 2, 0)
    stage1 = pipeline_layer_ranges(8, 2, 1)
    assert rank_moe_layers(record, stage0) == (3,)
    assert rank_moe_layers(record, stage1) == (4, 5, 6, 7)
    part = slice_layers(record, stage1)
    assert part.layer_map == (4, 5, 6, 7)
    assert np.shares_memory(part.ids, record.ids)       # contiguous rows: a view
    assert (part.ids == record.ids[1:]).all()
    picked = slice_layers(record, [7, 3])
    assert picked.layer_map == (3, 7) and (picked.ids == record.ids[[0, 4]]).all()
    empty = slice_layers(record, [0, 1])
    assert empty.ids.shape == (0, 6, 2) and empty.layer_map == ()


@pytest.mark.parametrize("seq_len,cp", [(8, 2), (24, 3), (16, 4), (5, 1), (0, 2)])
def test_context_parallel_indices_cover_the_sequence_once(seq_len, cp):
    chunks = np.array_split(np.arange(seq_len), 2 * cp) if cp > 1 else [np.arange(seq_len)]
    seen = []
    for rank in range(cp):
        got = context_parallel_indices(seq_len, cp, rank)
        expected = np.concatenate([chunks[rank], chunks[2 * cp - 1 - rank]]) if cp > 1 \
            else chunks[0]
        assert got.tolist() == expected.tolist()
        seen += got.tolist()
    assert sorted(seen) == list(range(seq_len))
    with pytest.raises(ValueError, match="divisible"):
        context_parallel_indices(seq_len + 1 if seq_len % 2 == 0 else seq_len, 2, 0)


def test_context_parallel_contiguous_and_sequence_parallel_slices():
    assert context_parallel_indices(12, 3, 1, load_balanced=False).tolist() == [4, 5, 6, 7]
    assert sequence_parallel_slice(12, 4, 2) == slice(6, 9)
    with pytest.raises(ValueError, match="tensor parallel size 4"):
        sequence_parallel_slice(10, 4, 0)


def test_shard_tokens_marks_positions_past_the_record_unrouted(seed):
    gen = np.random.default_rng(seed)
    record = make_record(gen, tokens=7)                  # a trainer sequence of 8 tokens
    positions = context_parallel_indices(8, 2, 1)        # chunks 1 and 2: 2,3,4,5
    part = shard_tokens(record, positions)
    assert (part.ids == record.ids[:, 2:6]).all()
    last = shard_tokens(record, context_parallel_indices(8, 2, 0))   # 0,1,6,7
    assert (last.ids[:, :3] == record.ids[:, [0, 1, 6]]).all()
    assert (last.ids[:, 3] == record.fill_value).all()   # position 7 was never forwarded
    _, valid = routes(last)
    assert valid[:, :3].all() and not valid[:, 3].any()
