"""``fd-rr selftest`` against the harness engine behind a real OpenAI-compatible HTTP front.

Each test starts :func:`harness_server` (the harness engine wired from a config as the
plugin wires FastDeploy: records go through the background writer into a local store, the
MoE hook in verification mode) on a free loopback port and runs ``fd-rr selftest`` through
the CLI's ``main`` against it.  The workload is small enough for two CPU cores but reaches
prefix-cache hits, a chunked prefill (the harness's prefill chunk is 48 tokens), ``n = 2``
and two turns.  Scenarios add TP x EP, PD disaggregation, the CPU KV cache and preemption;
planted bugs (an off-by-one in positions, swapped layer rows, a CPU swap that leaves the
routes behind, a PD hand-over without routes, a TP x EP all-gather in the wrong order)
must each fail the selftest, naming the first misplaced row.
"""

from __future__ import annotations

import json

import pytest

from fd_routing_replay.cli.app import main
from fd_routing_replay.config import load_config
from fd_routing_replay.store import open_store
from fdrr_dev.harness.engine import EngineConfig
from fdrr_dev.harness.openai_server import harness_server
from fdrr_dev.harness.paddle_runtime import paddle
from fdrr_dev.harness.verification import engines_of

WORKLOAD = ["--shared-prefix-words", "12", "--long-prompt-words", "40", "--max-tokens", "12",
            "--timeout", "60", "--request-timeout", "120"]
SMALL_KV = dict(num_blocks=40, max_num_seqs=8)


def config(root, **capture):
    return load_config(overrides={"enabled": True, "store": {"type": "local", "local": {"root": str(root)}},
                                  "capture": {"verify": True, **capture},
                                  "writer": {"mode": "thread", "capacity_bytes": 16 << 20}})


def selftest(capsys, server, root, *extra):
    """Run ``fd-rr selftest --json`` against ``server``; (exit status, report)."""
    status = main(["selftest", "--url", server.url, "--store", f"local://{root}", "--json", *WORKLOAD, *extra])
    return status, json.loads(capsys.readouterr().out)


def checks(report):
    return {check["name"]: check for check in report["checks"]}


def assert_all_pass(status, report, *, skipped=("tp_ep_gather",)):
    statuses = {name: check["status"] for name, check in checks(report).items()}
    assert status == 0 and report["ok"], statuses
    assert all(s == "pass" for n, s in statuses.items() if n not in skipped), statuses
    assert report["first_misplaced_row"] is None


@pytest.mark.parametrize("generation", ["step", "table"])
def test_selftest_passes_on_a_correct_engine(tmp_path, capsys, seed, generation):
    """Both FastDeploy generations; the report covers every check, the run's records are
    deleted afterwards, and the text form names every check with PASS."""
    with harness_server(config(tmp_path), engine_config=EngineConfig(generation=generation), seed=seed) as server:
        status, report = selftest(capsys, server, tmp_path)
        engine = server.engine
    assert_all_pass(status, report)
    assert [c["name"] for c in report["checks"]] == [
        "requests", "records", "token_counts", "complete_rows", "recorded_values", "positions",
        "layer_rows", "tp_ep_gather", "prefix_cache", "chunked_prefill", "n_choices", "multi_turn"]
    assert len(report["records"]) == 8                          # 7 requests, one with n = 2
    assert {r["rollout_id"].split("_", 1)[1] for r in report["records"]} >= {
        "choices:0:0:0", "choices:0_n1:0:0", "chat:0:0:0", "chat:0:1:0"}
    long = next(r for r in report["records"] if "_long:" in r["rollout_id"])
    assert long["num_tokens"] > engine.config.max_num_batched_tokens      # its prefill was chunked
    assert open_store(f"local://{tmp_path}").list(report["run"]) == []      # cleaned up


def test_selftest_text_report_and_keep(tmp_path, capsys, seed):
    with harness_server(config(tmp_path), seed=seed) as server:
        status = main(["selftest", "--url", server.url, "--store", f"local://{tmp_path}", "--keep", *WORKLOAD])
    out = capsys.readouterr().out
    assert status == 0
    lines = out.splitlines()
    assert lines[-1] == "result: PASS"
    for name in ("positions", "layer_rows", "prefix_cache", "n_choices", "multi_turn"):
        assert any(line.startswith("PASS") and f" {name} " in line for line in lines), out
    run = lines[0].split("(run ")[1].split(",")[0]
    kept = open_store(f"local://{tmp_path}").list(run)
    assert len(kept) == 8


