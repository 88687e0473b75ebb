"""The tiny MoE model: the paged, chunked engine forward equals the full forward."""

from __future__ import annotations

import numpy as np
import pytest

from fdrr_dev.harness.fidelity import topk_margins
from fdrr_dev.harness.model import TinyMoEConfig, TinyMoEModel
from tests.near_ties import agreeing_tokens


def test_deterministic_weights():
    a, b = TinyMoEModel(), TinyMoEModel()
    np.testing.assert_array_equal(a.layers[1]["gate"].numpy(), b.layers[1]["gate"].numpy())
    c = TinyMoEModel(weights_version=1)
    assert not np.array_equal(a.layers[1]["gate"].numpy(), c.layers[1]["gate"].numpy())


def test_paged_chunked_forward_matches_full_forward(seed):
    rng = np.random.default_rng(seed)
    model = TinyMoEModel(TinyMoEConfig(max_model_len=64))
    cfg = model.config
    tokens = rng.integers(1, cfg.vocab_size, 37)
    full = model.forward_full(tokens)
    block_size = 4
    blocks = rng.permutation(20)[:10]                       # scattered physical blocks
    slots = blocks[np.arange(37) // block_size] * block_size + np.arange(37) % block_size
    kv = model.new_kv_cache(20 * block_size)
    seen = {layer: [] for layer in range(cfg.num_moe_layers)}
    logits = []
    for start, end in ((0, 11), (11, 30), (30, 31), (31, 37)):   # chunks, then a 1-token step
        pos = np.arange(start, end)
        ctx = np.tile(slots[:end], (end - start, 1))
        mask = np.arange(end)[None, :] <= pos[:, None]

        def hook(layer_idx, topk_ids):
            seen[layer_idx].append(topk_ids.numpy())

        logits.append(model.forward_step(tokens[start:end], pos, slots[start:end], ctx, mask, kv, hook).numpy())
    # every token before a near-tie that went the other way (all of them in almost every run)
    t0 = agreeing_tokens(np.stack([np.concatenate(seen[layer]) for layer in range(cfg.num_moe_layers)]),
                         full.topk_ids, full.gate_logits, near_tie=1e-3)
    np.testing.assert_allclose(np.concatenate(logits)[:t0], full.logits[:t0], rtol=1e-4, atol=1e-4)


def test_replay_of_own_routing_is_identity(seed):
    rng = np.random.default_rng(seed)
    model = TinyMoEModel(TinyMoEConfig(max_model_len=32))
    tokens = rng.integers(1, model.config.vocab_size, 20)
    free = model.forward_full(tokens)
    replayed = model.forward_full(tokens, replay=free.topk_ids)
    np.testing.assert_allclose(replayed.logits, free.logits, rtol=1e-5, atol=1e-5)
    other = free.topk_ids.copy()
    other[0, 5] = (other[0, 5] + 1) % model.config.num_experts          # force other experts
    assert not np.allclose(model.forward_full(tokens, replay=other).logits[5:], free.logits[5:])


def test_topk_margins_reference():
    logits = np.array([[5.0, 1.0, 3.0, 2.9995, 0.0]])
    assert abs(topk_margins(logits, 2)[0] - 0.0005) < 1e-9
    assert abs(topk_margins(logits, 1)[0] - 2.0) < 1e-9


def test_agreeing_tokens_stops_at_a_near_tie_and_refuses_a_decisive_difference(seed):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((3, 10, 8))
    want = np.argsort(-logits, axis=-1)[..., :2]
    assert agreeing_tokens(want[..., ::-1], want, logits, near_tie=1e-3) == 10   # order ignored
    tie = logits.copy()
    second, third = np.sort(tie[1, 6])[::-1][1:3]
    tie[1, 6][tie[1, 6] == third] = second - 1e-5                 # layer 1, token 6: a near-tie
    want = np.argsort(-tie, axis=-1)[..., :2]
    got = want.copy()
    got[1, 6, 1] = np.argsort(-tie[1, 6])[2]                       # ... that went the other way
    got[2, 7:] = got[2, 7:][..., ::-1] + 0                         # later tokens: anything
    got[2, 8, 0] = np.argsort(-tie[2, 8])[5]
    assert agreeing_tokens(got, want, tie, near_tie=1e-3) == 6
    decisive = want.copy()
    decisive[0, 4, 0] = np.argsort(-tie[0, 4])[6]                 # far from the top 2
    with pytest.raises(AssertionError, match="token 4, MoE layer 0"):
        agreeing_tokens(decisive, want, tie, near_tie=1e-3)
