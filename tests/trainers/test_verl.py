"""verl's routed_experts: a batch built as verl builds it (left-padded prompts, right-padded
responses, attention mask), then consumed as verl's Megatron path consumes it."""

from __future__ import annotations

import numpy as np
import pytest

from fd_routing_replay.trainers import (
    build_megatron_replay,
    pipeline_layer_ranges,
    to_verl_routed_experts,
)
from tests.trainers.records import make_record

MAX_PROMPT, MAX_RESPONSE = 8, 6


def verl_batch(prompt_lengths, response_lengths):
    """input positions and attention mask as verl's agent loop pads them: each prompt
    left-padded to MAX_PROMPT, each response right-padded to MAX_RESPONSE, concatenated."""
    masks = []
    for p, r in zip(prompt_lengths, response_lengths, strict=True):
        prompt_mask = [0] * (MAX_PROMPT - p) + [1] * p
        response_mask = [1] * r + [0] * (MAX_RESPONSE - r)
        masks.append(prompt_mask + response_mask)
    return np.array(masks, dtype=np.int64)


def remove_padding(tensor, attention_mask):
    """verl's preprocess_packed_seqs, reduced to what matters here: the attended positions
    of each sample, in order, concatenated."""
    return np.concatenate([tensor[i][attention_mask[i].astype(bool)]
                           for i in range(len(tensor))])


def test_layout_matches_a_verl_batch(seed):
    gen = np.random.default_rng(seed)
    prompts, responses = [3, 8, 5, 1], [4, 6, 1, 6]
    layers = (1, 3, 4)
    records = [make_record(gen, f"exp_v:{i}:0", tokens=p + r - 1, layers=layers, top_k=2,
                           unrouted=(0,) if i == 2 else ())
               for i, (p, r) in enumerate(zip(prompts, responses, strict=True))]
    out = to_verl_routed_experts(records, prompts, max_prompt_length=MAX_PROMPT,
                                 max_response_length=MAX_RESPONSE)
    mask = verl_batch(prompts, responses)
    assert out.routed_experts.shape == (4, MAX_PROMPT + MAX_RESPONSE, 3, 2)
    assert out.routed_experts.dtype == np.int32 and out.layers == layers
    # Padding holds the placeholder experts 0..K-1 and is unrouted.
    assert (out.routed_experts[mask == 0] == [0, 1]).all() and not out.routed_mask[mask == 0].any()
    for i, record in enumerate(records):
        valid = out.routed_experts[i][mask[i] == 1]               # [P + R, L, K]
        assert len(valid) == record.num_tokens + 1
        for t in range(record.num_tokens):
            expected = record.ids[:, t].astype(np.int32)
            if (record.ids[:, t] == record.fill_value).any():
                expected = np.broadcast_to(np.arange(2, dtype=np.int32), expected.shape)
            assert (valid[t] == expected).all()
        assert (valid[-1] == [0, 1]).all()                        # last token: never forwarded
        routed = out.routed_mask[i][mask[i] == 1]
        assert not routed[-1] and routed[:-1].tolist() == \
            [not (i == 2 and t == 0) for t in range(record.num_tokens)]


def test_dense_layers_are_zero_on_the_decoder_layer_axis(seed):
    gen = np.random.default_rng(seed)
    record = make_record(gen, tokens=6, layers=(3, 4, 6), top_k=2)
    out = to_verl_routed_experts([record], [3], max_prompt_length=MAX_PROMPT,
                                 max_response_length=MAX_RESPONSE, num_layers=8, dtype="int64")
    assert out.routed_experts.shape == (1, MAX_PROMPT + MAX_RESPONSE, 8, 2)
    assert out.layers == tuple(range(8))
    placed = out.routed_experts[0, MAX_PROMPT - 3:MAX_PROMPT - 3 + 6]
    assert (placed[:, [0, 1, 2, 5, 7]] == 0).all()
    assert (placed[:, [3, 4, 6]] == record.ids.transpose(1, 0, 2)).all()
    with pytest.raises(ValueError, match="too small"):
        to_verl_routed_experts([record], [3], max_prompt_length=MAX_PROMPT,
                               max_response_length=MAX_RESPONSE, num_layers=6)


def test_long_records_are_cut_and_missing_records_are_empty(seed):
    gen = np.random.default_rng(seed)
    long = make_record(gen, "exp_v:9:0", tokens=30)     # more rows than prompt + response
    out = to_verl_routed_experts([long, None], [4, 2], max_prompt_length=MAX_PROMPT,
                                 max_response_length=MAX_RESPONSE)
    assert out.routed_mask[0, MAX_PROMPT - 4:].all() and not out.routed_mask[0, :4].any()
    assert (out.routed_experts[0, -1] == long.ids[:, MAX_PROMPT + MAX_RESPONSE - 4 - 1]).all()
    assert not out.routed_mask[1].any() and (out.routed_experts[1] == np.arange(2)).all()
    with pytest.raises(ValueError, match="does not fit"):
        to_verl_routed_experts([long], [9], max_prompt_length=MAX_PROMPT,
                               max_response_length=MAX_RESPONSE)
    with pytest.raises(ValueError, match="no record"):
        to_verl_routed_experts([None], [1], max_prompt_length=MAX_PROMPT,
                               max_response_length=MAX_RESPONSE)


