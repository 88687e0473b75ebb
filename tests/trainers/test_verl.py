"""verl's routed_experts from records, in NumPy: a batch built as verl builds it (left-padded
prompts, right-padded responses, attention mask), the layer axis verl's engines read, and
the rollout ids of verl's agent-loop runs.  tests/trainers/test_verl_dataproto.py runs
verl's own code on the same layout."""

from __future__ import annotations

import numpy as np
import pytest

from fd_routing_replay.errors import InvalidRolloutId
from fd_routing_replay.keys import parse_rollout_id, prefix_matches
from fd_routing_replay.trainers import (
    build_megatron_replay,
    pipeline_layer_ranges,
    to_verl_routed_experts,
)
from fd_routing_replay.trainers.verl import to_verl_token_routes
from fd_routing_replay.trainers.verl_batch import verl_rollout_id
from tests.trainers.records import make_record

MAX_PROMPT, MAX_RESPONSE = 8, 6


def verl_batch(prompt_lengths, response_lengths):
    """The attention mask as verl's agent loop pads a batch: each prompt left-padded to
    MAX_PROMPT, each response right-padded to MAX_RESPONSE, concatenated."""
    masks = []
    for p, r in zip(prompt_lengths, response_lengths, strict=True):
        prompt_mask = [0] * (MAX_PROMPT - p) + [1] * p
        response_mask = [1] * r + [0] * (MAX_RESPONSE - r)
        masks.append(prompt_mask + response_mask)
    return np.array(masks, dtype=np.int64)


def remove_padding(tensor, attention_mask):
    """The attended positions of each sample, in order, concatenated (what verl's
    left_right_2_no_padding keeps)."""
    return np.concatenate([tensor[i][attention_mask[i].astype(bool)]
                           for i in range(len(tensor))])


def expected_rows(record):
    """A record's rows as verl holds them: ``[T, L, K]``, 0 where a position is unrouted."""
    ids = record.ids[:, :record.metadata["num_tokens"]].astype(np.int16)
    ids[(record.ids[:, :record.metadata["num_tokens"]] == record.fill_value).any(axis=2)] = 0
    return ids.transpose(1, 0, 2)


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
    assert out.routed_experts.dtype == np.int16 and out.layers == layers   # verl's dtype
    # Padding is 0 (verl's zero tensor) and unrouted.
    assert (out.routed_experts[mask == 0] == 0).all() and not out.routed_mask[mask == 0].any()
    for i, record in enumerate(records):
        valid = out.routed_experts[i][mask[i] == 1]               # [P + R, L, K]
        assert len(valid) == record.num_tokens + 1
        assert (valid[:-1] == expected_rows(record)).all()
        assert (valid[-1] == 0).all()                             # last token: never forwarded
        routed = out.routed_mask[i][mask[i] == 1]
        assert not routed[-1] and routed[:-1].tolist() == \
            [not (i == 2 and t == 0) for t in range(record.num_tokens)]


def test_dense_layer_axis_only_for_verls_megatron_engine(seed):
    """verl's VeOmni engine matches layer slots to routers by fire order
    (transformer_impl.py:942): a decoder-layer axis with dense slots is refused by name,
    and without an engine named, too (the MoE-layer axis works on both engines)."""
    gen = np.random.default_rng(seed)
    record = make_record(gen, tokens=6, layers=(3, 4, 6), top_k=2)
    kwargs = dict(max_prompt_length=MAX_PROMPT, max_response_length=MAX_RESPONSE)
    with pytest.raises(ValueError, match=r"VeOmni engine 8 layer slots but only 3 routers"):
        to_verl_routed_experts([record], [3], num_layers=8, engine="veomni", **kwargs)
    with pytest.raises(ValueError, match=r"dense layers \[0, 1, 2, 5, 7\].*engine='megatron'"):
        to_verl_routed_experts([record], [3], num_layers=8, **kwargs)
    with pytest.raises(ValueError, match="engine must be one of"):
        to_verl_routed_experts([record], [3], engine="fsdp", **kwargs)
    moe_axis = to_verl_routed_experts([record], [3], engine="veomni", **kwargs)
    assert moe_axis.layers == (3, 4, 6) and moe_axis.routed_experts.shape[2] == 3

    out = to_verl_routed_experts([record], [3], num_layers=8, engine="megatron", dtype="int64",
                                 **kwargs)
    assert out.routed_experts.shape == (1, MAX_PROMPT + MAX_RESPONSE, 8, 2)
    assert out.layers == tuple(range(8))
    placed = out.routed_experts[0, MAX_PROMPT - 3:MAX_PROMPT - 3 + 6]
    assert (placed[:, [0, 1, 2, 5, 7]] == 0).all()
    assert (placed[:, [3, 4, 6]] == record.ids.transpose(1, 0, 2)).all()
    assert (placed[:, [3, 4, 6]] == moe_axis.routed_experts[0, MAX_PROMPT - 3:][:6]).all()
    with pytest.raises(ValueError, match="too small"):
        to_verl_routed_experts([record], [3], num_layers=6, engine="megatron", **kwargs)
    all_moe = make_record(gen, tokens=6, layers=(0, 1, 2), top_k=2)     # no dense slot to add
    assert to_verl_routed_experts([all_moe], [3], num_layers=3, engine="veomni",
                                  **kwargs).layers == (0, 1, 2)


