"""Tensor, expert and data parallel capture, run for real: several processes, real collectives.

Each test starts its ranks with ``paddle.distributed.launch`` (a gloo world on CPU,
loopback only, bounded in time; :mod:`fdrr_dev.testing.ranks`).  Every rank runs
FastDeploy's own code around our plugin (see ``parallel_rank.py``): FastDeploy's
distributed start-up and communication groups, ``GpuWorker.initialize_cache``,
``FusedMoE.forward`` binding our hook with the real ``tp_group``, FastDeploy's token split,
``post_process_normal``.  With FastDeploy 2.6 this process plays the engine of each DP
rank: it owns the shared slot cache the workers write (``EngineRoutingManager``) and
finishes requests through FastDeploy's token processor; with 2.5 / develop TP rank 0 of
each DP rank writes.  Every record, every rank's step buffer and every rank's own top-k
share is compared with a numpy reference computed here.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

fdctx = pytest.importorskip("fdctx", reason="FastDeploy is not importable (see conftest)")

import parallel_spec as ps  # noqa: E402
from conftest import SOURCE  # noqa: E402

from fd_routing_replay import RoutingReader, open_store  # noqa: E402
from fd_routing_replay.integrations.fastdeploy import api as fd_api  # noqa: E402
from fdrr_dev.testing.process import free_port  # noqa: E402
from fdrr_dev.testing.ranks import launch_ranks, processes_with_token  # noqa: E402

HERE = Path(__file__).resolve().parent
STEP = fdctx.GENERATION == fd_api.STEP_BUFFER
TOP_K = 4
FILL = np.iinfo(np.uint16).max
RANK_TIMEOUT_S = 150


def _engines(spec):
    """2.6: one engine per DP rank (this process plays each), with that engine's config."""
    from fd_routing_replay.integrations.fastdeploy.engine import EngineRoutingManager

    configs = [ps.engine_config(spec, d) for d in range(spec["dp"])]
    return [(EngineRoutingManager(cfg, ps.NUM_BLOCKS), cfg) for cfg in configs]


def _finish_on_engine(engine, engine_cfg, request):
    """2.6: FastDeploy's token processor finalizes a finished request (token_processor.py:592-632)."""
    from fastdeploy.plugins.token_processor import load_token_processor_plugins

    cls = load_token_processor_plugins()
    processor = cls.__new__(cls)
    processor.cfg = engine_cfg
    processor.routing_cache_manager = engine
    output = list(range(request["new_tokens"]))
    task = SimpleNamespace(prompt_token_ids_len=request["prompt_len"], output_token_ids=output,
                           prompt_token_ids=list(range(1000, 1000 + request["prompt_len"])),
                           eos_token_ids=[output[-1]], block_tables=request["blocks"])
    result = SimpleNamespace(finished=True, error_code=200, routing_data=None)
    processor._finalize_routing(request["request_id"], task, result)