def test_verl_consumption_equals_the_megatron_adapter(seed):
    """verl's set_router_replay_data: remove padding by the attention mask, then router i of
    a pipeline stage takes layer i + the stage's first decoder layer.  For an all-MoE model
    that must be what build_megatron_replay hands the same routers."""
    gen = np.random.default_rng(seed)
    prompts, responses = [5, 2, 7], [3, 6, 2]
    layers = tuple(range(4))                               # all-MoE, 4 decoder layers
    records = [make_record(gen, f"exp_w:{i}:0", tokens=p + r - 1, layers=layers)
               for i, (p, r) in enumerate(zip(prompts, responses, strict=True))]
    out = to_verl_routed_experts(records, prompts, max_prompt_length=MAX_PROMPT,
                                 max_response_length=MAX_RESPONSE, dtype="int64")
    mask = verl_batch(prompts, responses)
    packed = remove_padding(out.routed_experts, mask)      # [T_all, L, K]
    packed_routed = remove_padding(out.routed_mask, mask)
    per_layer = packed.transpose(1, 0, 2)                  # [L, T_all, K]
    for pp_rank in range(2):
        (span,) = pipeline_layer_ranges(4, 2, pp_rank)
        stage_layers = tuple(span)
        ours = build_megatron_replay(records, stage_layers)
        for i, _router_layer in enumerate(stage_layers):
            verl_ids = per_layer[i + span.start]
            routed = ours.mask[i]
            assert (routed == packed_routed).all()
            assert (ours.topk[i][routed] == verl_ids[routed]).all()


def verl_replay_routing_map(top_indices, num_experts):
    """What verl's replay makes of a router's ids (router_replay_patch.py,
    ``_patched_topk_routing_with_score_function``, REPLAY_FORWARD): the scores gathered at
    ``top_indices``, scattered into ``routing_map = zeros[T, E].scatter(1, top_indices, 1)``.
    Returns the routing map: the experts each token is dispatched to."""
    routing_map = np.zeros((len(top_indices), num_experts), dtype=bool)
    np.put_along_axis(routing_map, top_indices, True, axis=1)
    return routing_map


@pytest.mark.parametrize("num_layers", [None, 6])
def test_every_token_verl_replays_goes_to_k_distinct_experts(seed, num_layers):
    """The tokens that reach verl's routers (the attention mask's, padding stripped) —
    the last response token and unrouted positions included — are dispatched to exactly
    K experts each: recorded routes where there are some, the placeholders 0..K-1
    elsewhere; never [0, 0, ...] (one expert)."""
    gen = np.random.default_rng(seed)
    top_k, num_experts = 4, 16
    prompts, responses = [6, 2, 8, 4], [5, 6, 3, 1]
    layers = (1, 2, 4)
    records = [make_record(gen, f"exp_u:{i}:0", tokens=p + r - 1, layers=layers, top_k=top_k,
                           num_experts=num_experts,
                           unrouted=tuple(int(u) for u in gen.choice(p + r - 1, size=min(2, p + r - 1),
                                                                      replace=False)))
               for i, (p, r) in enumerate(zip(prompts, responses, strict=True))]
    records[1] = None                                      # a sample the engine did not record
    out = to_verl_routed_experts(records, prompts, max_prompt_length=MAX_PROMPT,
                                 max_response_length=MAX_RESPONSE, num_layers=num_layers,
                                 dtype="int64")
    mask = verl_batch(prompts, responses)
    packed = remove_padding(out.routed_experts, mask)     # [T_all, L_axis, K]
    packed_routed = remove_padding(out.routed_mask, mask)
    moe_rows = list(range(len(layers))) if num_layers is None else list(layers)
    placeholder = np.arange(top_k)
    for row in moe_rows:
        ids = packed[:, row]
        assert ((ids >= 0) & (ids < num_experts)).all()
        routing_map = verl_replay_routing_map(ids, num_experts)
        assert (routing_map.sum(axis=1) == top_k).all()
        assert (ids[~packed_routed] == placeholder).all()
    # the recorded routes themselves are untouched
    for i, record in enumerate(records):
        if record is None:
            continue
        start = MAX_PROMPT - prompts[i]
        placed = out.routed_experts[i, start:start + record.num_tokens][:, moe_rows]
        routed = ~(record.ids == record.fill_value).any(axis=2).any(axis=0)
        assert (placed[routed] == record.ids.transpose(1, 0, 2)[routed]).all()
