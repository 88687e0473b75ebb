"""End to end on a real MoE forward: every "correct under" case, proven by the fidelity check.

Each scenario runs multi-turn rollouts through the harness engine (FastDeploy's runner
order), stores records through the real store, reads them back with RoutingReader and
holds them up against a teacher-forced forward of the same model.  The last tests show
the check fails when the record is wrong — including the reference's dropped last token.
Scenarios run on both capture generations: FastDeploy 2.5's manager (``table``) and
2.6's worker capturer + engine-side finish (``step``).
"""

from __future__ import annotations

import numpy as np
import pytest

from fd_routing_replay.capture import fd25
from fd_routing_replay.reader import RoutingReader
from fd_routing_replay.store import open_store
from fdrr_dev.harness.engine import EngineConfig
from fdrr_dev.harness.fidelity import (
    FidelityReport,
    check_record,
    check_results,
    topk_margins,
)
from fdrr_dev.harness.rollouts import RolloutPlan
from fdrr_dev.harness.session import run_rollouts
from tests.harness.conftest import memory_url

FINISHED = ("eos", "length")
GENERATIONS = pytest.mark.parametrize("generation", ["table", "step"])


def config(generation, **fields):
    return EngineConfig(generation=generation, **fields)


def assert_passed(report: FidelityReport) -> None:
    assert report.passed, report.summary() + "\n" + "\n".join(report.failures)
    assert report.decisions > 0 and report.agreement == 1.0 - report.near_tie_disagreements / report.decisions


@GENERATIONS
def test_chunked_prefill_prefix_hits_and_slot_reuse(seed, generation, run_checked):
    plan = RolloutPlan(num_rollouts=12, user_tokens=(20, 40), seed=seed % 1000)
    run, report, _ = run_checked(plan, config(generation, max_num_batched_tokens=16, max_num_seqs=6))
    assert_passed(report)
    assert any(r.chunks > 1 for r in run.results)                      # chunked prefill happened
    assert any(r.cached_tokens > 0 for r in run.results if r.rollout_id.endswith(":1:0"))
    assert run.engine.blocks.hit_tokens > 0
    if generation == "table":
        assert run.manager.counters["registered"] > 6                  # slots were reused
    assert run.counters["records_submitted"] == report.requests == len(run.results) == 36


@GENERATIONS
def test_preemption_and_recompute(seed, generation, run_checked):
    plan = RolloutPlan(num_rollouts=16, seed=seed % 1000)
    run, report, _ = run_checked(plan, config(generation, num_blocks=40, max_num_seqs=12))
    assert_passed(report)
    assert run.engine.preemptions > 0
    assert any(r.preemptions for r in run.results)
    if generation == "table":
        assert run.manager.counters["cleared"] >= run.engine.preemptions


@GENERATIONS
def test_aborted_requests_leave_no_record(seed, generation, run_checked):
    plan = RolloutPlan(num_rollouts=16, abort_fraction=0.4, seed=seed % 1000)
    run, report, store = run_checked(plan, config(generation))
    assert_passed(report)
    aborted = [r for r in run.results if r.finish_reason == "abort"]
    assert aborted
    assert not any(store.exists(r.rollout_id) for r in aborted)


@GENERATIONS
def test_speculative_decoding_keeps_only_accepted_tokens(seed, generation, run_checked):
    plan = RolloutPlan(num_rollouts=12, seed=seed % 1000)
    run, report, _ = run_checked(plan, config(generation, num_speculative_tokens=3, temperature=0.3,
                                              eos_bias=0.5))
    assert_passed(report)
    runner = run.engine.runner
    assert 0 < runner.drafts_accepted < runner.drafts_proposed          # both outcomes occurred
    if generation == "table":
        assert run.manager.counters["tokens_offloaded"] < run.engine.forwarded
    else:   # 2.6 offloads every forwarded row, rejected drafts too; the next step overwrites them
        assert run.manager.counters["tokens_offloaded"] == run.engine.forwarded


@GENERATIONS
@pytest.mark.parametrize("tp_size,ep_size", [(2, 1), (2, 2)])
def test_tensor_and_expert_parallel_ranks(seed, tp_size, ep_size, generation, run_checked):
    plan = RolloutPlan(num_rollouts=8, seed=seed % 1000)
    run, report, _ = run_checked(plan, config(generation, tp_size=tp_size, ep_size=ep_size))
    assert_passed(report)
    rank0, rank1 = run.managers
    assert getattr(rank1, "sink", None) is None and rank1.host_cache is None
    assert rank1.binding.calls == rank0.binding.calls > 0 and rank1.binding.errors == 0
    assert run.counters["records_submitted"] == len(run.results)


