"""Verification records after the store: the end-to-end row check, the mark and the refusals.

Records are built from the code's NumPy ``encode`` on random shapes, stored and read back
through a real store and :class:`RoutingReader` (rr-v1, plain and set encodings), then
damaged in known places; :func:`check_record` must name exactly those places.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from fd_routing_replay import RoutingReader, open_store
from fd_routing_replay.codec import RoutingRecord
from fd_routing_replay.codec.verification import VerificationCode, marker
from fd_routing_replay.config import load_config
from fd_routing_replay.errors import ConfigError, RecordError
from fd_routing_replay.reader.verification import check_record


def record(rng, *, ranks=1, tokens=None, rollout="exp_1:0:0:0", mark=True):
    experts, top_k, layers = int(rng.integers(10, 70)), int(rng.integers(2, 7)), int(rng.integers(2, 6))
    code = VerificationCode(experts, top_k, layers, ranks)
    count = int(tokens or rng.integers(20, 300))
    symbols = rng.integers(0, ranks, count)
    ids = code.encode(np.arange(count)[None, :], np.arange(layers)[:, None], symbols[None, :])
    ids = rng.permuted(ids, axis=2).astype(np.uint8)          # order inside the top-k is free
    layer_map = tuple(int(x) for x in np.sort(rng.choice(60, layers, replace=False)))
    metadata = {"verification": marker(code)} if mark else {}
    return code, RoutingRecord(rollout, ids, experts, 255, metadata, layers=layer_map)


@pytest.mark.parametrize("encoding", ["plain", "set"])
def test_a_clean_record_passes_after_the_store(tmp_path, seed, encoding, make_writer):
    rng = np.random.default_rng(seed)
    code, rec = record(rng, ranks=2)
    make_writer(f"local://{tmp_path / 'store'}", encoding=encoding).submit_put(rec.rollout_id, rec)
    back = RoutingReader(open_store(f"local://{tmp_path / 'store'}")).get(rec.rollout_id)
    verdict = check_record(back, expected_tokens=rec.num_tokens)
    assert verdict.ok, verdict.as_dict()
    assert verdict.rows_checked == rec.ids.shape[0] * rec.ids.shape[1]
    assert sum(verdict.ranks.values()) == verdict.rows_checked and set(verdict.ranks) <= {0, 1}
    assert verdict.period == code.period


def test_each_misplacement_is_named_by_position_and_layer(seed):
    rng = np.random.default_rng(seed)
    code, rec = record(rng, tokens=120)
    ids = rec.ids.copy()
    layers = ids.shape[0]
    shift_at = int(rng.integers(60, 110))
    ids[:, shift_at:] = rec.ids[:, shift_at - 1:-1]             # off by one from shift_at on
    swap_at = int(rng.integers(5, 50))
    ids[0, swap_at], ids[1, swap_at] = rec.ids[1, swap_at], rec.ids[0, swap_at]
    ids[layers - 1, 3] = 255                                    # a missing row
    ids[0, 2] = ids[0, 2, ::-1]                                 # order alone is no fault
    ids[1, 1] = code.encode(1, 1, 1)                            # rank 0's share, a rank's flag
    verdict = check_record(RoutingRecord(rec.rollout_id, ids, rec.num_experts, 255, rec.metadata,
                                         layers=rec.layers), expected_tokens=120)
    assert not verdict.ok
    kinds = {(f.position, f.layer_row): f.kind for f in verdict.faults}
    assert kinds[(1, 1)] == "gather" and kinds[(3, layers - 1)] == "missing"
    assert kinds[(swap_at, 0)] == kinds[(swap_at, 1)] == "layer"
    assert kinds.get((2, 0)) is None
    assert verdict.counts["position"] == layers * (120 - shift_at)
    assert verdict.counts["layer"] == 2 and verdict.counts["missing"] == 1 and verdict.counts["gather"] == 1
    first = verdict.first_fault
    assert (first.position, first.layer_row, first.kind) == (1, 1, "gather")
    assert first.decoder_layer == rec.layers[1]
    assert "TP rank 0's share" in first.detail
    shifted = next(f for f in verdict.faults if f.kind == "position") if verdict.counts["position"] else None
    if shifted is not None and shifted.position == shift_at:
        assert f"holds the row of position {shift_at - 1}, -1" in shifted.detail
    swapped = next(f for f in verdict.faults if f.kind == "layer" and f.layer_row == 0)
    assert f"MoE layer row 1's row (decoder layer {rec.layers[1]})" in swapped.detail


def test_foreign_rows_length_and_unmarked_records_fail(seed):
    rng = np.random.default_rng(seed)
    code, rec = record(rng, tokens=40)
    routing = rec.ids.copy()
    assert code.top_k > 1
    routing[:, 10] = rng.integers(0, code.num_experts)   # one id K times: never a K-subset, so no code
    verdict = check_record(RoutingRecord(rec.rollout_id, routing, rec.num_experts, 255, rec.metadata,
                                         layers=rec.layers), expected_tokens=41)
    assert not verdict.token_count_ok and verdict.counts["foreign"] == rec.ids.shape[0]
    assert "no verification value" in verdict.first_fault.detail
    _, plain = record(rng, mark=False)
    unmarked = check_record(plain)
    assert not unmarked.ok and "not a verification record" in unmarked.error
    odd = dict(rec.metadata, verification=dict(rec.metadata["verification"], period=code.period + 1))
    assert "period" in check_record(RoutingRecord(rec.rollout_id, rec.ids, rec.num_experts, 255, odd,
                                                  layers=rec.layers)).error


def test_a_padded_record_is_checked_up_to_its_tokens(seed):
    rng = np.random.default_rng(seed)
    _, rec = record(rng, tokens=30)
    padded = np.full((rec.ids.shape[0], 64, rec.ids.shape[2]), 255, np.uint8)
    padded[:, :30] = rec.ids
    metadata = dict(rec.metadata, num_tokens=30)
    verdict = check_record(RoutingRecord(rec.rollout_id, padded, rec.num_experts, 255, metadata,
                                         layers=rec.layers), expected_tokens=30)
    assert verdict.ok and verdict.num_tokens == 30


def test_trainer_adapters_refuse_verification_records_and_the_reader_warns(tmp_path, seed, caplog,
                                                                          make_writer):
    from fd_routing_replay.codec import verification as verification_module
    from fd_routing_replay.trainers import routes
    from fd_routing_replay.trainers.slime import to_sglang_routed_experts

    rng = np.random.default_rng(seed)
    _, rec = record(rng)
    store = open_store(f"local://{tmp_path / 'store'}")
    make_writer(f"local://{tmp_path / 'store'}").submit_put(rec.rollout_id, rec)
    verification_module._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="fd_routing_replay.codec.verification"):
        back = RoutingReader(store).get(rec.rollout_id)
        RoutingReader(store).get(rec.rollout_id)
    warnings = [r for r in caplog.records if "verification record" in r.getMessage()]
    assert len(warnings) == 1 and rec.rollout_id in warnings[0].getMessage()
    with pytest.raises(RecordError, match="verification mode"):
        routes(back)
    with pytest.raises(RecordError, match="must not be replayed"):
        to_sglang_routed_experts(back, num_layers=64)
    _, real = record(rng, mark=False)
    routes(real)                                              # real routing still passes


def test_capture_verify_is_a_config_key_that_needs_rr_v1():
    assert load_config().capture.verify is False
    assert load_config(env={"FD_RR_CAPTURE__VERIFY": "true"}).capture.verify is True
    with pytest.raises(ConfigError, match="capture.verify needs rr-v1"):
        load_config(overrides={"capture": {"verify": True, "record_format": "fastdeploy-raw"}})
