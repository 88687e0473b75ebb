"""Megatron-Core's own router replays the adapter's output.

The real-thing tests run Megatron-Core's own ``TopKRouter.routing`` with its
``RouterReplay`` in replay mode on the adapter's tensors.  ``TopKRouter.forward`` cannot run
without CUDA: its ``gating`` moves CPU weights to ``torch.cuda.current_device()``
(megatron/core/transformer/moe/router.py:88-90 in megatron-core 0.16.1) — shown by
``test_router_forward_needs_cuda`` — so the tests feed ``routing`` the logits ``gating``
would produce (``input @ weight.T``); everything from there on (top-k with replay, scores
gathered at the replayed ids, the routing map the dispatcher uses) is Megatron's code.
"""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest

from fd_routing_replay.codec import RoutingRecord
from fd_routing_replay.trainers import (
    build_megatron_replay,
    compare_routing,
    context_parallel_indices,
    pipeline_layer_ranges,
)
from tests.trainers.records import make_record

LAYERS = (1, 2, 3)          # a 4-layer model: decoder layer 0 dense, 1..3 MoE


torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    from megatron.core.transformer.transformer_config import TransformerConfig

E, K, H = 8, 2, 16


def _config(**extra):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerConfig(num_layers=4, hidden_size=H, num_attention_heads=2,
                                 num_moe_experts=E, moe_router_topk=K,
                                 moe_enable_routing_replay=True,
                                 moe_router_load_balancing_type="none",
                                 use_cpu_initialization=True, **extra)


@pytest.fixture
def routers():
    RouterReplay.clear_global_router_replay_instances()
    groups = types.SimpleNamespace(tp=None, cp=None, tp_cp=None, tp_dp_cp=None)
    built = [TopKRouter(_config(), pg_collection=groups) for _ in LAYERS]
    for router in built:
        router.eval()
    assert len(RouterReplay.global_router_replay_instances) == len(LAYERS)
    yield built
    RouterReplay.clear_global_router_replay_instances()


def _topk(logits):
    return np.argsort(-logits, axis=-1, kind="stable")[..., :K]


def _rollout(gen, lengths, unrouted_seq=None):
    """Hidden states per sequence, rollout gate weights, and the records they route to."""
    weights = gen.standard_normal((len(LAYERS), E, H)).astype(np.float32)
    hidden, records = [], []
    for i, n in enumerate(lengths):
        h = gen.standard_normal((n, H)).astype(np.float32)
        hidden.append(h)
        ids = np.stack([_topk(h[:-1] @ weights[layer].T) for layer in range(len(LAYERS))]).astype(np.uint8)
        if i == unrouted_seq:
            ids[:, 2] = 255                              # a position without routing
        records.append(RoutingRecord(f"exp_m:{i}:0", np.ascontiguousarray(ids), E, 255,
                                     {"num_tokens": n - 1}, layers=LAYERS))
    return weights, hidden, records


def _selected(routing_map):
    return [np.flatnonzero(row).tolist() for row in routing_map.numpy()]


def test_topk_router_replays_exactly_the_recorded_experts(routers, seed):
    gen = np.random.default_rng(seed)
    lengths = [7, 12, 4]
    weights, hidden, records = _rollout(gen, lengths, unrouted_seq=1)
    trainer_weights = weights + 0.5 * gen.standard_normal(weights.shape).astype(np.float32)
    replay = build_megatron_replay(records, LAYERS, pad_to_multiple=4)
    # The trainer's packed THD input: each sequence padded to a multiple of 4.
    packed = []
    for h in hidden:
        pad = (-len(h)) % 4
        packed.append(np.concatenate([h, gen.standard_normal((pad, H)).astype(np.float32)]))
    x = np.concatenate(packed)
    assert len(x) == replay.num_tokens
    starts = replay.cu_seqlens[:-1]

    live, replayed = [], []
    for layer, router in enumerate(routers):
        logits = torch.from_numpy(x @ trainer_weights[layer].T).unsqueeze(1)   # [T, 1, E]
        RouterReplay.clear_global_router_replay_action()
        _, live_map = router.routing(logits.clone())
        live.append(_selected(live_map))
    replay.install()                                  # set_replay_data + REPLAY_FORWARD
    for layer, router in enumerate(routers):
        logits = torch.from_numpy(x @ trainer_weights[layer].T).unsqueeze(1)
        probs, routing_map = router.routing(logits)
        chosen = _selected(routing_map)
        replayed.append(chosen)
        for t in range(replay.num_tokens):
            expected = sorted(replay.topk[layer][t].tolist())
            assert chosen[t] == expected
            assert np.flatnonzero(probs[t].detach().numpy()).tolist() == expected
    # Per record: replay selects exactly the recorded experts, live routing does not.
    for i, record in enumerate(records):
        rows = slice(int(starts[i]), int(starts[i]) + record.num_tokens)
        got = np.stack([np.array(replayed[layer][rows]) for layer in range(len(LAYERS))])
        own = np.stack([np.array(live[layer][rows]) for layer in range(len(LAYERS))])
        assert compare_routing(record, got)["flipped_decisions"] == 0
        assert compare_routing(record, got)["decisions"] == record.ids.size // K - \
            (3 if i == 1 else 0)
        live_metrics = compare_routing(record, own)
        assert live_metrics["decisions"] > 0
    flips = sum(compare_routing(r, np.stack([np.array(live[layer][slice(int(s), int(s) + r.num_tokens)])
                                             for layer in range(len(LAYERS))]))["flipped_decisions"]
                for r, s in zip(records, starts, strict=True))
    assert flips > 0                                   # perturbed weights: the router flips
    # Unrouted positions got placeholders 0..K-1 (masked), never the fill value or -1.
    assert not replay.mask[:, starts[1] + 2].any()
    assert replayed[0][starts[1] + 2] == list(range(K))

    # The backward recompute replays the same ids (set_target_indices queued them).
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
    for layer, router in enumerate(routers):
        logits = torch.from_numpy(x @ trainer_weights[layer].T).unsqueeze(1)
        assert _selected(router.routing(logits)[1]) == replayed[layer]


