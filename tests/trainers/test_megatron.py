"""Megatron-Core replay data: token layouts and parallel splits against plain loops.

The real router runs in test_megatron_core.py."""

from __future__ import annotations

import numpy as np
import pytest

from fd_routing_replay.codec import RoutingRecord
from fd_routing_replay.trainers import (
    build_megatron_replay,
)
from tests.trainers.records import make_record

LAYERS = (1, 2, 3)          # a 4-layer model: decoder layer 0 dense, 1..3 MoE


# -- reference layouts ---------------------------------------------------------------------

def _reference_rows(record, layer_rows, length, top_k):
    """Per position of one padded sequence: (ids per router, routed?), by plain loops."""
    rows = []
    for pos in range(length):
        per_router, routed = [], []
        for row in layer_rows:
            ok = record is not None and pos < record.ids.shape[1] and \
                pos < record.metadata.get("num_tokens", record.ids.shape[1]) and \
                all(int(x) != record.fill_value for x in record.ids[row, pos])
            per_router.append([int(x) for x in record.ids[row, pos]] if ok else list(range(top_k)))
            routed.append(ok)
        rows.append((per_router, routed))
    return rows


def _chunks(length, cp, rank):
    if cp == 1:
        return list(range(length))
    parts = np.array_split(np.arange(length), 2 * cp)
    return list(parts[rank]) + list(parts[2 * cp - 1 - rank])


def _thd_reference(records, seq_lens, mult, cp, cp_rank, tp, tp_rank, layer_rows, k):
    packed = []
    for record, length in zip(records, seq_lens, strict=True):
        padded = -(-length // mult) * mult
        rows = _reference_rows(record, layer_rows, padded, k)
        for pos in _chunks(padded, cp, cp_rank):
            ids, ok = rows[pos]
            if pos >= length:
                ids, ok = [list(range(k))] * len(layer_rows), [False] * len(layer_rows)
            packed.append((ids, ok))
    share = len(packed) // tp
    return packed[tp_rank * share:(tp_rank + 1) * share]


def _check(replay, expected, k):
    assert len(replay.topk) == len(LAYERS)
    for router in range(len(LAYERS)):
        ids = replay.topk[router]
        assert ids.dtype == np.int64 and ids.shape == (len(expected), k)
        assert ids.min(initial=0) >= 0                      # never -1
        for t, (row_ids, row_ok) in enumerate(expected):
            assert ids[t].tolist() == row_ids[router], (router, t)
            assert bool(replay.mask[router, t]) == row_ok[router], (router, t)


@pytest.mark.parametrize("mult,cp,tp", [(1, 1, 1), (4, 1, 1), (4, 2, 1), (8, 2, 2), (2, 1, 2)])
def test_thd_packing_matches_reference(seed, mult, cp, tp):
    gen = np.random.default_rng(seed)
    records = [make_record(gen, f"exp_a:{i}:0", tokens=n, layers=LAYERS, top_k=2,
                           unrouted=(1,) if i == 1 else ())
               for i, n in enumerate((5, 9, 2))]
    seq_lens = [6, 10, 3]                      # prompt + generated = forwarded + 1
    if (sum(-(-n // mult) * mult for n in seq_lens) // (2 * cp if cp > 1 else 1)) % tp:
        pytest.skip("combination not divisible")
    for cp_rank in range(cp):
        for tp_rank in range(tp):
            replay = build_megatron_replay(records, LAYERS, pad_to_multiple=mult, cp_size=cp,
                                           cp_rank=cp_rank, tp_size=tp, tp_rank=tp_rank,
                                           sequence_parallel=tp > 1)
            expected = _thd_reference(records, seq_lens, mult, cp, cp_rank, tp, tp_rank,
                                      [0, 1, 2], 2)
            _check(replay, expected, 2)
    full = build_megatron_replay(records, LAYERS, pad_to_multiple=mult)
    padded = [-(-n // mult) * mult for n in seq_lens]
    assert full.cu_seqlens.tolist() == np.concatenate([[0], np.cumsum(padded)]).tolist()
    # The last position of every sequence (never forwarded) is a placeholder, masked.
    for i, n in enumerate(seq_lens):
        assert not full.token_mask[full.cu_seqlens[i] + n - 1]


@pytest.mark.parametrize("cp,tp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_sbhd_rows_are_sequence_major(seed, cp, tp):
    gen = np.random.default_rng(seed)
    records = [make_record(gen, f"exp_b:{i}:0", tokens=n, layers=LAYERS)
               for i, n in enumerate((3, 7))] + [None]
    seq_lens = [4, 8, 5]
    width = 8
    grids = [_reference_rows(r, [0, 1, 2], width, 2) for r in records]
    for cp_rank in range(cp):
        keep = _chunks(width, cp, cp_rank)
        expected = []
        for s in keep:                              # [s, b] flattened: s outer, b inner
            for b, length in enumerate(seq_lens):
                ids, ok = grids[b][s]
                if s >= length:
                    ok = [False] * 3
                    ids = [[0, 1]] * 3
                expected.append((ids, ok))
        for tp_rank in range(tp):
            share = len(expected) // tp
            replay = build_megatron_replay(records, LAYERS, layout="sbhd", seq_lens=seq_lens,
                                           max_seq_len=width, cp_size=cp, cp_rank=cp_rank,
                                           tp_size=tp, tp_rank=tp_rank, sequence_parallel=tp > 1)
            _check(replay, expected[tp_rank * share:(tp_rank + 1) * share], 2)
            assert replay.cu_seqlens is None


def test_edge_cases(seed):
    gen = np.random.default_rng(seed)
    empty = build_megatron_replay([], LAYERS, top_k=2, num_experts=8)
    assert [ids.shape for ids in empty.topk] == [(0, 2)] * 3 and empty.mask.shape == (3, 0)
    with pytest.raises(ValueError, match="top_k and num_experts"):
        build_megatron_replay([], LAYERS)
    record = make_record(gen, tokens=6, layers=LAYERS)
    cut = build_megatron_replay([record], LAYERS, seq_lens=[3])   # truncated sequence
    assert cut.num_tokens == 3 and cut.token_mask.all()
    assert (cut.topk[2] == record.ids[2, :3]).all()
    none = build_megatron_replay([None, record], LAYERS, seq_lens=[2, 7])
    assert not none.token_mask[:2].any() and none.token_mask[2:8].all()
    with pytest.raises(ValueError, match="seq_lens"):
        build_megatron_replay([None], LAYERS, top_k=2, num_experts=8)
    with pytest.raises(ValueError, match="decoder layer"):
        build_megatron_replay([record], (0, 1))                 # layer 0 is dense
    with pytest.raises(ValueError, match="divisible by 2 x cp_size"):
        build_megatron_replay([record], LAYERS, cp_size=2)
    other = RoutingRecord("exp_c:0:0", np.zeros((3, 2, 4), np.uint8), 8, layers=LAYERS)
    with pytest.raises(ValueError, match="disagree"):
        build_megatron_replay([record, other], LAYERS)
