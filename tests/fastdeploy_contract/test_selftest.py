"""Verification mode and ``fd-rr selftest``'s checks, through FastDeploy's own code.

With ``capture.verify`` on (``FD_RR_CAPTURE__VERIFY=true``, as an operator sets it next to
FastDeploy's ``--routing-replay-config``), FastDeploy's ``GpuWorker.initialize_cache``
installs our manager in verification mode; FastDeploy's ``FusedMoE.forward`` calls the hook,
its ``post_process_normal`` queues the rows, its token processor finalizes the request
(2.6), its PD hand-over and cache transfer manager move the rows; the record is read back
from the store and checked with the selftest's own row check.  Planted bugs (a recorder
with a wrong layer map, a PD hand-over without routes, a CPU swap-in without routes) must
fail the check, naming the first misplaced row.  The selftest's requests are validated by
FastDeploy's own ``ChatCompletionRequest`` and the responses it reads are built with
FastDeploy's own response models.
"""

from __future__ import annotations

import copy
import threading
import uuid
from types import MethodType, SimpleNamespace

import numpy as np
import pytest

fdctx = pytest.importorskip("fdctx", reason="FastDeploy is not importable (see conftest)")

from test_capture import EOS, STEP, finish_on_engine, read_back, run_request, start  # noqa: E402

from fd_routing_replay.cli.selftest_report import build_report  # noqa: E402
from fd_routing_replay.cli.selftest_workload import Workload, WorkloadSettings  # noqa: E402
from fd_routing_replay.errors import ConfigError, RecordError  # noqa: E402
from fd_routing_replay.keys import parse_request_id  # noqa: E402
from fd_routing_replay.reader.verification import check_record  # noqa: E402
from fd_routing_replay.trainers import routes  # noqa: E402

only_26 = pytest.mark.skipif(not STEP, reason="FastDeploy 2.6's routing paths (2.5 refuses PD and the CPU KV cache)")


@pytest.fixture
def verify(monkeypatch):
    """capture.verify on, as an operator sets it (FD_RR_* next to FastDeploy's flag)."""
    monkeypatch.setenv("FD_RR_CAPTURE__VERIFY", "true")


def test_verification_mode_through_fastdeploys_forward_passes_the_row_check(env, monkeypatch, verify):
    prompt_len, new_tokens = 37, 6
    fd_config, runner, engine, rid, routed, blocks = run_request(env, monkeypatch, prompt_len=prompt_len,
                                                                 new_tokens=new_tokens)
    verifier = runner.routing_replay_manager.binding.verify
    assert verifier is not None and verifier.code.num_experts == 300
    if STEP:
        finish_on_engine(runner, engine, rid, prompt_len, new_tokens, blocks)
    record = read_back(env, fd_config, runner, engine)
    verdict = check_record(record, expected_tokens=prompt_len + new_tokens - 1)
    assert verdict.ok, verdict.as_dict()
    assert record.metadata["verification"]["period"] == verifier.code.period
    assert list(record.layers) == [1, 2, 3, 4]
    assert not np.array_equal(record.ids, routed)          # the gate's routing is not what is stored
    with pytest.raises(RecordError, match="verification mode"):
        routes(record)


def test_a_recorder_with_a_wrong_layer_map_is_caught(env, monkeypatch, verify):
    """The recorder's map from FastDeploy's layer_idx to our rows swaps MoE layers 1 and 2
    (what a wrong moe_layer_start_index / first_k_dense_replace reading would do)."""
    from fd_routing_replay.integrations.fastdeploy import setup as fd_setup

    real = fd_setup.fastdeploy_layer_rows

    def swapped(model_config, layer_map):
        rows = list(real(model_config, layer_map))
        first, second = rows.index(0), rows.index(1)
        rows[first], rows[second] = 1, 0
        return tuple(rows)

    monkeypatch.setattr(fd_setup, "fastdeploy_layer_rows", swapped)
    prompt_len, new_tokens = 21, 4
    fd_config, runner, engine, rid, _, blocks = run_request(env, monkeypatch, prompt_len=prompt_len,
                                                            new_tokens=new_tokens)
    if STEP:
        finish_on_engine(runner, engine, rid, prompt_len, new_tokens, blocks)
    verdict = check_record(read_back(env, fd_config, runner, engine), expected_tokens=prompt_len + new_tokens - 1)
    assert not verdict.ok
    assert verdict.counts["layer"] == 2 * (prompt_len + new_tokens - 1)
    assert verdict.counts["position"] == verdict.counts["missing"] == 0
    first = verdict.first_fault
    assert (first.position, first.layer_row, first.decoder_layer) == (0, 0, 1)
    assert "holds MoE layer row 1's row (decoder layer 2)" in first.detail


