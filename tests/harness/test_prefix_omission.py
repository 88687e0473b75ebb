"""Multi-turn prefix omission (#15) on the harness engine, through the real writer.

Agentic rollouts: a tool's output is appended to the history before each later turn, and
every third turn the agent truncates its history (system prompt + the newer half), so
that turn does not extend the previous one and must be handed over whole (a fallback).
With ``prefix_omission`` a turn whose previous turn is durable hands over only its new
rows and the writer prepends the stored ones; the records must equal those of a run
with omission off, and pass the fidelity check.
"""

from __future__ import annotations

import numpy as np

from fd_routing_replay.keys import parse_rollout_id
from fd_routing_replay.reader import RoutingReader
from fd_routing_replay.store import open_store
from fd_routing_replay.writer import RoutingWriter
from fdrr_dev.harness.fidelity import DEFAULT_MARGIN, check_results, topk_margins
from fdrr_dev.harness.rollouts import RolloutPlan
from fdrr_dev.harness.session import run_rollouts
from tests.harness.test_scenarios import FINISHED, assert_passed, config

AGENT = dict(num_rollouts=6, num_turns=5, tool_tokens=(3, 10), truncate_every=3)


class LaggingWriter(RoutingWriter):
    """A writer that has not acknowledged even turns' previous turn yet (still in flight)."""

    def durable_prefix(self, rollout_id):
        return None if parse_rollout_id(rollout_id).turn % 2 == 0 else super().durable_prefix(rollout_id)


def run_agent(tmp_path, name, plan, *, writer_cls=RoutingWriter, **kwargs):
    root = tmp_path / name
    store = {"type": "local", "namespace": "harness", "local": {"root": str(root / "store")}}
    with writer_cls(store, {"mode": "thread", "capacity_bytes": 8 << 20, "journal_dir": str(root / "journal"),
                            "dead_letter_dir": str(root / "dead")}) as writer:
        run = run_rollouts(plan, engine_config=config("step"), writer=writer, **kwargs)
        assert writer.flush(60)
    reader = RoutingReader(open_store(store))
    report = check_results(run.results, reader.get, run.model_for_version,
                           expect_present=lambda r: r.finish_reason in FINISHED)
    return run, reader, report


def later_turns(run):
    """(extending, truncating) turn counts among the finished turns t > 0."""
    turns = [parse_rollout_id(r.rollout_id).turn for r in run.results if r.finish_reason in FINISHED]
    truncating = sum(1 for t in turns if t and t % AGENT["truncate_every"] == 0)
    return sum(1 for t in turns if t) - truncating, truncating


def assert_same_records(run, full, omitted):
    """Identical records, except where turn t recomputed a position of turn t−1 and the
    gate's top-k was a near-tie (the omitted record keeps turn t−1's rows: what a prefix
    hit replays); such differences are counted by the caller."""
    flips = 0
    for result in run.results:
        if result.finish_reason not in FINISHED:
            continue
        a, b = full.get(result.rollout_id), omitted.get(result.rollout_id)
        assert a.tokens_hash == b.tokens_hash and a.ids.shape == b.ids.shape
        b.check_tokens(result.forwarded_tokens)
        differ = (np.sort(a.ids, axis=-1) != np.sort(b.ids, axis=-1)).any(axis=-1)     # [L, T]
        if differ.any():
            model = run.model_for_version(result.weights_version)
            margins = topk_margins(model.forward_full(np.array(result.forwarded_tokens)).gate_logits,
                                   model.config.top_k)
            assert (margins[differ] <= DEFAULT_MARGIN).all(), result.rollout_id
            flips += int(differ.sum())
    return flips


def test_agentic_turns_omit_their_prefix_and_store_the_same_records(seed, tmp_path):
    plan = RolloutPlan(seed=seed % 1000, **AGENT)
    full_run, full, full_report = run_agent(tmp_path, "full", plan)
    run, omitted, report = run_agent(tmp_path, "omitted", plan, prefix_omission=True)
    assert_passed(full_report)
    assert_passed(report)
    assert [r.forwarded_tokens for r in run.results] == [r.forwarded_tokens for r in full_run.results]
    extending, truncating = later_turns(run)
    assert extending > 0 and truncating > 0
    assert run.counters["prefix_omitted"] == extending
    assert run.counters["prefix_fallbacks"] == truncating
    assert full_run.counters["prefix_omitted"] == full_run.counters["prefix_fallbacks"] == 0
    assert run.counters["records_submitted"] == len(run.results)
    assert assert_same_records(run, full, omitted) <= report.near_ties


def test_a_turn_whose_previous_turn_is_not_durable_is_handed_over_whole(seed, tmp_path):
    plan = RolloutPlan(seed=seed % 1000, **dict(AGENT, truncate_every=0, num_turns=4))
    run, omitted, report = run_agent(tmp_path, "lagging", plan, prefix_omission=True,
                                     writer_cls=LaggingWriter)
    assert_passed(report)
    turns = [parse_rollout_id(r.rollout_id).turn for r in run.results]
    assert run.counters["prefix_fallbacks"] == sum(1 for t in turns if t and t % 2 == 0) > 0
    assert run.counters["prefix_omitted"] == sum(1 for t in turns if t % 2 == 1) > 0
