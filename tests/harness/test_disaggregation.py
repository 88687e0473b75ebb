"""PD disaggregation (#12): a prefill engine hands prompts and their routes to a decode engine.

P (prefix cache, chunked prefill) prefills and samples the first token, gathers the
prompt's rows by its block table and writes no record; D scatters them into its own slot
cache by its block table and decodes; D's record must be complete and exact.  Without the
hand-over of the rows the fidelity check fails.
"""

from __future__ import annotations

from fdrr_dev.harness.rollouts import RolloutPlan
from tests.harness.test_scenarios import FINISHED, assert_passed, config

PD = config("step", max_num_seqs=4, max_num_batched_tokens=24)


def test_decode_engine_records_are_complete_and_exact(seed, run_checked):
    plan = RolloutPlan(num_rollouts=8, num_turns=2, seed=seed % 1000)
    run, report, store = run_checked(plan, PD, disaggregated=True)
    assert_passed(report)
    pair = run.engine
    finished = [r for r in run.results if r.finish_reason in FINISHED]
    assert len(finished) == len(run.results) == pair.handed_over == 16
    assert pair.deferred > 0                                   # D was full: hand-overs waited
    assert any(r.chunks > 1 for r in run.results)              # P prefilled in chunks
    assert pair.prefill.blocks.hit_tokens > 0                  # turn 1 hit turn 0 on P
    assert pair.prefill.routing.counters["records_submitted"] == 0       # P writes nothing
    assert pair.decode.routing.counters["records_submitted"] == len(finished)
    assert sorted(store.list()) == sorted(r.rollout_id for r in finished)
    decoded = sum(r.num_output_tokens - 1 for r in finished)   # D forwards no prompt token,
    if pair.decode.preemptions == 0:                            # unless it must recompute one
        assert pair.decode.forwarded == decoded
    else:
        assert pair.decode.forwarded > decoded


def test_check_fails_without_the_hand_over_of_rows(seed, run_checked):
    plan = RolloutPlan(num_rollouts=6, num_turns=1, seed=seed % 1000)
    run, report, _ = run_checked(plan, PD, disaggregated={"hand_over_routing": False})
    assert run.engine.handed_over == 6
    assert not report.passed
    assert report.unrouted_tokens + report.decisive_disagreements > 0


def test_table_generation_refuses_disaggregation(run_checked):
    import pytest

    with pytest.raises(ValueError, match="generation='step'"):
        run_checked(RolloutPlan(num_rollouts=1, num_turns=1), config("table"), disaggregated=True)


def test_pd_with_a_cpu_cache_on_prefill_and_prefix_omission_on_decode(seed, tmp_path, make_writer):
    """Everything at once: P under memory pressure swaps cached blocks through its CPU tier,
    D (tight too: it preempts and recomputes) hands over only new rows of agentic turns."""
    from fd_routing_replay.reader import RoutingReader
    from fd_routing_replay.store import open_store
    from fdrr_dev.harness.fidelity import check_results
    from fdrr_dev.harness.session import run_rollouts

    store = {"type": "local", "namespace": "h", "local": {"root": str(tmp_path / "store")}}
    writer = make_writer(store, mode="thread", capacity_bytes=8 << 20)
    plan = RolloutPlan(num_rollouts=6, num_turns=4, tool_tokens=(3, 10), truncate_every=3, seed=seed % 1000)
    run = run_rollouts(plan, engine_config=config("step", num_blocks=48, max_num_seqs=6, num_cpu_blocks=32,
                                                  max_num_batched_tokens=24),
                       writer=writer, prefix_omission=True, disaggregated=True)
    assert writer.flush(60)
    report = check_results(run.results, RoutingReader(open_store(store)).get, run.model_for_version,
                           expect_present=lambda r: r.finish_reason in FINISHED)
    assert_passed(report)
    assert run.engine.prefill.blocks.swapped_in > 0
    assert run.counters["prefix_omitted"] > 0 and run.counters["prefix_fallbacks"] > 0