def test_fastdeploys_debug_mode_points_at_capture_verify(env):
    if not hasattr(fdctx.make_fd_config(env).routing_replay_config, "debug_mode"):
        pytest.skip("this FastDeploy has no routing replay debug_mode")
    with pytest.raises(ConfigError, match="capture.verify"):
        start(env, routing={"debug_mode": True})


# ---------------------------------------------------------------------------- FastDeploy 2.6
@only_26
def test_pd_hand_over_checks_clean_and_a_hand_over_without_routes_is_named(env, monkeypatch, verify):
    from fastdeploy.engine.request import RequestMetrics
    from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1
    from test_serving import RID, Instance, blocks_for

    rng = np.random.default_rng(3)
    prefill = Instance(env, monkeypatch, "p", port=24711, role="prefill", seed=1)
    decode = Instance(env, monkeypatch, "d", port=24712, role="decode", seed=2)
    prompt_len, new_tokens = 29, 4
    used: list[int] = []
    try:
        for hand_over in (True, False):
            p_blocks = blocks_for(rng, 2, exclude=used)
            d_blocks = blocks_for(rng, 2, exclude=[*used, *p_blocks])      # never written on D
            used += [*p_blocks, *d_blocks]
            prefill._prompt_len = decode._prompt_len = prompt_len
            prefill.run(p_blocks, [(0, 16), (16, prompt_len - 16)], last=False)
            sent = prefill.finish(p_blocks, prompt_len, [11], is_prefill=True).routing_data
            request = SimpleNamespace(request_id=RID, idx=0, output_token_ids=[], block_tables=d_blocks.tolist(),
                                      prompt_token_ids=list(range(1000, 1000 + prompt_len)), metrics=RequestMetrics())
            manager = SimpleNamespace(lock=threading.Lock(), config=decode.fd_config, requests={RID: request},
                                      tasks_list=[None] * 8, running=[], routing_host_view=decode.routing_host_view)
            manager._write_prefill_routing_to_host_buffer = MethodType(
                ResourceManagerV1._write_prefill_routing_to_host_buffer, manager)
            output = SimpleNamespace(request_id=RID, outputs=SimpleNamespace(token_ids=[11], draft_token_ids=[]),
                                     num_cached_tokens=0, metrics=copy.deepcopy(RequestMetrics()),
                                     routing_data=sent if hand_over else None)
            ResourceManagerV1.add_prefilled_request(manager, output)
            decode.run(d_blocks, [(prompt_len + i, 1) for i in range(new_tokens - 1)])
            decode.finish(d_blocks, prompt_len, [11] + [7] * (new_tokens - 2) + [EOS])
            verdict = check_record(decode.record(), expected_tokens=prompt_len + new_tokens - 1)
            if hand_over:
                assert verdict.ok, verdict.as_dict()
            else:
                assert verdict.counts["missing"] == 4 * prompt_len and verdict.counts["position"] == 0
                first = verdict.first_fault
                assert (first.kind, first.position, first.layer_row) == ("missing", 0, 0)
    finally:
        prefill.close()
        decode.close()


