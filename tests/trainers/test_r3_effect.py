"""The R3 effect, measured (issue #23): a bf16 Paddle engine's rollouts recomputed by an
fp32 transformers trainer disagree on routing without replay and not at all with it, and
the KL between their token log-probabilities drops; the metrics against plain-loop
references; ``fd-rr r3-effect``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fd_routing_replay.trainers.compare import compare_routing, logprob_mismatch
from tests.trainers.records import make_record, random_ids

# ------------------------------------------------------------------ metrics (NumPy only)


def test_logprob_mismatch_matches_the_reference(seed):
    gen = np.random.default_rng(seed)
    engine = np.log(gen.uniform(1e-4, 1.0, 200))
    trainer = engine + gen.normal(0, 0.2, 200)
    got = logprob_mismatch(engine, trainer)
    # KL(engine || trainer) by the k3 estimator, from the probability ratio r = p_t / p_e
    ratios = [np.exp(t) / np.exp(e) for e, t in zip(engine, trainer, strict=True)]
    want = sum(r - 1 - np.log(r) for r in ratios) / len(ratios)
    assert got["tokens"] == 200
    assert got["k3_kl"] == pytest.approx(want, rel=1e-9)
    assert got["max_abs_logprob_diff"] == pytest.approx(max(abs(t - e) for e, t in
                                                            zip(engine, trainer, strict=True)))
    assert got["mean_abs_logprob_diff"] == pytest.approx(np.mean(np.abs(trainer - engine)))
    assert got["k3_kl"] > 0
    same = logprob_mismatch(engine, engine)
    assert same["k3_kl"] == 0 and same["max_abs_logprob_diff"] == 0
    # tiny differences keep their precision (exp(d) - 1 - d ~ d^2 / 2)
    assert logprob_mismatch([0.0], [1e-6])["k3_kl"] == pytest.approx(0.5e-12, rel=1e-3)
    assert logprob_mismatch([], [])["tokens"] == 0


@pytest.mark.parametrize("engine, trainer, message", [
    ([0.0, -1.0], [0.0], "same tokens"),
    ([0.0, -np.inf], [0.0, -1.0], "finite"),
    ([0.0, np.nan], [0.0, -1.0], "finite"),
])
def test_logprob_mismatch_refuses(engine, trainer, message):
    with pytest.raises(ValueError, match=message):
        logprob_mismatch(engine, trainer)


def test_flipped_layers_per_token_matches_the_reference(seed):
    gen = np.random.default_rng(seed)
    record = make_record(gen, tokens=30, layers=(0, 1, 2, 3), top_k=3, num_experts=10,
                         unrouted=(0, 5))
    recomputed = record.ids.astype(np.int64).copy()
    flip = gen.random((4, 30)) < 0.25
    recomputed[flip] = random_ids(gen, 4, 30, 3, 10)[flip]
    got = compare_routing(record, recomputed)
    flipped, tokens = 0, 0
    for t in range(30):
        routed = [layer for layer in range(4) if record.fill_value not in record.ids[layer, t]]
        if not routed:
            continue
        tokens += 1
        flipped += sum(set(record.ids[layer, t].tolist()) != set(recomputed[layer, t].tolist())
                       for layer in routed)
    assert got["flipped_layers_per_token"] == pytest.approx(flipped / tokens)
    assert got["flipped_layers_per_token"] == pytest.approx(
        got["flip_rate"] * got["decisions"] / tokens)
    assert compare_routing(record, record.ids)["flipped_layers_per_token"] == 0


# ------------------------------------------------------------------ the experiment


@pytest.fixture
def experiment():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("paddle")
    from fdrr_dev.harness import r3_effect

    return r3_effect


def test_replay_off_disagrees_replay_on_routes_as_the_engine_did(experiment, seed, tmp_path):
    result = experiment.run_r3_effect(rollouts=12, seed=seed, workdir=tmp_path)
    off, on = result.off, result.on
    # bf16 activations in the engine against fp32 in the trainer: routing differs
    assert off["flipped_decisions"] > 0 and off["flip_rate"] > 0
    assert off["token_flip_share"] > 0 and off["flipped_layers_per_token"] > 0
    # replay: the experts every MoE block applied are the record's, all of them
    assert on["flipped_decisions"] == 0 and on["flip_rate"] == 0
    assert on["token_flip_share"] == 0 and on["flipped_layers_per_token"] == 0
    assert on["decisions"] == off["decisions"] == off["routed_tokens"] * 12 > 0
    # ... and the trainer's token log-probabilities come closer to the engine's
    assert 0 < on["k3_kl"] < off["k3_kl"]
    assert on["tokens"] == off["tokens"] > 0
    assert result.passed and result.sequences <= 12
    # what the run left: the checkpoint transformers read, one record per rollout
    assert (tmp_path / "checkpoint" / "model.safetensors").is_file()
    from fd_routing_replay.store import open_store

    with open_store(f"local://{tmp_path / 'store'}", experiment.NAMESPACE) as store:
        assert len(store.list()) == result.sequences
    table = result.table()
    assert "router decisions that differ" in table and "k3 KL" in table
    assert f"{off['flip_rate']:.4f}" in table


def test_fp32_engine_is_the_control(experiment, seed):
    """With fp32 activations on the engine too, the two sides compute alike: (almost) no
    routing differs and the logprobs agree, which also checks that each engine logprob
    is lined up with the trainer's for the same token."""
    result = experiment.run_r3_effect(rollouts=6, seed=seed, engine_activations="float32")
    # replay: the trainer applies the engine's experts, so only fp32 rounding separates them
    assert result.on["flipped_decisions"] == 0 and result.on["max_abs_logprob_diff"] < 1e-3
    # without replay a router call at a near-tie (~1e-6 of margin) may go the other way, about
    # 1 run in 100, and carry into the layers and tokens after it: a few decisions, far from
    # bf16's 11-16%; with none, the logprobs agree as closely
    assert result.off["flip_rate"] <= 0.03
    if result.off["flipped_decisions"] == 0:
        assert result.off["max_abs_logprob_diff"] < 1e-3
    assert result.passed