def test_long_records_are_cut_and_missing_records_are_empty(seed):
    gen = np.random.default_rng(seed)
    long = make_record(gen, "exp_v:9:0", tokens=30)     # more rows than prompt + response
    out = to_verl_routed_experts([long, None], [4, 2], max_prompt_length=MAX_PROMPT,
                                 max_response_length=MAX_RESPONSE)
    assert out.routed_mask[0, MAX_PROMPT - 4:].all() and not out.routed_mask[0, :4].any()
    assert (out.routed_experts[0, -1] == long.ids[:, MAX_PROMPT + MAX_RESPONSE - 4 - 1]).all()
    assert not out.routed_mask[1].any() and (out.routed_experts[1] == 0).all()
    with pytest.raises(ValueError, match="does not fit"):
        to_verl_routed_experts([long], [9], max_prompt_length=MAX_PROMPT,
                               max_response_length=MAX_RESPONSE)
    with pytest.raises(ValueError, match="no record"):
        to_verl_routed_experts([None], [1], max_prompt_length=MAX_PROMPT,
                               max_response_length=MAX_RESPONSE)


def test_dtype_must_hold_the_expert_ids(seed):
    gen = np.random.default_rng(seed)
    record = make_record(gen, tokens=5, num_experts=200)
    with pytest.raises(ValueError, match="int8 cannot hold expert ids up to 199"):
        to_verl_routed_experts([record], [2], max_prompt_length=4, max_response_length=4,
                               dtype="int8")
    assert to_verl_routed_experts([record], [2], max_prompt_length=4, max_response_length=4,
                                  dtype="uint8").routed_experts.dtype == np.uint8


def test_token_routes_are_what_verls_agent_loop_places(seed):
    """to_verl_token_routes is what a verl rollout server returns as routed_experts; verl's
    agent loop puts it at the first real prompt token of a zero tensor
    (_agent_loop_postprocess) — which must give to_verl_routed_experts's batch."""
    gen = np.random.default_rng(seed)
    prompts, responses = [5, 2, 8], [4, 6, 1]
    records = [make_record(gen, f"exp_t:{i}:0", tokens=p + r - 1, layers=(1, 2), top_k=3,
                           num_experts=16, unrouted=(1,) if i == 1 else ())
               for i, (p, r) in enumerate(zip(prompts, responses, strict=True))]
    batch = to_verl_routed_experts(records, prompts, max_prompt_length=MAX_PROMPT,
                                   max_response_length=MAX_RESPONSE)
    total = MAX_PROMPT + MAX_RESPONSE
    for i, (record, prompt) in enumerate(zip(records, prompts, strict=True)):
        engine_routes = to_verl_token_routes(record)
        assert engine_routes.dtype == np.int16 and engine_routes.shape == (record.num_tokens, 2, 3)
        placed = np.zeros((total, 2, 3), dtype=np.int16)         # verl's placement
        start = MAX_PROMPT - prompt
        end = min(start + len(engine_routes), total)
        placed[start:end] = engine_routes[:end - start]
        assert (placed == batch.routed_experts[i]).all()
    longer = to_verl_token_routes(records[0], num_tokens=records[0].num_tokens + 2)
    assert (longer[-2:] == 0).all() and (longer[:-2] == expected_rows(records[0])).all()
    assert to_verl_token_routes(records[0], num_tokens=0).shape == (0, 2, 3)
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        to_verl_token_routes(records[0], num_tokens=-1)


