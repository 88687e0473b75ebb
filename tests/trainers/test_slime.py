"""slime / SGLang: our record as SGLang's routed_experts, decoded the way slime decodes it."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from fd_routing_replay.trainers import (
    sglang_routed_experts_b64,
    to_sglang_routed_experts,
    unrouted_positions,
)
from fd_routing_replay.trainers.slime import with_record_routes
from tests.trainers.records import make_record


def sglang_capture(record, num_hidden_layers):
    """What SGLang's capturer returns for the same routing: a zero int32 buffer
    [tokens, num_hidden_layers, K] into which each MoE layer writes its own row."""
    buffer = np.zeros((record.num_tokens, num_hidden_layers, record.top_k), dtype=np.int32)
    for row, layer_id in enumerate(record.layer_map):       # capture(layer_id, topk_ids)
        buffer[:, layer_id, :] = record.ids[row]
    return buffer


def test_matches_sglang_capture_and_slime_decode(seed):
    gen = np.random.default_rng(seed)
    # DeepSeek-like: 6 decoder layers, 0 and 1 dense, the last one dense too.
    record = make_record(gen, tokens=11, layers=(2, 3, 4), top_k=3, num_experts=16)
    tokens = list(range(record.num_tokens + 1))              # slime's sample.tokens
    ours = to_sglang_routed_experts(record, num_layers=6)
    assert ours.dtype == np.int32 and ours.shape == (len(tokens) - 1, 6, 3)
    assert (ours == sglang_capture(record, 6)).all()
    meta_info = {"routed_experts": sglang_routed_experts_b64(record, num_layers=6)}
    decoded = np.frombuffer(base64.b64decode(meta_info["routed_experts"].encode("ascii")),
                            dtype=np.int32).reshape(len(tokens) - 1, 6, 3)
    assert (decoded == ours).all()


def test_defaults_unrouted_and_length(seed):
    gen = np.random.default_rng(seed)
    record = make_record(gen, tokens=8, layers=(1, 2), unrouted=(3,), pad_to=20)
    ours = to_sglang_routed_experts(record)                   # num_layers = last MoE + 1
    assert ours.shape == (8, 3, 2)                            # padding dropped (num_tokens)
    assert (ours[:, 0] == 0).all() and (ours[3, 1:] == [0, 1]).all()   # placeholders 0..K-1
    assert (ours[:3, 1:] == record.ids[:, :3].transpose(1, 0, 2)).all()
    assert unrouted_positions(record).tolist() == [3]
    marked = to_sglang_routed_experts(record, unrouted_fill=-1, dense_fill=-2, num_tokens=10)
    assert (marked[:, 0] == -2).all() and (marked[3, 1:] == -1).all()
    assert (marked[8:, 1:] == -1).all() and marked.shape == (10, 3, 2)
    assert to_sglang_routed_experts(record, num_tokens=0).shape == (0, 3, 2)
    with pytest.raises(ValueError, match="too small"):
        to_sglang_routed_experts(record, num_layers=2)


def slime_layer_replay(routed_experts, num_experts, moe_layers):
    """What slime's fill_routing_replay (slime/backends/megatron_utils/actor.py) hands the
    router of each MoE layer: the sample's ``rollout_routed_experts`` padded by one token
    with ``_pad_routed_experts`` (slime/backends/megatron_utils/cp_utils.py:
    ``arange(pad * layers * K).reshape(pad, layers, K) % E``), then column ``layer_id``
    (dense layers skipped)."""
    _, layers, top_k = routed_experts.shape
    pad = np.arange(layers * top_k).reshape(1, layers, top_k) % num_experts
    padded = np.concatenate([routed_experts, pad.astype(routed_experts.dtype)], axis=0)
    return {layer: padded[:, layer] for layer in moe_layers}


def test_every_token_slime_replays_goes_to_k_distinct_experts(seed):
    """Unrouted positions — in the record, or past its end when ``num_tokens`` asks for
    more — reach slime's routers as K distinct in-range experts (the placeholders
    0..K-1), as slime's own padding does; never [0, 0, ...]."""
    gen = np.random.default_rng(seed)
    top_k, num_experts, tokens = 4, 32, 12
    unrouted = tuple(int(u) for u in gen.choice(tokens, size=3, replace=False))
    record = make_record(gen, tokens=tokens, layers=(2, 3, 5), top_k=top_k,
                         num_experts=num_experts, unrouted=unrouted)
    ours = to_sglang_routed_experts(record, num_layers=7, num_tokens=tokens + 2)
    assert ours.dtype == np.int32 and ours.shape == (tokens + 2, 7, top_k)
    assert (ours[:, [0, 1, 4, 6]] == 0).all()                 # dense layers: as SGLang
    for layer, ids in slime_layer_replay(ours, num_experts, record.layer_map).items():
        assert ((ids >= 0) & (ids < num_experts)).all(), layer
        ordered = np.sort(ids, axis=1)
        assert (ordered[:, 1:] != ordered[:, :-1]).all(), f"duplicate experts in layer {layer}"
    missing = sorted(unrouted) + [tokens, tokens + 1]
    assert (ours[missing][:, list(record.layer_map)] == np.arange(top_k)).all()
    routed = [t for t in range(tokens) if t not in unrouted]
    assert (ours[routed][:, list(record.layer_map)] ==
            record.ids[:, routed].transpose(1, 0, 2)).all()


