"""The harness engine as 2 real TP ranks (gloo on loopback): the same rollouts as the
single-process run give the same turns, the same records on rank 0's store, and 100%
fidelity -- under TP = 2 and under TP x EP = 2 x 2, where each rank routes only its token
share and the hook all-gathers over a real ``paddle.distributed`` group."""

from __future__ import annotations

import json
import sys
import uuid
from dataclasses import asdict

import numpy as np
import pytest

pytest.importorskip("paddle.distributed.launch", reason="Paddle's launcher is not installed")

from fd_routing_replay.reader import RoutingReader  # noqa: E402
from fd_routing_replay.store import open_store  # noqa: E402
from fdrr_dev.harness.engine import EngineConfig  # noqa: E402
from fdrr_dev.harness.fidelity import check_results  # noqa: E402
from fdrr_dev.harness.model import TinyMoEConfig, TinyMoEModel  # noqa: E402
from fdrr_dev.harness.paddle_runtime import paddle  # noqa: E402
from fdrr_dev.harness.parallel import ProcessRank, fan_out, tp_shards  # noqa: E402
from fdrr_dev.harness.rollouts import TurnResult  # noqa: E402
from fdrr_dev.harness.session import run_rollouts  # noqa: E402
from fdrr_dev.harness.tp_ranks import plan_from  # noqa: E402
from fdrr_dev.testing.ranks import launch_ranks, processes_with_token  # noqa: E402

RUNS = [
    {"name": "table_tp2_ep2", "engine": {"tp_size": 2, "ep_size": 2, "generation": "table"}},
    {"name": "step_tp2_ep2", "engine": {"tp_size": 2, "ep_size": 2, "generation": "step"}},
    {"name": "table_tp2", "engine": {"tp_size": 2, "ep_size": 1, "generation": "table"}},
]
ENTRY = "from fdrr_dev.harness.tp_ranks import main\nmain()\n"


def single_process(plan, generation, make_writer):
    """The reference: the same rollouts in one process, one rank, no parallelism."""
    url = f"memory://tp-ref-{uuid.uuid4().hex[:12]}"
    store = open_store(url)
    run = run_rollouts(plan, engine_config=EngineConfig(generation=generation), writer=make_writer(url))
    return run.results, RoutingReader(store)


def test_two_real_tp_ranks_match_the_single_process_run(tmp_path, seed, make_writer):
    plan_fields = {"num_rollouts": 4, "num_turns": 2, "seed": seed % 10_000}
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"plan": plan_fields, "runs": RUNS}))
    entry = tmp_path / "tp_rank.py"
    entry.write_text(ENTRY)
    out = tmp_path / "out"
    run = launch_ranks(entry, 2, log_dir=tmp_path / "log", args=["--spec", str(spec), "--out", str(out)],
                       python=sys.executable, timeout_s=240, env=None)
    assert processes_with_token(run.token) == []

    plan = plan_from(plan_fields)
    model = TinyMoEModel(TinyMoEConfig())
    references = {}
    for spec_run in RUNS:
        name, generation = spec_run["name"], spec_run["engine"]["generation"]
        if generation not in references:
            references[generation] = single_process(plan, generation, make_writer)
        ref_results, ref_reader = references[generation]
        results = [TurnResult(**r) for r in json.loads((out / name / "results.json").read_text())]
        # the same turns: ids, forwarded tokens and finish reasons of the single-process run
        assert [asdict(r) for r in results] == [asdict(r) for r in ref_results], name
        reader = RoutingReader(open_store(f"local://{out / name / 'store'}"))
        finished = [r for r in results if r.finish_reason in ("eos", "length")]
        assert finished, name
        for result in finished:
            got, want = reader.get(result.rollout_id), ref_reader.get(result.rollout_id)
            assert got is not None and want is not None, (name, result.rollout_id)
            np.testing.assert_array_equal(np.asarray(got.ids), np.asarray(want.ids),
                                          err_msg=f"{name} {result.rollout_id}")
        report = check_results(results, reader.get, lambda version: model,
                               expect_present=lambda r: r.finish_reason in ("eos", "length"))
        assert report.passed, name + ": " + report.summary() + "\n" + "\n".join(report.failures)
        assert report.decisive_disagreements == 0 and report.missing_records == 0
        for rank in range(2):      # every rank's hook ran on every step, without an error
            (stats,) = json.loads((out / name / f"rank{rank}.json").read_text())
            assert stats["hook_calls"] > 0 and stats["hook_errors"] == 0, (name, rank, stats)
            assert stats["hook_mismatches"] == 0, (name, rank, stats)


class RecordingGroup:
    """An in-process stand-in that shows what the hook hands a real group."""


def test_a_process_rank_gets_its_own_token_share_and_the_real_group(seed):
    rng = np.random.default_rng(seed)
    tokens = int(rng.integers(1, 12))
    ids = paddle.to_tensor(rng.integers(0, 8, size=(tokens, 2)).astype(np.int64))
    group = RecordingGroup()
    calls = []
    for tp, ep in ((2, 2), (2, 1)):
        for rank in range(tp):
            calls.clear()
            fan_out(lambda **kw: calls.append(kw), "buf", ["mine"], ids, tp, ep,
                    process_rank=ProcessRank(group, rank), layer_idx=0)
            (call,) = calls
            assert call["buf"] == "mine" and call["tp_group"] is group
            per_rank = -(-tokens // tp)
            want = np.zeros((per_rank * tp, 2), dtype=np.int64)
            want[:tokens] = ids.numpy()
            want = want[rank * per_rank:(rank + 1) * per_rank] if ep > 1 else ids.numpy()
            np.testing.assert_array_equal(call["topk_ids"].numpy(), want)
            if ep > 1:
                np.testing.assert_array_equal(call["topk_ids"].numpy(), tp_shards(ids, tp)[rank].numpy())