@GENERATIONS
def test_rl_weight_update_clears_and_keeps_versions_apart(seed, generation, run_checked):
    plan = RolloutPlan(num_rollouts=12, seed=seed % 1000)
    # 4 slots for 12 rollouts: requests are waiting at the update, so version 1 serves some
    # (with every rollout running at once, the update dropped them all: seed 145 did)
    run, report, store = run_checked(plan, config(generation, max_num_seqs=4), weight_update_after=10)
    assert_passed(report)
    versions = {r.weights_version for r in run.results if r.finish_reason in FINISHED}
    assert versions == {0, 1}
    dropped = [r for r in run.results if r.finish_reason == "weight_update"]
    assert not any(store.exists(r.rollout_id) for r in dropped)
    # the check is version-sensitive: version-1 records do not pass against version-0 weights
    late = next(r for r in run.results if r.weights_version == 1 and r.finish_reason in FINISHED)
    wrong = FidelityReport()
    record = RoutingReader(store).get(late.rollout_id)
    check_record(run.models[0], np.array(late.forwarded_tokens), np.asarray(record.ids),
                 record.fill_value, wrong, late.rollout_id)
    assert not wrong.passed


@GENERATIONS
def test_only_last_turn_keeps_the_final_turn(seed, generation, run_checked):
    plan = RolloutPlan(num_rollouts=8, num_turns=3, seed=seed % 1000)
    finals = {}

    def is_final(result):
        return finals.get(result.rollout_id.rsplit(":", 2)[0]) == result.rollout_id

    run, _, store = run_checked(plan, config(generation), only_last_turn=True, expect=lambda r: False)
    for r in run.results:
        if r.finish_reason in FINISHED:
            finals[r.rollout_id.rsplit(":", 2)[0]] = r.rollout_id
    report = check_results(run.results, RoutingReader(store).get, run.model_for_version,
                           expect_present=is_final)
    assert_passed(report)
    assert sorted(store.list()) == sorted(finals.values())


@GENERATIONS
def test_per_layer_keys_and_padding(seed, generation, make_writer):
    plan = RolloutPlan(num_rollouts=4, num_turns=1, seed=seed % 1000)
    url = memory_url()
    store = open_store(url)
    run = run_rollouts(plan, engine_config=config(generation), writer=make_writer(url), fused=False,
                       pad_to_max_model_len=True)
    reader = RoutingReader(store)
    model = run.models[0]
    layers = model.config.num_moe_layers
    for result in run.results:
        tokens = len(result.forwarded_tokens)
        ids = np.concatenate([reader.get_layer(result.rollout_id, layer).ids for layer in range(layers)])
        assert ids.shape == (layers, model.config.max_model_len, model.config.top_k)
        assert (ids[:, tokens:] == 255).all()
        report = FidelityReport()
        check_record(model, np.array(result.forwarded_tokens), np.ascontiguousarray(ids[:, :tokens]),
                     255, report, result.rollout_id)
        assert_passed(report)


@pytest.mark.parametrize("generation, overlap", [("table", False), ("step", False), ("step", True)])
def test_capture_does_not_change_generation(seed, generation, overlap, make_writer):
    plan = RolloutPlan(num_rollouts=8, seed=seed % 1000)
    engine_config = config(generation, overlap_schedule=overlap)
    on = run_rollouts(plan, engine_config=engine_config, writer=make_writer(memory_url("h")))
    off = run_rollouts(plan, engine_config=engine_config, capture=False)
    assert [r.forwarded_tokens for r in on.results] == [r.forwarded_tokens for r in off.results]
    assert off.manager.get_routing_table() is None
    assert off.engine.runner.capturers == [] and off.engine.routing is None


def test_a_request_the_kv_cache_can_never_hold_is_refused_not_waited_for():
    """At the head of the queue it would stall every request behind it, forever."""
    plan = RolloutPlan(num_rollouts=1, num_turns=1, user_tokens=(30, 30), max_tokens=(2, 2), seed=0)
    with pytest.raises(RuntimeError, match=r"46 tokens: 6 KV blocks of 8, more than the cache's 5 "
                                           r"\(EngineConfig.num_blocks\); it can never run"):
        run_rollouts(plan, engine_config=config("table", num_blocks=5), capture=False)
    run = run_rollouts(plan, engine_config=config("table", num_blocks=6, max_num_batched_tokens=16),
                       capture=False)          # prompt and 2 outputs, 48 tokens, in chunks: fits 6
    assert len(run.results) == 1 and run.results[0].chunks > 1


class ReferenceLengthManager(fd25.RoutingReplayManager):
    """FastDeploy's reference length: ``seq_lens_decoder + seq_lens_encoder`` before the update."""

    def put_finished_batch(self, finished_batch_ids, seq_lens_decoder=None):
        self._reference_lengths = np.asarray(seq_lens_decoder.numpy()).reshape(-1)
        return super().put_finished_batch(finished_batch_ids, seq_lens_decoder)

    def _put_one(self, batch_id, length):
        return super()._put_one(batch_id, int(self._reference_lengths[batch_id]))


def test_check_catches_the_reference_dropping_the_last_token(seed, run_checked, monkeypatch):
    plan = RolloutPlan(num_rollouts=6, num_turns=1, seed=seed % 1000)
    monkeypatch.setattr(fd25, "RoutingReplayManager", ReferenceLengthManager)   # the planted bug
    _, report, _ = run_checked(plan)
    assert not report.passed and report.wrong_lengths > 0