def test_verl_consumption_equals_the_megatron_adapter(seed):
    """verl's Megatron engine strips the padding by the attention mask, then router i of a
    pipeline stage takes its layer's slot.  For an all-MoE model that must be what
    build_megatron_replay hands the same routers, at every routed position."""
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


def test_verl_rollout_ids_name_each_run_and_turn():
    rid = verl_rollout_id("grpo7", "3f2a-uid", "9c1e0b7d", turn=2)
    assert rid == "grpo7_3f2a-uid:9c1e0b7d:2:0"
    parsed = parse_rollout_id(rid)
    assert (parsed.base, parsed.turn, parsed.segment) == ("grpo7_3f2a-uid:9c1e0b7d", 2, 0)
    assert prefix_matches(rid, "grpo7_3f2a-uid")           # a prompt's samples, by prefix
    assert not prefix_matches(rid, "grpo7_3f2a")
    assert verl_rollout_id("grpo7", "u", "r", segment=1).endswith(":r:0:1")
    with pytest.raises(ValueError, match="full_determinism"):
        verl_rollout_id("grpo7", "u", "det-3")            # shared by several samples
    assert verl_rollout_id("grpo7", "u", "det-3x") == "grpo7_u:det-3x:0:0"
    for bad in (dict(experiment=""), dict(uid=None), dict(turn=-1), dict(segment=True)):
        args = dict(experiment="e", uid="u", request_id="r", turn=0, segment=0) | bad
        with pytest.raises(ValueError):
            verl_rollout_id(args.pop("experiment"), args.pop("uid"), args.pop("request_id"),
                            **args)
    with pytest.raises(InvalidRolloutId, match="whitespace"):
        verl_rollout_id("grpo 7", "u", "r")


def test_one_record_has_one_convention_per_reader_for_its_unrouted_positions(seed):
    """Every layout of one record agrees at every position: the recorded ids where routed;
    where not (an interior unrouted position, the last token) the placeholders ``0..K-1``
    wherever the reader replays every row (Megatron-Core, slime/SGLang, verl's Megatron
    engine), and zeros — a duplicate, routed natively — for verl's VeOmni engine."""
    from fd_routing_replay.trainers import routes, to_sglang_routed_experts

    gen = np.random.default_rng(seed)
    layers, prompt, response = (1, 2, 4), 5, 4
    record = make_record(gen, tokens=prompt + response - 1, layers=layers, top_k=3,
                         num_experts=8, unrouted=(2, 6))
    kwargs = dict(max_prompt_length=MAX_PROMPT, max_response_length=MAX_RESPONSE)
    mask = verl_batch([prompt], [response])
    verl_megatron = to_verl_routed_experts([record], [prompt], engine="megatron", **kwargs)
    verl_veomni = to_verl_routed_experts([record], [prompt], engine="veomni", **kwargs)
    verl_default = to_verl_routed_experts([record], [prompt], **kwargs)
    as_megatron = remove_padding(verl_megatron.routed_experts, mask).transpose(1, 0, 2)
    as_veomni = remove_padding(verl_veomni.routed_experts, mask).transpose(1, 0, 2)
    megatron = build_megatron_replay([record], layers)
    sglang = to_sglang_routed_experts(record, num_tokens=prompt + response)
    ids, valid = routes(record, length=prompt + response)
    placeholders = np.arange(3)
    unrouted = np.array([t in (2, 6, prompt + response - 1) for t in range(prompt + response)])
    for row, layer in enumerate(layers):
        assert (valid[row] == ~unrouted).all()
        assert (megatron.mask[row] == valid[row]).all()
        assert (remove_padding(verl_megatron.routed_mask, mask) == valid[row]).all()
        for layout in (megatron.topk[row], sglang[:, layer], as_megatron[row]):
            assert (layout == ids[row]).all(), layer
        assert (ids[row][unrouted] == placeholders).all()
        assert (as_veomni[row][valid[row]] == ids[row][valid[row]]).all()
        assert (as_veomni[row][unrouted] == 0).all()
    assert (verl_default.routed_experts == verl_veomni.routed_experts).all()
    assert (to_verl_token_routes(record, engine="megatron").transpose(1, 0, 2)
            == ids[:, :-1]).all()