@pytest.mark.parametrize("scenario", [
    pytest.param(dict(engine_config=EngineConfig(generation="step", tp_size=2, ep_size=2)), id="tp2xep2"),
    pytest.param(dict(engine_config=EngineConfig(generation="table", tp_size=2, ep_size=2)), id="tp2xep2-table"),
    pytest.param(dict(engine_config=EngineConfig(generation="step", **SMALL_KV, num_cpu_blocks=32)), id="cpu-cache"),
    pytest.param(dict(engine_config=EngineConfig(generation="step"), disaggregated=True), id="pd"),
    pytest.param(dict(engine_config=EngineConfig(generation="step", num_blocks=40)), id="preemption"),
])
def test_selftest_passes_in_every_scenario(tmp_path, capsys, seed, scenario):
    engine_config = scenario["engine_config"]
    if engine_config.num_cpu_blocks:
        status, report, instances = selftest_through_the_cpu_tier(tmp_path, capsys, seed, engine_config)
    else:
        with harness_server(config(tmp_path), seed=seed, **scenario) as server:
            status, report = selftest(capsys, server, tmp_path)
            instances = engines_of(server.engine)
    gathered = engine_config.tp_size > 1 and engine_config.ep_size > 1
    assert_all_pass(status, report, skipped=() if gathered else ("tp_ep_gather",))
    if gathered:          # both ranks' shards reached the records through the all-gather
        assert "rank 0" in checks(report)["tp_ep_gather"]["detail"]
        assert "rank 1" in checks(report)["tp_ep_gather"]["detail"]
    if engine_config.num_cpu_blocks:
        transfer = instances[0].blocks.swapper
        assert transfer.blocks_moved["to_gpu"] > 0 and transfer.moved_elsewhere > 0
    if scenario.get("disaggregated"):
        assert server.engine.handed_over == 7 + 1
    if engine_config.num_blocks == 40 and not engine_config.num_cpu_blocks:
        assert instances[0].preemptions > 0


def selftest_through_the_cpu_tier(tmp_path, capsys, seed, engine_config):
    """(status, report, engines) of a self-test run in which a cached block went to the CPU
    tier and came back into another GPU block.  Whether one does depends on how the HTTP
    requests interleave with the engine's steps (about 1 run in 10 moves none), so the
    workload runs again on a fresh server until one did: six runs all moving none, ~1e-6."""
    for attempt in range(6):
        root = tmp_path / f"run{attempt}"
        with harness_server(config(root), engine_config=engine_config, seed=seed + attempt) as server:
            status, report = selftest(capsys, server, root)
            instances = engines_of(server.engine)
        swapper = instances[0].blocks.swapper
        if swapper.blocks_moved["to_gpu"] > 0 and swapper.moved_elsewhere > 0:
            return status, report, instances
    pytest.fail("six runs of the workload never moved a block through the CPU tier and back")


def first_row(report):
    row = report["first_misplaced_row"]
    assert row is not None, report["checks"]
    return row


def failed(report):
    return {name for name, check in checks(report).items() if check["status"] == "fail"}


def test_planted_off_by_one_in_positions_is_caught(tmp_path, capsys, seed):
    """The worker's slot mapping is one KV slot off (FastDeploy's ``prepare_pending_save``
    gets ``slot + 1``): position p of a request holds position p - 1's row."""
    with harness_server(config(tmp_path), seed=seed) as server:
        capturer = server.engine.runner.managers[0]
        prepare = capturer.prepare_pending_save
        capturer.prepare_pending_save = lambda n, slots, positions=None: prepare(n, slots + 1, positions)
        status, report = selftest(capsys, server, tmp_path)
    assert status == 1 and not report["ok"]
    assert "positions" in failed(report)
    row = first_row(report)
    assert row["rollout_id"].endswith("_shared0:0:0:0")          # the first request sent
    assert (row["kind"], row["position"], row["layer_row"]) == ("missing", 0, 0)   # slot 0 never written
    shifted = checks(report)["positions"]["detail"]
    assert "_shared0:0:0:0, position 1, MoE layer row 0 (decoder layer 1): holds the row of position 0, -1" \
        in shifted