def slime_apply_meta_info(tokens, existing, meta_info, num_layers, top_k):
    """slime's ``Sample._apply_meta_info`` (slime/utils/types.py) for ``routed_experts``:
    decode the int32 base64, check its element count against the sample's tokens less
    ``routed_experts_start_len``, then keep it whole (start 0 or absent) or append it to
    the first ``start`` rows the sample already holds."""
    if meta_info.get("routed_experts") is None:
        return existing
    flat = np.frombuffer(base64.b64decode(meta_info["routed_experts"].encode("ascii")),
                         dtype=np.int32)
    start = int(meta_info.get("routed_experts_start_len", 0) or 0)
    rows = max(0, len(tokens) - 1 - start)
    if flat.size != rows * num_layers * top_k:
        raise ValueError(f"SGLang routed_experts element count does not match sample tokens: "
                         f"got={flat.size}, expected={rows * num_layers * top_k}")
    routed = flat.reshape(rows, num_layers, top_k)
    if start == 0:
        return routed
    if existing is None or existing.shape[0] < start:
        raise ValueError("Cannot append partial routed experts")
    return np.concatenate([existing[:start], routed])


def test_multi_turn_swap_drops_sglangs_start_len(seed):
    """Turn 2 of a slime multi-turn sample: SGLang sends only the rows after
    ``routed_experts_start_len``; our record holds the whole conversation.  Swapping only
    ``routed_experts`` fails slime's element-count check; with_record_routes drops the
    start so slime takes the record's rows from position 0."""
    gen = np.random.default_rng(seed)
    num_layers, top_k = 5, 2
    turn1_tokens, turn2_tokens = 9, 16                  # sample.tokens after each turn
    record1 = make_record(gen, "exp_s:0:0", tokens=turn1_tokens - 1, layers=(1, 2, 4))
    record2 = make_record(gen, "exp_s:1:0", tokens=turn2_tokens - 1, layers=(1, 2, 4))
    tokens = list(range(turn1_tokens))
    held = slime_apply_meta_info(tokens, None, with_record_routes(
        {"routed_experts_start_len": 0}, record1, num_layers=num_layers), num_layers, top_k)
    assert (held == to_sglang_routed_experts(record1, num_layers=num_layers)).all()

    tokens = list(range(turn2_tokens))
    sglang = {"routed_experts": "unused", "routed_experts_start_len": turn1_tokens - 1,
              "finish_reason": {"type": "stop"}}
    swapped_naively = dict(sglang, routed_experts=sglang_routed_experts_b64(
        record2, num_layers=num_layers))
    with pytest.raises(ValueError, match="element count does not match"):
        slime_apply_meta_info(tokens, held, swapped_naively, num_layers, top_k)
    meta_info = with_record_routes(sglang, record2, num_layers=num_layers,
                                   num_tokens=len(tokens) - 1)
    assert "routed_experts_start_len" not in meta_info
    assert meta_info["finish_reason"] == {"type": "stop"} and sglang["routed_experts"] == "unused"
    routes = slime_apply_meta_info(tokens, held, meta_info, num_layers, top_k)
    assert routes.shape == (turn2_tokens - 1, num_layers, top_k)
    assert (routes == to_sglang_routed_experts(record2, num_layers=num_layers)).all()
