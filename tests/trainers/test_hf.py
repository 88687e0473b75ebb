"""Routing replay into transformers' own MoE modeling code (CPU, tiny random configs).

With replay on, the experts every MoE block dispatches to are the record's at every
(token, layer) with a recorded route — checked against the record with NumPy, for packed,
padded and CP/SP-sliced batches — the weights are the family's normalisation of the live
router's logits at those experts, and the backward reaches the router weights.
"""

from __future__ import annotations

import importlib
import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fd_routing_replay.codec import RoutingRecord  # noqa: E402
from fd_routing_replay.trainers.hf.families import FAMILIES, TESTED_TRANSFORMERS  # noqa: E402
from fd_routing_replay.trainers.hf.patch import (  # noqa: E402
    RoutingReplay,
    moe_layers,
    moe_routers,
    replay_routing,
)
from fd_routing_replay.trainers.hf.routes import (  # noqa: E402
    HFRoutes,
    packed_routes,
    padded_routes,
)
from tests.trainers.hf_models import (  # noqa: E402
    CONFIGS,
    VOCAB,
    capture,
    reference_weights,
    tiny_model,
)
from tests.trainers.records import make_record  # noqa: E402

FAMILY_TYPES = [family.model_type for family in FAMILIES]
_MODELS: dict[str, object] = {}


def model_of(model_type: str):
    """One tiny model per family for the module (state is reset by each test's zero_grad)."""
    if model_type not in _MODELS:
        _MODELS[model_type] = tiny_model(model_type)
    model = _MODELS[model_type]
    model.zero_grad(set_to_none=True)
    return model


def shape_of(model) -> tuple[tuple[int, ...], int, int]:
    routers = moe_routers(model)
    return (tuple(r.layer for r in routers), int(routers[0].module.top_k),
            int(routers[0].module.num_experts))


def records_for(model, gen, lengths, prefix="exp_hf"):
    layers, top_k, experts = shape_of(model)
    return [make_record(gen, f"{prefix}:{i}:0", tokens=n - 1, layers=layers, top_k=top_k,
                        num_experts=experts) for i, n in enumerate(lengths)]