@pytest.mark.parametrize("off_flips, off_kl, on_flips, on_kl, want", [
    (5, 1e-3, 0, 1e-4, True),                   # routing differed: replay must lower the KL
    (5, 1e-3, 0, 1e-3, False),                  # ... strictly
    (5, 1e-3, 1, 1e-5, False),                  # a replayed decision that differs fails
    (0, 3.73e-13, 0, 3.75e-13, True),           # same experts: rounding apart (seed 218012485)
    (0, 1e-6, 0, 1e-6 + 1e-8, False),           # same experts, yet a KL gap past rounding
])
def test_passed_tolerates_rounding_only_where_no_routing_differed(experiment, off_flips, off_kl,
                                                                  on_flips, on_kl, want):
    def row(flips, kl):
        return {"flipped_decisions": flips, "k3_kl": kl}
    result = experiment.R3Effect(off=row(off_flips, off_kl), on=row(on_flips, on_kl),
                                 sequences=1, rollouts=1, seed=0, model={})
    assert result.passed is want


def test_experiment_refuses_dense_layers_and_no_rollouts(experiment):
    from fdrr_dev.harness.qwen3_moe import TinyQwen3Config

    with pytest.raises(ValueError, match="mlp_only_layers"):
        experiment.run_r3_effect(rollouts=2, model_config=TinyQwen3Config(mlp_only_layers=(0,)))
    with pytest.raises(ValueError, match="rollouts"):
        experiment.run_r3_effect(rollouts=0)


def test_cli_prints_the_table_and_json(experiment, seed, capsys):
    from fdrr_dev.__main__ import main

    assert main(["r3-effect", "--rollouts", "4", "--seed", str(seed % 1000), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["replay_on"]["flipped_decisions"] == 0 and out["passed"] is True
    assert out["replay_off"]["decisions"] == out["replay_on"]["decisions"] > 0
    assert out["engine_activations"] == "bfloat16" and out["seed"] == seed % 1000
    assert main(["r3-effect", "--rollouts", "0"]) == 2
    assert "--rollouts" in capsys.readouterr().err
