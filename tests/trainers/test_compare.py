"""Routing-mismatch metrics against a set-by-set reference; Prometheus; the harness demo."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from fd_routing_replay.codec import RoutingRecord
from fd_routing_replay.trainers import RoutingMismatchGauges, compare_routing, replay_topk
from tests.trainers.records import make_record, random_ids


def reference(recorded, recomputed, fill, num_experts):
    """The metrics by plain loops over (layer, token) sets."""
    layers, tokens, k = recorded.shape
    tokens = min(tokens, recomputed.shape[1])
    flips = np.zeros((layers, tokens), bool)
    valid = np.zeros((layers, tokens), bool)
    overlap = 0
    rec_load = np.zeros(num_experts, int)
    com_load = np.zeros(num_experts, int)
    for layer in range(layers):
        for t in range(tokens):
            a = [int(x) for x in recorded[layer, t]]
            if fill in a:
                continue
            b = [int(x) for x in recomputed[layer, t]]
            valid[layer, t] = True
            flips[layer, t] = set(a) != set(b)
            overlap += len(set(a) & set(b))
            for x in a:
                rec_load[x] += 1
            for x in b:
                com_load[x] += 1
    decisions = valid.sum()
    per_layer = [flips[layer][valid[layer]].mean() if valid[layer].any() else None for layer in range(layers)]
    routed_tokens = valid.any(axis=0)
    return {
        "decisions": int(decisions),
        "flip_rate": flips.sum() / decisions,
        "per_layer_flip_rate": per_layer,
        "token_flip_share": flips.any(axis=0)[routed_tokens].mean(),
        "mean_overlap": overlap / (decisions * k),
        "expert_load_drift": (com_load - rec_load) / (decisions * k),
    }


def test_metrics_match_the_reference(seed):
    gen = np.random.default_rng(seed)
    record = make_record(gen, tokens=40, layers=(2, 4, 6), top_k=4, num_experts=12,
                         unrouted=(0, 17))
    recomputed = record.ids[:, :41].astype(np.int64).copy()
    recomputed = np.concatenate([recomputed, random_ids(gen, 3, 1, 4, 12)], axis=1)  # T + 1
    flip = gen.random((3, 41)) < 0.3
    recomputed[flip] = random_ids(gen, 3, 41, 4, 12)[flip]
    reorder = gen.random((3, 41)) < 0.3                     # same set, another order
    recomputed[reorder] = recomputed[reorder][:, ::-1]
    recomputed[:, 0] = 0                                     # unrouted position: ignored
    got = compare_routing(record, recomputed)
    want = reference(record.ids, recomputed, record.fill_value, 12)
    assert got["compared_tokens"] == 40 and got["recomputed_tokens"] == 41
    assert got["decisions"] == want["decisions"] == 3 * 38
    assert got["unrouted_decisions"] == 6
    assert got["flip_rate"] == pytest.approx(want["flip_rate"])
    assert got["per_layer_flip_rate"] == pytest.approx(want["per_layer_flip_rate"])
    assert got["token_flip_share"] == pytest.approx(want["token_flip_share"])
    assert got["mean_overlap"] == pytest.approx(want["mean_overlap"])
    assert got["expert_load_drift"] == pytest.approx(list(want["expert_load_drift"]))
    assert sum(got["expert_load_drift"]) == pytest.approx(0.0)
    assert got["layers"] == [2, 4, 6] and got["flip_rate"] > 0


def test_identical_empty_and_bad_inputs(seed):
    gen = np.random.default_rng(seed)
    record = make_record(gen, tokens=5)
    same = compare_routing(record, record.ids[:, :, ::-1])
    assert same["flip_rate"] == 0 and same["mean_overlap"] == 1.0 and same["token_flip_share"] == 0
    assert same["load_drift_l1"] == 0
    empty = RoutingRecord("exp_e:0:0", np.zeros((2, 0, 2), np.uint8), 8, layers=(0, 1))
    nothing = compare_routing(empty, np.zeros((2, 0, 2), np.int64))
    assert nothing["decisions"] == 0 and nothing["flip_rate"] == 0.0
    assert nothing["per_layer_flip_rate"] == [None, None]
    with pytest.raises(ValueError, match="differ in layers or top_k"):
        compare_routing(record, np.zeros((2, 5, 2), np.int64))
    with pytest.raises(ValueError, match=r"in \[0, 8\)"):
        compare_routing(record, np.full((3, 5, 2), 8))
    with pytest.raises(ValueError, match="integer"):
        compare_routing(record, np.zeros((3, 5, 2), np.float32))
    plain = compare_routing(np.array([[[0, 1]]]), np.array([[[1, 2]]]), num_experts=3)
    assert plain["flip_rate"] == 1.0 and plain["mean_overlap"] == 0.5
    torch = pytest.importorskip("torch")
    assert compare_routing(record, torch.from_numpy(record.ids.astype(np.int64)))["flip_rate"] == 0


def test_prometheus_gauges_in_the_callers_registry(seed):
    prometheus_client = pytest.importorskip("prometheus_client")
    gen = np.random.default_rng(seed)
    record = make_record(gen, tokens=20, layers=(1, 3))
    other = record.ids.astype(np.int64)[:, ::-1].copy()       # other tokens' routes: flips
    result = compare_routing(record, other)
    registry = prometheus_client.CollectorRegistry()
    gauges = RoutingMismatchGauges(registry, labelnames=("model",))
    gauges.update(result, model="tiny")
    value = registry.get_sample_value
    assert value("fd_rr_routing_flip_rate", {"model": "tiny"}) == pytest.approx(result["flip_rate"])
    assert value("fd_rr_routing_mean_overlap", {"model": "tiny"}) == \
        pytest.approx(result["mean_overlap"])
    assert value("fd_rr_routing_layer_flip_rate", {"model": "tiny", "layer": "3"}) == \
        pytest.approx(result["per_layer_flip_rate"][1])
    assert value("fd_rr_routing_expert_load_drift", {"model": "tiny", "expert": "5"}) == \
        pytest.approx(result["expert_load_drift"][5])
    assert prometheus_client.REGISTRY.get_sample_value("fd_rr_routing_flip_rate",
                                                       {"model": "tiny"}) is None


def test_replay_topk_reference(seed):
    gen = np.random.default_rng(seed)
    scores = gen.random((9, 6))
    recorded = random_ids(gen, 1, 9, 2, 6)[0].astype(np.int64)
    mask = gen.random(9) < 0.6
    probs, ids = replay_topk(scores, recorded, mask)
    for t in range(9):
        expected = recorded[t] if mask[t] else np.argsort(-scores[t])[:2]
        assert ids[t].tolist() == expected.tolist()
        assert probs[t].tolist() == scores[t, expected].tolist()


def test_harness_trainer_flips_without_replay_and_not_with_it(seed, make_writer):
    """The tiny MoE model rolls out and records; a trainer whose gates are perturbed
    recomputes: its own routing flips, the routing it applies under replay does not."""
    pytest.importorskip("paddle")
    from fd_routing_replay.reader import RoutingReader
    from fd_routing_replay.store import open_store
    from fdrr_dev.harness.fidelity import topk_margins
    from fdrr_dev.harness.model import TinyMoEModel
    from fdrr_dev.harness.paddle_runtime import paddle
    from fdrr_dev.harness.rollouts import RolloutPlan
    from fdrr_dev.harness.session import run_rollouts

    url = f"memory://trainers-{uuid.uuid4().hex[:12]}"
    store = open_store(url)
    plan = RolloutPlan(num_rollouts=2, num_turns=1, samples_per_prompt=1, seed=seed % 1000)
    run = run_rollouts(plan, writer=make_writer(url))
    reader = RoutingReader(store)
    gen = np.random.default_rng(seed)
    flips_live = flips_replayed = flips_same_weights = near_ties = decisions = 0
    for result in run.results:
        record = reader.get(result.rollout_id)
        assert record is not None
        tokens = np.asarray(result.forwarded_tokens)
        rollout_model = run.model_for_version(result.weights_version)
        cfg = rollout_model.config
        same = rollout_model.forward_full(tokens)
        near_ties += int((topk_margins(same.gate_logits, cfg.top_k) <= 1e-3).sum())
        flips_same_weights += compare_routing(record, same.topk_ids)["flipped_decisions"]

        trainer = TinyMoEModel(cfg, weights_version=result.weights_version)
        for layer in trainer.layers[cfg.moe_layer_start_index:]:
            gate = layer["gate"].numpy()
            layer["gate"] = paddle.to_tensor(
                gate + 0.3 * gate.std() * gen.standard_normal(gate.shape).astype(np.float32))
        recomputed = trainer.forward_full(tokens)            # routing anew
        live = compare_routing(record, recomputed.topk_ids)
        flips_live += live["flipped_decisions"]
        decisions += live["decisions"]
        replayed = trainer.forward_full(tokens, replay=record.ids.astype(np.int64))
        applied = np.stack([replay_topk(replayed.gate_logits[layer], record.ids[layer])[1]
                            for layer in range(record.num_layers)])
        flips_replayed += compare_routing(record, applied)["flipped_decisions"]
    assert decisions > 0
    assert flips_live > 0                  # a perturbed trainer routes differently
    assert flips_replayed == 0             # replay applies the rollout's experts
    assert flips_same_weights <= near_ties  # same weights: only near-ties may differ