def test_every_family_is_in_the_pinned_transformers():
    assert set(FAMILY_TYPES) == set(CONFIGS) and len(FAMILIES) >= 6
    assert transformers.__version__ == TESTED_TRANSFORMERS, \
        "setup.cfg pins transformers for the trainer tier: update TESTED_TRANSFORMERS with it"


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.model_type)
def test_patched_forward_signatures_are_the_recorded_ones(family):
    module = importlib.import_module(family.module)
    for class_name, recorded in family.signatures:
        live = str(inspect.signature(getattr(module, class_name).forward))
        assert live == recorded, (f"{family.name}: {class_name}.forward is now {live}, the "
                                  f"replay was written for {recorded}: re-read the modeling "
                                  "code and update families.py")


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_padded_batch_dispatches_the_recorded_experts(model_type):
    model = model_of(model_type)
    layers, top_k, _ = shape_of(model)
    gen = np.random.default_rng(FAMILY_TYPES.index(model_type))
    width, lengths = 9, [9, 6, 4]
    records = records_for(model, gen, lengths)
    mask = np.zeros((3, width), dtype=np.int64)
    mask[0, :] = 1
    mask[1, :6] = 1                      # right padding
    mask[2, width - 4:] = 1              # left padding
    input_ids = torch.from_numpy(gen.integers(0, VOCAB, (3, width)))
    seen = capture(model)
    try:
        with replay_routing(model, padded_routes(records, mask)) as replay:
            out = model(input_ids=input_ids, attention_mask=torch.from_numpy(mask),
                        labels=input_ids)
            out.loss.backward()
    finally:
        seen.remove()
    assert all(replay.calls[layer] == 1 for layer in layers)
    for row, layer in enumerate(layers):
        got = seen.last(layer).reshape(3, width, top_k)
        live = seen.live_ids[layer][-1].reshape(3, width, top_k)
        for b, record in enumerate(records):
            real = np.flatnonzero(mask[b])
            routed = real[:record.num_tokens]
            assert (got[b, routed] == record.ids[row].astype(np.int64)).all(), (layer, b)
            unrouted = np.setdiff1d(np.arange(width), routed)   # padding and the last token
            assert (got[b, unrouted] == live[b, unrouted]).all()
        expected = reference_weights(model_type, model.config, seen.logits[layer][-1],
                                     seen.last(layer))
        np.testing.assert_allclose(seen.weights[layer][-1], expected, rtol=1e-5, atol=1e-6)
    for router in moe_routers(model):
        assert router.module.weight.grad is not None
        assert router.module.weight.grad.abs().sum() > 0, router.name


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_without_replay_the_routes_differ_from_a_random_record(model_type):
    model = model_of(model_type)
    layers, top_k, _ = shape_of(model)
    gen = np.random.default_rng(7)
    record = records_for(model, gen, [24])[0]
    seen = capture(model)
    try:
        with torch.no_grad():
            model(input_ids=torch.from_numpy(gen.integers(0, VOCAB, (1, 24))))
    finally:
        seen.remove()
    live = np.stack([np.sort(seen.last(layer)[:23], axis=1) for layer in layers])
    assert (live != np.sort(record.ids.astype(np.int64), axis=2)).any(axis=2).mean() > 0.2


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_replaying_the_live_routes_reproduces_the_live_forward(model_type):
    """The recomputed weights equal transformers' own: replaying what the model chose
    changes nothing (each family's normalisation, bias and group limit included)."""
    model = model_of(model_type)
    layers, _, _ = shape_of(model)
    input_ids = torch.from_numpy(np.random.default_rng(3).integers(0, VOCAB, (2, 7)))
    seen = capture(model)
    try:
        with torch.no_grad():
            live = model(input_ids=input_ids).logits
            live_weights = {layer: seen.weights[layer][-1] for layer in layers}
            chosen = np.stack([seen.last(layer) for layer in layers])
            with replay_routing(model, chosen):
                again = model(input_ids=input_ids).logits
    finally:
        seen.remove()
    torch.testing.assert_close(again, live, rtol=1e-5, atol=1e-6)
    for layer in layers:
        np.testing.assert_allclose(seen.weights[layer][-1], live_weights[layer], rtol=1e-5,
                                   atol=1e-7)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_bf16_weights_keep_the_routers_dtype(model_type):
    """In bf16 the weights are recomputed as the router computes them (float32 softmax or
    sigmoid, then the router's own output dtype): replaying the live choice is exact."""
    model = tiny_model(model_type, seed=4).to(torch.bfloat16)
    layers, _, _ = shape_of(model)
    input_ids = torch.from_numpy(np.random.default_rng(15).integers(0, VOCAB, (1, 9)))
    seen = capture(model)
    try:
        with torch.no_grad():
            live = model(input_ids=input_ids).logits
            chosen = np.stack([seen.last(layer) for layer in layers])
            with replay_routing(model, chosen):
                again = model(input_ids=input_ids).logits
    finally:
        seen.remove()
    assert torch.equal(again, live)


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_packed_row_dispatches_each_sequence_its_record(model_type):
    model = model_of(model_type)
    layers, top_k, _ = shape_of(model)
    gen = np.random.default_rng(11)
    lengths = [5, 8, 3]
    records = records_for(model, gen, lengths)
    position_ids = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths]))[None]
    input_ids = torch.from_numpy(gen.integers(0, VOCAB, (1, sum(lengths))))
    routes = packed_routes(records, position_ids=position_ids)
    assert routes.num_tokens == sum(lengths)
    seen = capture(model)
    try:
        with replay_routing(model, routes):
            out = model(input_ids=input_ids, position_ids=position_ids, labels=input_ids)
            out.loss.backward()
    finally:
        seen.remove()
    starts = np.cumsum([0] + lengths)
    for row, layer in enumerate(layers):
        got = seen.last(layer)
        for record, start in zip(records, starts[:-1], strict=True):
            span = slice(start, start + record.num_tokens)
            assert (got[span] == record.ids[row].astype(np.int64)).all(), (layer, start)
    assert all(r.module.weight.grad.abs().sum() > 0 for r in moe_routers(model))