def run(tmp_path, **kwargs):
    """Start the ranks of one scenario; return (spec, per-rank results, records, engine stats)."""
    out = tmp_path / "out"
    out.mkdir()
    dp = kwargs.get("dp", 1)
    spec = ps.make_spec(out_dir=out, store_dir=tmp_path / "store", ports=[free_port() for _ in range(dp)],
                        **kwargs)
    spec_path = ps.write_spec(spec, tmp_path / "spec.json")
    model_config = out / "model" / "config.json"
    written = model_config.stat().st_mtime_ns
    engines = _engines(spec) if STEP else []
    env = dict(os.environ, FD_PLUGINS="fd_routing_replay", FD_RR_WRITER__MODE="thread",
               FD_LOG_DIR=str(tmp_path / "fdlog"), PYTHONUNBUFFERED="1")
    if SOURCE is not None:
        env["FD_SOURCE_DIR"] = str(Path(SOURCE).resolve())
    engine_stats = []
    try:
        ranks = launch_ranks(HERE / "parallel_rank.py", spec["world"], log_dir=tmp_path / "ranks",
                             args=[str(spec_path)], env=env, timeout_s=RANK_TIMEOUT_S,
                             python=sys.executable, cwd=tmp_path)
        assert processes_with_token(ranks.token) == []          # nothing of the run is left
        # The ranks only read the model's config.json (one rank rewriting it while another
        # read it failed the run, about 1 in 30).
        assert model_config.stat().st_mtime_ns == written
        for (engine, engine_cfg), schedule in zip(engines, spec["schedules"][: len(engines)], strict=True):
            for request in schedule["requests"]:
                _finish_on_engine(engine, engine_cfg, request)
            engine_stats.append(engine.stats())
    finally:
        for engine, _ in engines:
            engine.close()
    results = []
    for rank in range(spec["world"]):
        info = json.loads((out / f"rank{rank}.json").read_text())
        info["arrays"] = dict(np.load(out / f"rank{rank}.npz"))
        results.append(info)
    reader = RoutingReader(open_store(f"local://{tmp_path / 'store'}"))
    records = {r["rollout_id"]: reader.get(r["rollout_id"])
               for schedule in spec["schedules"] for r in schedule["requests"]}
    return spec, results, records, engine_stats


# ------------------------------------------------------------------ the reference
def _share(keys: np.ndarray, tp_rank: int, tp: int) -> np.ndarray:
    """A TP rank's share of the step's tokens as FastDeploy splits them (normalization.py:
    172-190, moe.py:707-717 in 2.6): ceil(n / tp) rows, the last share zero-padded."""
    per_rank = (len(keys) + tp - 1) // tp
    part = np.zeros(per_rank, dtype=np.int64)                   # key 0: a padding row
    start, end = min(tp_rank * per_rank, len(keys)), min((tp_rank + 1) * per_rank, len(keys))
    part[: end - start] = keys[start:end]
    return part


def _step_inputs(schedule, step, bsz=8):
    lens, decoded = [0] * bsz, [0] * bsz
    for slot, n, d in schedule["steps"][step]:
        lens[slot], decoded[slot] = n, d
    return ps.step_keys(schedule, lens, decoded)


def _splits(spec, num_tokens):
    """Whether FastDeploy hands each TP rank its own share of the step's tokens: TP x EP,
    in the input norm (sequence-parallel MoE) or in FusedMoE.forward_split_allgather when
    the step has at least tp tokens (moe.py:769-777)."""
    return spec["ep"] and spec["tp"] > 1 and (spec["sequence_parallel"] or num_tokens >= spec["tp"])


def check_ranks(spec, results):
    """Every rank's own top-k share and its step buffer after the step, against numpy."""
    tables = ps.gate_tables(spec)
    faults = {(f["rank"], f["step"], f["layer"]) for f in spec["faults"]}
    for info in results:
        schedule = spec["schedules"][info["dp_rank"]]
        checked = 0
        for step in range(len(schedule["steps"])):
            keys = _step_inputs(schedule, step)
            if len(keys) == 0:
                assert f"topk_{step}" not in info["arrays"]
                continue
            routed = _share(keys, info["tp_rank"], spec["tp"]) if _splits(spec, len(keys)) else keys
            softmax = bool(spec.get("eplb"))
            want = np.stack([ps.reference_topk(t, routed, TOP_K, softmax) for t in tables])
            np.testing.assert_array_equal(info["arrays"][f"topk_{step}"], want)
            full = np.stack([ps.reference_topk(t, keys, TOP_K, softmax) for t in tables]).transpose(1, 0, 2)
            got = info["arrays"][f"buffer_{step}"]
            for layer in range(len(tables)):
                if (info["rank"], step, layer) in faults:
                    continue            # that layer was never written this step
                np.testing.assert_array_equal(got[:, layer], full[:, layer].astype(np.uint16))
            checked += 1
        assert checked > 0
        errors = sum(1 for f in spec["faults"] if f["rank"] == info["rank"])
        assert info["stats"]["hook_errors"] == errors, info["stats"]
        assert info["stats"]["hook_mismatches"] == 0