def test_check_catches_a_wrong_expert(seed, run_checked):
    plan = RolloutPlan(num_rollouts=2, num_turns=1, seed=seed % 1000)
    run, report, store = run_checked(plan)
    assert_passed(report)
    result = run.results[0]
    ids = np.array(RoutingReader(store).get(result.rollout_id).ids)
    tokens = np.array(result.forwarded_tokens)
    margins = topk_margins(run.models[0].forward_full(tokens).gate_logits, 4)
    layer, token = np.unravel_index(np.argmax(margins), margins.shape)
    ids[layer, token, 0] = next(e for e in range(16) if e not in ids[layer, token])
    broken = FidelityReport()
    check_record(run.models[0], tokens, ids, 255, broken, result.rollout_id)
    assert not broken.passed and broken.decisive_disagreements >= 1


@GENERATIONS
def test_fidelity_holds_with_the_set_encoding(seed, generation, make_writer):
    """``capture.encoding: set`` stores sets: the trainer-side check (top-k sets) passes."""
    from fd_routing_replay.codec import read_header

    plan = RolloutPlan(num_rollouts=6, num_turns=2, seed=seed % 1000)
    url = memory_url("harness-set")
    store = open_store(url)
    run = run_rollouts(plan, engine_config=config(generation), writer=make_writer(url, encoding="set"))
    report = check_results(run.results, RoutingReader(store).get, run.model_for_version,
                           expect_present=lambda r: r.finish_reason in FINISHED)
    assert_passed(report)
    assert {read_header(store.get(key)).encoding for key in store.list()} == {"set"}


def test_check_catches_fastdeploys_own_length_in_the_step_generation(seed, monkeypatch, run_checked):
    """FastDeploy 2.6 finishes with prompt + output, minus one only after EOS
    (token_processor.py:615-621): a request stopped by length gets an unforwarded row."""
    from fdrr_dev.harness.slot_routing import SlotRouting

    def fastdeploy_length(self, engine, request):
        eos = engine.model.config.eos_token_id
        length = len(request.tokens) - (1 if request.outputs[-1] == eos else 0)
        self.routing.finish(request.request_id, request.blocks, length, token_ids=request.tokens)

    monkeypatch.setattr(SlotRouting, "finish", fastdeploy_length)
    plan = RolloutPlan(num_rollouts=8, num_turns=1, max_tokens=(4, 8), seed=seed % 1000)
    run, report, _ = run_checked(plan, config("step", eos_bias=-5.0))
    assert any(r.finish_reason == "length" for r in run.results)
    assert not report.passed and report.wrong_lengths > 0


def test_overlap_scheduling_keeps_each_steps_rows(seed, run_checked):
    """FastDeploy 2.6's execute_model_overlap: step N's rows are flushed after step N+1's
    forward, and the launch is padded beyond the step's tokens (token_num_overlap trims
    it): records stay exact through chunked prefill, prefix hits and preemption."""
    plan = RolloutPlan(num_rollouts=10, user_tokens=(20, 40), seed=seed % 1000)
    run, report, _ = run_checked(plan, config("step", overlap_schedule=True, num_blocks=48,
                                              max_num_batched_tokens=16, max_num_seqs=8))
    assert_passed(report)
    assert run.engine.runner.overlap_schedule
    assert any(r.chunks > 1 for r in run.results) and run.engine.blocks.hit_tokens > 0


def test_overlap_padding_that_escapes_the_trim_is_caught(seed, monkeypatch, run_checked):
    """A capturer that ignored token_num_overlap would scatter the padding rows over the
    step's own first slots: the fidelity check fails."""
    from fd_routing_replay.capture.fd26 import StepRoutingCapturer

    original = StepRoutingCapturer.prepare_pending_save

    def untrimmed(self, num_tokens, slot_mapping_gpu, position_ids_gpu=None):
        self.overlap_schedule = False
        return original(self, num_tokens, slot_mapping_gpu, position_ids_gpu)

    monkeypatch.setattr(StepRoutingCapturer, "prepare_pending_save", untrimmed)
    plan = RolloutPlan(num_rollouts=6, num_turns=1, user_tokens=(20, 40), seed=seed % 1000)
    _, report, _ = run_checked(plan, config("step", overlap_schedule=True))
    assert not report.passed


@pytest.mark.parametrize("generation", ["table", "step"])
def test_records_name_the_decoder_layers_of_their_rows(seed, generation, run_checked):
    """The tiny model's layer 0 is dense: its three MoE layers are decoder layers 1, 2, 3,
    and every record's layer map says so (a trainer aligning by layer takes the right rows)."""
    plan = RolloutPlan(num_rollouts=2, num_turns=1, seed=seed % 1000)
    run, report, store = run_checked(plan, EngineConfig(generation=generation))
    assert_passed(report)
    reader = RoutingReader(store)
    records = [reader.get(key) for key in store.list()]
    assert records and {record.layer_map for record in records} == {(1, 2, 3)}