def test_context_and_sequence_parallel_slices_replay_the_ranks_tokens():
    """A rank's share of a packed row: CP chunks ``r`` and ``2cp-1-r`` of each sequence,
    then the SP rank's contiguous share; the model forwards only those tokens."""
    model = model_of("qwen3_moe")
    layers, _, _ = shape_of(model)
    gen = np.random.default_rng(5)
    lengths = [8, 12]                                  # divisible by 2 * cp = 4
    records = records_for(model, gen, lengths)
    full_ids = np.concatenate([
        np.concatenate([r.ids.astype(np.int64), np.full((len(layers), 1, 2), -1)], axis=1)
        for r in records], axis=1)                      # [L, 20, K], -1 at the last tokens
    for cp_rank in range(2):
        for sp_rank in range(2):
            keep = []
            offset = 0
            for n in lengths:                            # chunks r and 3 - r of 4
                chunk = n // 4
                keep += [offset + i for c in (cp_rank, 3 - cp_rank)
                         for i in range(c * chunk, (c + 1) * chunk)]
                offset += n
            keep = np.asarray(keep)
            share = keep[sp_rank * len(keep) // 2:(sp_rank + 1) * len(keep) // 2]
            routes = packed_routes(records, cp_size=2, cp_rank=cp_rank, sp_size=2,
                                   sp_rank=sp_rank)
            assert routes.num_tokens == share.size
            seen = capture(model)
            try:
                with torch.no_grad(), replay_routing(model, routes):
                    model(input_ids=torch.from_numpy(gen.integers(0, VOCAB, (1, share.size))))
            finally:
                seen.remove()
            for row, layer in enumerate(layers):
                expected, got = full_ids[row, share], seen.last(layer)
                routed = (expected >= 0).all(axis=1)
                assert routed.sum() == share.size - np.isin(share, [7, 19]).sum()
                assert (got[routed] == expected[routed]).all(), (cp_rank, sp_rank, layer)


def test_dense_first_layers_are_skipped_through_the_layer_map():
    model = model_of("deepseek_v3")                     # first_k_dense_replace = 1
    assert moe_layers(model) == (1, 2)
    gen = np.random.default_rng(9)
    record = records_for(model, gen, [6])[0]
    assert record.layer_map == (1, 2)
    with replay_routing(model, record) as replay, torch.no_grad():
        model(input_ids=torch.from_numpy(gen.integers(0, VOCAB, (1, 6))))
    assert replay.calls == {1: 1, 2: 1}
    # A record written without a layer map counts rows from 0: same count, wrong layers.
    wrong = make_record(gen, tokens=5, layers=(0, 1), top_k=2, num_experts=8)
    with pytest.raises(ValueError, match=r"decoder layers \[0, 1\].*decoder layers \[1, 2\]"):
        RoutingReplay(model, wrong)


def test_a_wrong_layer_count_is_refused_naming_both():
    model = model_of("mixtral")
    gen = np.random.default_rng(2)
    too_many = make_record(gen, tokens=5, layers=(0, 1, 2, 3), top_k=2, num_experts=4)
    with pytest.raises(ValueError, match="4 MoE layers.*3 MoE blocks"):
        RoutingReplay(model, too_many)
    with pytest.raises(ValueError, match="2 MoE layers.*3 MoE blocks"):
        RoutingReplay(model, np.zeros((2, 6, 2), dtype=np.int64))


def test_a_wrong_token_count_is_refused_naming_both():
    model = model_of("qwen2_moe")
    record = records_for(model, np.random.default_rng(4), [8])[0]      # 8 tokens
    with pytest.raises(ValueError, match="routes 10 tokens.*routes hold 8"), torch.no_grad(), \
            replay_routing(model, record):
        model(input_ids=torch.zeros((1, 10), dtype=torch.long))
    with pytest.raises(ValueError, match="has 7 routed positions.*has 5 tokens, so 4 are"):
        packed_routes([record], seq_lens=[5])
    with pytest.raises(ValueError, match="top_k 3.*top_k 2"):
        RoutingReplay(model, np.zeros((3, 8, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="outside the router's 8 experts"):
        RoutingReplay(model, np.full((3, 8, 2), 9, dtype=np.int64))


def test_gradient_checkpointing_recompute_replays_too():
    model = tiny_model("qwen3_moe", seed=1)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    layers, _, _ = shape_of(model)
    gen = np.random.default_rng(6)
    record = records_for(model, gen, [10])[0]
    input_ids = torch.from_numpy(gen.integers(0, VOCAB, (1, 10)))
    seen = capture(model)
    try:
        with replay_routing(model, record) as replay:
            model(input_ids=input_ids, labels=input_ids).loss.backward()
    finally:
        seen.remove()
    for row, layer in enumerate(layers):
        assert replay.calls[layer] == 2 and len(seen.ids[layer]) == 2   # forward + recompute
        for ids in seen.ids[layer]:
            assert (ids[:9] == record.ids[row].astype(np.int64)).all()
    assert all(r.module.weight.grad.abs().sum() > 0 for r in moe_routers(model))


def test_reader_arrays_with_fill_values_and_hooks_come_off():
    model = model_of("ernie4_5_moe")
    layers, _, _ = shape_of(model)
    gen = np.random.default_rng(8)
    record = make_record(gen, tokens=6, layers=layers, top_k=2, num_experts=8, unrouted=(2,))
    input_ids = torch.from_numpy(gen.integers(0, VOCAB, (1, 6)))
    seen = capture(model)
    try:
        with torch.no_grad():
            with replay_routing(model, record.ids):          # uint8, 255 = no route
                model(input_ids=input_ids)
            model(input_ids=input_ids)                       # hooks removed: live again
    finally:
        seen.remove()
    for row, layer in enumerate(layers):
        replayed, live = seen.ids[layer]
        routed = np.arange(6) != 2
        assert (replayed[routed] == record.ids[row][routed]).all()
        assert (replayed[2] == seen.live_ids[layer][0][2]).all()
        assert (live == seen.live_ids[layer][1]).all()
        assert (replayed[routed] != live[routed]).any()


def test_empty_batch_and_set_routes_across_micro_batches():
    model = model_of("gpt_oss")
    layers, _, _ = shape_of(model)
    empty = packed_routes([], layers=layers, top_k=2, num_experts=4)
    assert empty.num_tokens == 0 and empty.layers == layers
    router = moe_routers(model)[0]
    replay = RoutingReplay(model, empty).install()
    try:
        _, weights, ids = router.module(torch.zeros((0, 32)))    # a rank with no tokens
        assert ids.shape == (0, 2) and weights.shape == (0, 2)
        gen = np.random.default_rng(10)
        for n in (5, 9):                                         # two micro-batches
            record = records_for(model, gen, [n])[0]
            replay.set_routes(record)
            seen = capture(model)
            try:
                with torch.no_grad():
                    model(input_ids=torch.from_numpy(gen.integers(0, VOCAB, (1, n))))
            finally:
                seen.remove()
            assert all((seen.last(layer)[:n - 1] == record.ids[row]).all()
                       for row, layer in enumerate(layers))
    finally:
        replay.remove()


def test_a_block_that_skips_its_router_is_refused(monkeypatch):
    model = model_of("mixtral")
    block = model.model.layers[1].mlp
    monkeypatch.setattr(block, "forward", lambda hidden_states: torch.zeros_like(hidden_states))
    record = records_for(model, np.random.default_rng(12), [5])[0]
    with pytest.raises(RuntimeError, match=r"decoder layers \[1\] did not run"), \
            torch.no_grad(), replay_routing(model, record):
        model(input_ids=torch.zeros((1, 5), dtype=torch.long))


def test_routes_builders_check_their_inputs():
    gen = np.random.default_rng(13)
    records = [make_record(gen, f"exp_b:{i}:0", tokens=4, layers=(1, 2)) for i in range(2)]
    assert packed_routes(records, cu_seqlens=[0, 5, 10]).num_tokens == 10
    assert packed_routes([records[0], None], seq_lens=[5, 3], num_tokens=12).valid[:, 4:].sum() == 0
    with pytest.raises(ValueError, match="2 sequences but 1 records"):
        packed_routes(records[:1], position_ids=[0, 1, 2, 3, 4, 0, 1])
    with pytest.raises(ValueError, match="3 rows but 2 records"):
        padded_routes(records, np.ones((3, 5)))
    other = make_record(gen, tokens=4, layers=(0, 1))
    with pytest.raises(ValueError, match="different layer maps"):
        packed_routes([records[0], other])
    routes = padded_routes(records, np.ones((2, 6)), sp_size=2, sp_rank=1,  # columns 3..5
                           exact_length=False)                              # 4 rows, 6 tokens
    assert isinstance(routes, HFRoutes) and routes.num_tokens == 6
    assert (routes.ids[:, 0] == records[0].ids[:, 3]).all()
    assert (routes.ids[:, 3] == records[1].ids[:, 3]).all()
    assert routes.valid.tolist() == [[True, False, False, True, False, False]] * 2


@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`:UserWarning")
@pytest.mark.parametrize("flavour", ["fsdp1", "fsdp2"])
def test_plain_fsdp_on_one_cpu_rank(flavour, tmp_path):
    """FSDP (1 and 2) wrap the decoder layers; the routers inside still replay."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    model = tiny_model("qwen3_moe", layers=2, seed=2)
    layer_cls = type(model.model.layers[0])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        if flavour == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy
            wrapped = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({layer_cls}),
                                               device_id=torch.device("cpu"), use_orig_params=True)
        else:
            from torch.distributed.fsdp import fully_shard
            for layer in model.model.layers:
                fully_shard(layer)
            wrapped = fully_shard(model)
        gen = np.random.default_rng(14)
        record = records_for(model, gen, [7])[0]
        seen = capture(wrapped)
        input_ids = torch.from_numpy(gen.integers(0, VOCAB, (1, 7)))
        try:
            with replay_routing(wrapped, record) as replay:
                wrapped(input_ids=input_ids, labels=input_ids).loss.backward()
        finally:
            seen.remove()
        assert replay.layers == (1,)                       # layer 0 is dense
        assert (seen.last(1)[:6] == record.ids[0]).all()
        grad = moe_routers(wrapped)[0].module.weight.grad
        grad = grad.to_local() if hasattr(grad, "to_local") else grad
        assert grad.abs().sum() > 0
    finally:
        dist.destroy_process_group()


def test_a_record_must_route_exactly_its_sequence_minus_the_last_token():
    """A record holds ``tokens - 1`` rows.  One shorter than its sequence (another, shorter
    sample's record) or one row too long is refused by default, packed and padded alike;
    ``exact_length=False`` cuts a longer one and leaves a shorter one's end unrouted."""
    gen = np.random.default_rng(14)
    record = make_record(gen, "exp_c:0:0", tokens=6, layers=(1, 2))   # a 7-token sequence
    assert packed_routes([record], seq_lens=[7]).valid.all(axis=0).sum() == 6
    for tokens in (6, 8, 12):                         # one row too long, one and 5 too short
        with pytest.raises(ValueError, match=rf"6 routed positions.*{tokens} tokens, so "
                                             rf"{tokens - 1} are expected.*exact_length=False"):
            packed_routes([record], seq_lens=[tokens])
        with pytest.raises(ValueError, match=rf"6 routed positions.*{tokens} tokens"):
            padded_routes([record], np.ones((1, tokens)))
    short = packed_routes([record], seq_lens=[12], exact_length=False)
    assert short.valid[:, :6].all() and not short.valid[:, 6:].any()
    assert (short.ids[:, :6] == record.ids.astype(np.int64)).all()
    cut = padded_routes([record], np.ones((1, 4)), exact_length=False)
    assert cut.valid.all() and (cut.ids == record.ids[:, :4].astype(np.int64)).all()


def test_a_record_of_another_expert_count_is_refused():
    """Ids below the model's router count are not enough: an 8-expert record replayed into a
    16-expert model (or the reverse) is another model's routing."""
    model = model_of("qwen3_moe")
    layers, top_k, experts = shape_of(model)
    gen = np.random.default_rng(16)
    for recorded in (experts // 2, experts * 2):
        ids = make_record(gen, tokens=5, layers=layers, top_k=top_k,
                          num_experts=min(recorded, experts)).ids   # in range of both
        record = RoutingRecord("exp_d:0:0", ids, recorded, layers=layers)
        with pytest.raises(ValueError, match=rf"recorded with {recorded} experts.*has "
                                             rf"{experts}"):
            RoutingReplay(model, record)
    RoutingReplay(model, records_for(model, gen, [6])[0])   # the model's own count passes
