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
    with its ``pad_func`` (``arange(pad * layers * K).reshape(pad, layers, K) % E``), then
    column ``layer_id`` (dense layers skipped)."""
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