@only_26
def test_cpu_swap_checks_clean_and_a_swap_in_without_routes_is_named(env, monkeypatch, verify):
    import logging

    from fastdeploy.cache_manager import cache_transfer_manager
    from fastdeploy.cache_manager.cache_transfer_manager import CacheTransferManager
    from test_serving import BLOCKS, Instance, blocks_for

    monkeypatch.setattr(cache_transfer_manager, "logger", logging.getLogger("cache_transfer"), raising=False)
    rng = np.random.default_rng(5)
    inst = Instance(env, monkeypatch, "i", port=24731, cache={"swap_space": 1})
    ctm = SimpleNamespace(routing_replay_config=inst.fd_config.routing_replay_config, num_cpu_blocks=16, rank=0,
                          engine_worker_queue_port=inst.fd_config.parallel_config.local_engine_worker_queue_port,
                          block_size=inst.block_size, num_gpu_blocks=BLOCKS, aux_data_specs={},
                          routing_host_view=None, routing_swap_buffer=None)
    CacheTransferManager._init_routing_aux_data(ctm)
    prompt_len = 40
    used: list[int] = []
    try:
        for index, swap_routes in enumerate((True, False)):
            gpu = blocks_for(rng, 3, exclude=used)
            back = blocks_for(rng, 3, exclude=[*used, *gpu])                 # never written
            used += [*gpu, *back]
            cpu = [3 * index, 3 * index + 1, 3 * index + 2]
            inst._prompt_len = prompt_len
            inst.run(gpu, [(0, prompt_len)], last=False)
            CacheTransferManager._swap_routing(ctm, list(gpu), cpu, "to_cpu")
            if swap_routes:
                CacheTransferManager._swap_routing(ctm, list(back), cpu, "to_gpu")
            inst.run(back, [(prompt_len + i, 1) for i in range(3)])
            rollout = f"exp_1:{20 + index}:0:0"
            inst.engine.routing.finish(f"chatcmpl-{rollout}-{uuid.UUID(int=index)}_0", back, prompt_len + 3)
            verdict = check_record(inst.record(rollout), expected_tokens=prompt_len + 3)
            if swap_routes:
                assert verdict.ok, verdict.as_dict()
            else:
                assert verdict.counts["missing"] == 4 * prompt_len
                assert (verdict.first_fault.kind, verdict.first_fault.position) == ("missing", 0)
    finally:
        for name in ("routing_swap_buffer", "routing_host_view"):
            if getattr(ctm, name, None) is not None:
                getattr(ctm, name).close()
        inst.close()


# ---------------------------------------------------------------------------- the OpenAI API
def fastdeploy_server(prompt_tokens=23):
    """A transport that answers as FastDeploy's serving layer would, with FastDeploy's own
    request and response models: the body must be a valid ChatCompletionRequest."""
    from fastdeploy.entrypoints.openai import protocol

    seen = []

    def post(url, body, timeout):
        request = protocol.ChatCompletionRequest(**body)                     # FastDeploy accepts it
        request_id = f"chatcmpl-{request.user}-{uuid.uuid4()}"              # serving_chat.py:138-139
        infer = request.to_dict_for_infer(f"{request_id}_0")
        assert infer["request_id"] == f"{request_id}_0" and infer.get("return_token_ids") is True
        seen.append((request, request_id))
        choices = [protocol.ChatCompletionResponseChoice(
            index=i, finish_reason="stop",
            message=protocol.ChatMessage(role="assistant", content="ok", completion_token_ids=[7] * (3 + i)))
            for i in range(request.n)]
        completion = sum(3 + i for i in range(request.n))
        usage = protocol.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                                   total_tokens=prompt_tokens + completion)
        return protocol.ChatCompletionResponse(id=request_id, model=request.model, choices=choices,
                                               usage=usage).model_dump()

    return post, seen


def test_the_selftest_speaks_fastdeploys_openai_api():
    post, seen = fastdeploy_server()
    workload = Workload("http://fastdeploy", WorkloadSettings(model="ernie", choices=3, long_prompt_words=50),
                        "fdrr-selftest-1-abc", post=post)
    workload.first_phase()
    workload.second_phase()
    assert len(seen) == 7 and all(e.error is None for e in workload.exchanges)
    for request, request_id in seen:
        # the engine requests FastDeploy makes of it (engine_client.py:417-431) and their records
        for choice in range(request.n):
            parsed = parse_request_id(f"{request_id}_{choice}")
            assert parsed.base.startswith("fdrr-selftest-1-abc_")
    wanted = {rid: expected for e in workload.exchanges for rid, expected in e.records()}
    assert len(wanted) == 9                                  # 6 requests of n = 1, one of n = 3
    assert wanted["fdrr-selftest-1-abc_choices:0_n2:0:0"] == 23 + 5 - 1
    assert wanted["fdrr-selftest-1-abc_chat:0:1:0"] == 23 + 3 - 1
    report = build_report("http://fastdeploy", "memory://", workload.run, workload.exchanges,
                          dict.fromkeys(wanted))
    assert not report.ok                                     # nothing was stored
    assert {c.name for c in report.checks if c.status == "fail"} >= {"records"}