@pytest.mark.parametrize("generation", ["step", "table"])
def test_planted_swapped_layer_rows_are_caught(tmp_path, capsys, seed, generation):
    """The recorder writes MoE layers 0 and 1 into each other's rows."""
    with harness_server(config(tmp_path), engine_config=EngineConfig(generation=generation), seed=seed) as server:
        binding = server.engine.runner.managers[0].binding
        record = binding.record
        binding.record = lambda ids, layer, rows: record(ids, {0: 1, 1: 0}.get(layer, layer), rows)
        status, report = selftest(capsys, server, tmp_path)
    assert status == 1
    assert "layer_rows" in failed(report) and "positions" not in failed(report)
    row = first_row(report)
    assert (row["kind"], row["position"], row["layer_row"], row["decoder_layer"]) == ("layer", 0, 0, 1)
    assert "holds MoE layer row 1's row (decoder layer 2)" in row["detail"]


@pytest.mark.parametrize("generation", ["step", "table"])
def test_planted_call_site_passing_another_layers_index_is_caught(tmp_path, capsys, seed, generation,
                                                                  monkeypatch):
    """FusedMoE's call site passes layer_idx 1 for the first MoE layer and 0 for the second
    (a wrong moe_layer_start_index subtraction): verification takes the layer from the order
    of the hook's calls, so each layer's known values land in the other's row."""
    from fdrr_dev.harness import parallel

    fan_out = parallel.fan_out

    def swapped(save, target, targets, topk_ids, tp, ep, process_rank=None, **common):
        common["layer_idx"] = {0: 1, 1: 0}.get(common["layer_idx"], common["layer_idx"])
        return fan_out(save, target, targets, topk_ids, tp, ep, process_rank=process_rank, **common)

    monkeypatch.setattr(parallel, "fan_out", swapped)
    with harness_server(config(tmp_path), engine_config=EngineConfig(generation=generation), seed=seed) as server:
        status, report = selftest(capsys, server, tmp_path)
    assert status == 1
    assert "layer_rows" in failed(report) and "positions" not in failed(report)
    row = first_row(report)
    assert (row["kind"], row["position"], row["layer_row"], row["decoder_layer"]) == ("layer", 0, 0, 1)
    assert "holds MoE layer row 1's row (decoder layer 2)" in row["detail"]


@pytest.mark.parametrize("generation", ["step", "table"])
def test_planted_layer_that_never_calls_the_hook_is_named(tmp_path, capsys, seed, generation, monkeypatch):
    """The second MoE layer never calls the hook: its rows of every step are unknown and the
    report names that layer first (the call order verification counts then drifts too, so
    later layers' rows are reported as misplaced as well)."""
    from fdrr_dev.harness import parallel

    fan_out = parallel.fan_out

    def skipping(save, target, targets, topk_ids, tp, ep, process_rank=None, **common):
        if common["layer_idx"] != 1:
            fan_out(save, target, targets, topk_ids, tp, ep, process_rank=process_rank, **common)

    monkeypatch.setattr(parallel, "fan_out", skipping)
    with harness_server(config(tmp_path), engine_config=EngineConfig(generation=generation), seed=seed) as server:
        status, report = selftest(capsys, server, tmp_path)
    assert status == 1 and "complete_rows" in failed(report)
    row = first_row(report)
    assert (row["kind"], row["position"], row["layer_row"]) == ("missing", 0, 1)


def test_planted_cpu_swap_without_routes_is_caught(tmp_path, capsys, seed):
    """The CPU KV cache swaps the KV back into other GPU blocks but not the routes: caught
    in a run that moved a block elsewhere."""
    engine_config = EngineConfig(generation="step", **SMALL_KV, num_cpu_blocks=32, cpu_swap_routing=False)
    status, report, _ = selftest_through_the_cpu_tier(tmp_path, capsys, seed, engine_config)
    assert status == 1
    assert "prefix_cache" in failed(report)
    assert first_row(report)["kind"] in ("missing", "position", "layer")