def lost_steps(spec, dp_rank):
    """Steps whose rows a failed hook on the saving rank (TP rank 0) of ``dp_rank`` lost."""
    saving = dp_rank * spec["tp"]
    return {f["step"] for f in spec["faults"] if f["rank"] == saving}


def check_records(spec, records):
    for d, schedule in enumerate(spec["schedules"]):
        for request in schedule["requests"]:
            record = records[request["rollout_id"]]
            lost = lost_steps(spec, d)
            active = range(request["start_step"], request["start_step"] + request["new_tokens"])
            if not STEP and lost.intersection(active):
                # 2.5 / develop: a failed hook marks the step's requests lost, and a lost
                # request gets no record (counted as records_failed), never a wrong one.
                assert record is None, request["rollout_id"]
                continue
            assert record is not None, request["rollout_id"]
            want = ps.expected_record(spec, request, TOP_K, lost)
            assert record.ids.shape == want.shape
            np.testing.assert_array_equal(record.ids, want)
            missing = int((want == FILL).any(axis=(0, 2)).sum())
            assert int(record.metadata.get("missing_tokens", 0)) == missing


# ------------------------------------------------------------------ the cases
UNEVEN = [  # prefills of different lengths in one step, decodes joining and leaving
    {"prompt_len": 21, "new_tokens": 4, "start_step": 0},
    {"prompt_len": 6, "new_tokens": 6, "start_step": 0},
    {"prompt_len": 1, "new_tokens": 3, "start_step": 2},
]


def test_tp2_every_rank_routes_all_tokens_and_rank0_saves(tmp_path):
    """TP = 2 (no EP): attention TP, every rank runs the MoE on all tokens (moe.py:780-786);
    the hook gathers nothing (routing_indices_cache.py:80); TP rank 0 saves."""
    spec, results, records, engine_stats = run(
        tmp_path, tp=2, requests=[UNEVEN], faults=[{"rank": 1, "step": 1, "layer": 2}])
    assert [r["tp_group_ranks"] for r in results] == [[0, 1], [0, 1]]
    assert [(r["tp_size"], r["ep_size"]) for r in results] == [(2, 1), (2, 1)]
    check_ranks(spec, results)
    check_records(spec, records)            # rank 1's failed layer costs nothing: rank 0 saves
    if STEP:
        assert results[0]["stats"]["steps"] == len(spec["schedules"][0]["steps"])
        assert results[1]["stats"]["steps"] == 0
        # TP rank 1 saves nothing, but its failed hook reaches the engine's metrics.
        ranks = engine_stats[0]["ranks"]
        assert set(ranks) == {"dp0-tp0", "dp0-tp1"}
        assert (ranks["dp0-tp0"]["hook_errors"], ranks["dp0-tp1"]["hook_errors"]) == (0, 1)
        assert ranks["dp0-tp1"]["hook_calls"] == results[1]["stats"]["hook_calls"] > 0


ALONE = UNEVEN + [{"prompt_len": 3, "new_tokens": 3, "start_step": 6}]
"""... then one request alone: one token per decode step, fewer than the TP ranks."""


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sequence-parallel-moe", "split-allgather"])
def test_tp2_x_ep_each_rank_routes_its_share_and_the_hook_gathers(tmp_path, sequence_parallel):
    """TP x EP as FastDeploy configures it: TP 2 with enable_expert_parallel makes EP 2
    (config.py:686-689); each TP rank routes ceil(n / 2) tokens, the last share padded; the
    hook all-gathers over the TP group and drops the padding (total_token_num).  One hook
    fails on each rank: counted there, the step goes on; rank 0's loss marks its rows."""
    faults = [{"rank": 1, "step": 3, "layer": 0}, {"rank": 0, "step": 1, "layer": 1}]
    spec, results, records, _ = run(tmp_path, tp=2, ep=True, sequence_parallel=sequence_parallel,
                                    requests=[ALONE], faults=faults, seed=1)
    assert [(r["tp_size"], r["ep_size"], r["sequence_parallel"]) for r in results] == \
        [(2, 2, sequence_parallel)] * 2
    steps = spec["schedules"][0]["steps"]
    sizes = [sum(n for _, n, _ in entries) for entries in steps]
    assert 1 in sizes and any(n % 2 for n in sizes)           # a rank with no real token; padding
    check_ranks(spec, results)
    check_records(spec, records)