def test_padded_batch_goes_through_megatron_flattening(routers, seed):
    gen = np.random.default_rng(seed)
    lengths = [5, 9, 3]
    weights, hidden, records = _rollout(gen, lengths)
    width = 9
    replay = build_megatron_replay(records, LAYERS, layout="sbhd", max_seq_len=width)
    grid = np.zeros((width, len(lengths), H), dtype=np.float32)          # [s, b, h]
    for b, h in enumerate(hidden):
        grid[:len(h), b] = h
    replay.install()
    for layer, router in enumerate(routers):
        logits = torch.from_numpy(grid @ weights[layer].T)              # [s, b, E]
        chosen = _selected(router.routing(logits)[1])                   # Megatron's view(-1, E)
        for b, record in enumerate(records):
            for t in range(record.num_tokens):
                assert chosen[t * len(lengths) + b] == sorted(record.ids[layer, t].tolist())


def test_megatron_cannot_replay_minus_one(routers):
    """Why the adapter never emits -1: Megatron gathers the router scores at the ids."""
    replay = RouterReplay.global_router_replay_instances[0]
    replay.set_target_indices(torch.tensor([[-1, 0]]))
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    with pytest.raises((RuntimeError, IndexError)):
        replay.get_replay_topk(torch.zeros(1, E), K, None, None, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows the CPU-only limitation")
def test_router_forward_needs_cuda(routers):
    with pytest.raises((AssertionError, RuntimeError), match="(?i)cuda"):
        routers[0](torch.zeros(4, 1, H))


def test_pipeline_split_matches_megatron(tmp_path):
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    for layers, pp, vp, first, last in [(8, 2, None, None, None), (16, 2, 2, None, None),
                                        (12, 4, None, None, None), (10, 3, None, 2, 2)]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = TransformerConfig(num_layers=layers, hidden_size=H, num_attention_heads=2,
                                       pipeline_model_parallel_size=pp,
                                       virtual_pipeline_model_parallel_size=vp,
                                       num_layers_in_first_pipeline_stage=first,
                                       num_layers_in_last_pipeline_stage=last,
                                       pipeline_dtype=torch.float32, use_cpu_initialization=True)
        for rank in range(pp):
            ours = pipeline_layer_ranges(layers, pp, rank, vp_size=vp, first_stage_layers=first,
                                         last_stage_layers=last)
            for v, span in enumerate(ours):
                stage = v if vp else None
                start = get_transformer_layer_offset(config, vp_stage=stage, pp_rank=rank)
                count = get_num_layers_to_build(config, vp_stage=stage, pp_rank=rank)
                assert span == range(start, start + count)


def test_context_parallel_split_matches_megatron(tmp_path):
    from megatron.core.utils import get_batch_on_this_cp_rank

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/pg",
                                         world_size=1, rank=0)
    try:
        for seq_len, cp in [(8, 2), (24, 3), (16, 4)]:
            for rank in range(cp):
                group = types.SimpleNamespace(size=lambda cp=cp: cp, rank=lambda rank=rank: rank)
                batch = get_batch_on_this_cp_rank({"tokens": torch.arange(seq_len)[None]},
                                                  cp_group=group)
                assert batch["tokens"][0].tolist() == \
                    context_parallel_indices(seq_len, cp, rank).tolist()
    finally:
        torch.distributed.destroy_process_group()


def test_install_per_model_chunk(routers, seed):
    """Virtual pipeline stages: each chunk's routers get the replay data of its layers."""
    gen = np.random.default_rng(seed)
    weights, hidden, records = _rollout(gen, [6, 5])
    instances = RouterReplay.global_router_replay_instances
    chunks = [((1, 2), instances[:2], routers[:2]), ((3,), instances[2:], routers[2:])]
    x = np.concatenate(hidden)
    for layers, replays, chunk_routers in chunks:
        replay = build_megatron_replay(records, layers)
        replay.install(routers=replays)
        for i, router in enumerate(chunk_routers):
            layer = LAYERS.index(layers[i])
            chosen = _selected(router.routing(torch.from_numpy(x @ weights[layer].T)[:, None])[1])
            assert chosen == [sorted(ids) for ids in replay.topk[i].tolist()]
        with pytest.raises(ValueError, match="routers"):
            replay.install(routers=instances)


def test_other_token_conventions_are_refused(seed):
    record = make_record(np.random.default_rng(seed), layers=LAYERS)
    record.token_convention = "some-future-convention"
    with pytest.raises(ValueError, match="token convention"):
        build_megatron_replay([record], LAYERS)