def test_planted_pd_hand_over_without_routes_is_caught(tmp_path, capsys, seed):
    with harness_server(config(tmp_path), disaggregated={"hand_over_routing": False}, seed=seed) as server:
        status, report = selftest(capsys, server, tmp_path)
    assert status == 1
    assert "complete_rows" in failed(report)
    row = first_row(report)
    assert (row["kind"], row["position"]) == ("missing", 0)


def test_planted_all_gather_in_the_wrong_order_is_caught(tmp_path, capsys, seed, monkeypatch):
    """TP x EP: the all-gather puts rank 1's shard first."""
    from fd_routing_replay.capture import device as hook

    gather = hook.gather_topk_over_tp

    def reversed_gather(topk_ids, tp_size, tp_group):
        rows = gather(topk_ids, tp_size, tp_group)
        shard = rows.shape[0] // tp_size
        return paddle.concat([rows[shard:], rows[:shard]]) if tp_size == 2 else rows  # rank 1 first

    monkeypatch.setattr(hook, "gather_topk_over_tp", reversed_gather)
    engine_config = EngineConfig(generation="step", tp_size=2, ep_size=2)
    with harness_server(config(tmp_path), engine_config=engine_config, seed=seed) as server:
        status, report = selftest(capsys, server, tmp_path)
    assert status == 1
    assert "tp_ep_gather" in failed(report)
    row = first_row(report)
    assert row["kind"] == "gather" and "TP rank 0's share" in row["detail"]


def test_selftest_fails_when_verification_is_off(tmp_path, capsys, seed):
    """Real routing in the records: every record fails 'records', exit status 1."""
    with harness_server(config(tmp_path, verify=False), seed=seed) as server:
        status, report = selftest(capsys, server, tmp_path)
    assert status == 1 and "records" in failed(report)
    assert "not a verification record" in checks(report)["records"]["detail"]


def test_selftest_reports_a_server_it_cannot_reach(tmp_path, capsys):
    status = main(["selftest", "--url", "http://127.0.0.1:9", "--model", "m", "--store",
                   f"local://{tmp_path}", *WORKLOAD])
    assert status == 1
    out = capsys.readouterr()
    assert "FAIL  requests" in out.out and "cannot reach the server" in out.out


def test_the_harness_front_answers_like_fastdeploys_api(tmp_path, seed):
    """Routes, FastDeploy's request ids and usage, and 400s that say what was wrong."""
    from fd_routing_replay.cli.selftest_workload import http_json
    from fd_routing_replay.keys import parse_request_id

    with harness_server(config(tmp_path), seed=seed) as server:
        assert http_json(f"{server.url}/v1/models")["data"][0]["id"] == "fdrr-harness"
        assert http_json(f"{server.url}/health") == {"status": "ok"}
        body = {"model": "fdrr-harness", "messages": [{"role": "user", "content": "hello there"}],
                "user": "exp_3:1:0:0", "n": 2, "max_tokens": 5, "return_token_ids": True}
        answer = http_json(f"{server.url}/v1/chat/completions", body)
        assert parse_request_id(answer["id"] + "_1").text == "exp_3:1_n1:0:0"       # base exp_3:1
        assert [c["index"] for c in answer["choices"]] == [0, 1]
        assert answer["usage"]["prompt_tokens"] == 1 + len("hello there") + 1
        assert answer["usage"]["completion_tokens"] == sum(
            len(c["message"]["completion_token_ids"]) for c in answer["choices"])
        assert all(c["finish_reason"] in ("stop", "length") for c in answer["choices"])
        for bad, message in (({"stream": True}, "stream is not supported"), ({"n": 0}, "n must be"),
                             ({"messages": []}, "messages must be"), ({"max_tokens": 600}, "max_model_len")):
            with pytest.raises(ConnectionError, match=f"HTTP 400.*{message}"):
                http_json(f"{server.url}/v1/chat/completions", {**body, **bad})
        with pytest.raises(ConnectionError, match="HTTP 404"):
            http_json(f"{server.url}/v1/completions", body)