def test_ep_with_dp_one_writer_and_one_journal_per_dp_rank(tmp_path):
    """EP + DP: DP 2 x TP 1 with expert parallelism (EP 2); each DP rank routes its own
    requests, DP rank 1 idles for the first steps (FastDeploy's empty-input forward, no hook),
    and each DP rank has its own writer and journal."""
    late = [{"prompt_len": 9, "new_tokens": 4, "start_step": 3}]
    faults = [{"rank": 1, "step": 4, "layer": 3}]
    spec, results, records, engine_stats = run(tmp_path, tp=1, dp=2, ep=True, requests=[UNEVEN, late],
                                               faults=faults, seed=2)
    assert [(r["dp_rank"], r["tp_rank"], r["ep_size"]) for r in results] == [(0, 0, 2), (1, 0, 2)]
    assert [r["tp_group_ranks"] for r in results] == [[0], [1]]
    check_ranks(spec, results)
    check_records(spec, records)
    if not STEP:     # DP rank 1's only request was in the failed step: counted, not written
        assert results[1]["stats"]["records_failed"] == 1 and results[0]["stats"]["records_failed"] == 0
    journals = sorted(p.name for p in (tmp_path / "store" / ".fdrr" / "routing_replay" / "journal").iterdir())
    assert len(journals) == 2 and journals[0].startswith("dp0-") and journals[1].startswith("dp1-"), journals
    if STEP:
        assert [set(s["ranks"]) for s in engine_stats] == [{"dp0-tp0"}, {"dp1-tp0"}]


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sequence-parallel-moe", "split-allgather"])
def test_tp2_x_ep_under_eplb_records_logical_experts(tmp_path, sequence_parallel):
    """EPLB with 8 redundant experts under TP 2 x EP 2: each rank selects its own share with
    FastDeploy's EPRunner.moe_select (physical replica slots, test_eplb.py's kernel stand-in),
    maps them through its own copy of FastDeploy's placement table in the hook, and the hook
    all-gathers logical ids; FastDeploy's rebalance runs on every rank before step 3, in the
    middle of the requests, before another request's prefill.  Every rank's step buffer and
    every record equal the router's logical top-k; some tokens did go to redundant slots
    (>= 300), before and after."""
    faults = [{"rank": 1, "step": 4, "layer": 2}]
    late = [{"prompt_len": 30, "new_tokens": 2, "start_step": 4}]
    spec, results, records, _ = run(tmp_path, tp=2, ep=True, sequence_parallel=sequence_parallel,
                                    requests=[UNEVEN + late], faults=faults, seed=3,
                                    eplb={"redundant": 8, "rebalance_step": 3})
    check_ranks(spec, results)
    check_records(spec, records)
    for info in results:
        slots = [(step, info["arrays"][f"physical_{step}"]) for step in range(len(spec["schedules"][0]["steps"]))
                 if f"physical_{step}" in info["arrays"]]
        assert any((s >= 300).any() for step, s in slots if step < 3)
        assert any((s >= 300).any() for step, s in slots if step >= 3)
        assert "rebalanced_table" in info["arrays"]
    np.testing.assert_array_equal(results[0]["arrays"]["rebalanced_table"], results[1]["arrays"]["rebalanced_table"])
    for record in records.values():
        assert record.metadata["eplb_redundant_experts"] == 8
