"""Partial records (``capture.partial_every_tokens``, #25 part 4) through FastDeploy's own code.

2.5 / develop (table API): each step is FastDeploy's ``FusedMoE.forward`` and
``post_process_normal`` (whose routing block calls ``put_finished_batch``, where our manager
checks its slots), with the runner-side registration and the abort's ``clear_request`` made
as the runner makes them (gpu_model_runner.py:825, :869).

2.6 (step buffer): the worker side as in ``test_serving.Instance``; every step's sampled
token goes through the engine's ``TokenProcessor._process_batch_output_use_zmq`` →
``_process_per_token``, which calls ``_record_metrics`` (token_processor.py:295, ours reports
the request's progress there) and, at EOS, ``_finalize_routing`` (:340).  An abort is
FastDeploy's: the worker's ``PREEMPTED_TOKEN_ID`` for a request in
``to_be_aborted_req_id_set`` makes the token processor recycle it and put the abort result
(:357-367, ``_put_abort_results`` at :1289) — no finalize, so the last partial stays.
``_process_batch_output`` (the non-zmq path) is checked to call ``_record_metrics`` before it
appends the step's tokens, as the zmq path does.

In both, after a step the writer is flushed and the store is read: the partial holds the
rows the MoE layers computed for its first ``num_tokens`` positions, every ``N`` positions;
the final record supersedes it once stored.
"""

from __future__ import annotations

import collections
import inspect
from types import SimpleNamespace

import numpy as np
import paddle
import pytest

fdctx = pytest.importorskip("fdctx", reason="FastDeploy is not importable (see conftest)")

from test_capture import EOS, UUID, Gate, moe_layers, post_process, start  # noqa: E402

from fd_routing_replay import RoutingReader, open_store  # noqa: E402
from fd_routing_replay.errors import ConfigError  # noqa: E402
from fd_routing_replay.integrations.fastdeploy import api as fd_api  # noqa: E402
from fd_routing_replay.keys import partial_key  # noqa: E402

STEP = fdctx.GENERATION == fd_api.STEP_BUFFER
ROLLOUT = "exp_9:3:0:0"
EVERY = 8


def reader_at(root):
    return RoutingReader(open_store(f"local://{root}"))


def rule(forwarded_after_each_step, every):
    """The partial records the rule writes: after a step, one when the request has forwarded
    ``every`` positions more than its last one."""
    out, last = [], 0
    for n in forwarded_after_each_step:
        if n - last >= every:
            out.append(n)
            last = n
    return out


def observable(prompt_len, steps, outcome, step_buffer):
    """The partials a reader sees after each step: the table manager finishes a slot before
    its check (no partial at the finishing step); 2.6 reports the finishing step's output
    before finalizing, but the final then supersedes that partial at once."""
    forwarded = [prompt_len + i for i in range(steps)]
    if outcome == "abort":
        return rule(forwarded, EVERY)
    if not step_buffer:
        return rule(forwarded[:-1], EVERY)
    written = rule(forwarded, EVERY)
    return written[:-1] if written and written[-1] == forwarded[-1] else written


# -- 2.5 / develop: the table-API manager ---------------------------------------------------------

@pytest.mark.skipif(STEP, reason="FastDeploy 2.5 / develop's table API (2.6: below)")
@pytest.mark.parametrize("outcome", ["finish", "abort"])
def test_table_manager_partials_through_post_process_normal(env, monkeypatch, outcome):
    monkeypatch.setenv("FD_RR_CAPTURE__PARTIAL_EVERY_TOKENS", str(EVERY))
    rng = np.random.default_rng(11)
    prompt_len, new_tokens = 13, 24
    fd_config, runner, _ = start(env)
    manager = runner.routing_replay_manager
    assert manager.partials is not None and manager.partials.handoff.partial_every == EVERY
    quant = fdctx.CpuExperts(fd_config.model_config.moe_k)
    layers = moe_layers(fd_config, quant)
    gate = Gate(rng, fd_config.model_config.moe_num_experts)
    block_size = fd_config.cache_config.block_size
    blocks = rng.permutation(64)[: (prompt_len + new_tokens) // block_size + 1].astype("int32")
    share = runner.share_inputs
    share["block_tables"][0, : len(blocks)] = paddle.to_tensor(blocks)
    request_id = f"chatcmpl-{ROLLOUT}-{UUID}_0"
    manager.register_request(batch_id=0, request_id=request_id)          # gpu_model_runner.py:825
    reader = reader_at(env / "store")
    rows, seen = [], []
    steps = [(prompt_len, 0)] + [(1, prompt_len + i) for i in range(new_tokens - 1)]
    for step, (n, decoded) in enumerate(steps):
        last = outcome == "finish" and step == len(steps) - 1
        meta, _, positions = fdctx.forward_meta(manager.get_routing_table(), lens_this_time=[n],
                                                lens_decoder=[decoded])
        manager.pending_update_positions = manager.get_token_positions(  # gpu_model_runner.py:2316-2320
            seq_lens_decoder=paddle.to_tensor(np.array([decoded] + [0] * 7, dtype="int32")),
            seq_lens_this_time=paddle.to_tensor(np.array([n] + [0] * 7, dtype="int32")))
        quant.calls.clear()
        for layer in layers:
            layer.forward(paddle.zeros([n, 8], dtype="float32"), gate, meta)
        rows.append(np.stack(quant.calls))
        share["step_seq_lens_decoder"] = paddle.zeros([8, 1], dtype="int32")
        share["prompt_lens"] = paddle.to_tensor(np.array([[prompt_len]] + [[0]] * 7, dtype="int64"))
        slots = blocks[positions // block_size].astype("int64") * block_size + positions % block_size
        share["slot_mapping_buffer"] = paddle.to_tensor(slots)
        share["position_ids_buffer"] = paddle.to_tensor(positions)
        share["ids_remove_padding"] = paddle.zeros([n], dtype="int64")
        post_process(monkeypatch, manager, share, sampled=EOS if last else 7, n=n, decoded=decoded,
                     block_size=block_size)
        assert manager.flush(60)
        partial = reader.get_partial(ROLLOUT)
        if partial is not None and (not seen or seen[-1] != partial.num_tokens):
            seen.append(partial.num_tokens)
            np.testing.assert_array_equal(partial.ids, np.concatenate(rows, axis=1)[:, :partial.num_tokens])
            assert partial.metadata["request_id"] == request_id and list(partial.layers) == [1, 2, 3, 4]
    if outcome == "abort":
        manager.clear_request(batch_id=0)              # the runner on an abort: gpu_model_runner.py:869
    manager.close()
    forwarded = prompt_len + new_tokens - 1
    assert seen == observable(prompt_len, new_tokens, outcome, step_buffer=False) and len(seen) >= 2
    if outcome == "finish":
        assert reader.get_partial(ROLLOUT) is None     # the final superseded it
        np.testing.assert_array_equal(reader.get(ROLLOUT).ids, np.concatenate(rows, axis=1))
    else:
        assert reader.get(ROLLOUT) is None
        assert forwarded - reader.get_partial(ROLLOUT).num_tokens < EVERY   # at most N lost


# -- 2.6: the engine side, through FastDeploy's token processor ----------------------------------

if STEP:
    from test_serving import Instance, blocks_for  # noqa: E402
    from test_streaming import ResourceManagerStandIn, make_task  # noqa: E402


def processor_for(inst, task):
    processor = inst.processor()
    processor.resource_manager = ResourceManagerStandIn(task)
    processor.resource_manager.recycle_abort_task = lambda task_id: None     # the scheduler's business
    processor.cached_generated_tokens = SimpleNamespace(results=[])
    processor.cached_generated_tokens.put_results = processor.cached_generated_tokens.results.extend
    processor.tokens_counter = collections.defaultdict(int)
    processor.use_logprobs = False
    processor._benchmark_logger = None
    processor._recycle_resources = lambda *args, **kwargs: None      # the scheduler's business
    return processor


def output(token):
    return SimpleNamespace(batch_id=0, tokens=np.array([token], dtype="int64"), pooler_output=None,
                           logprobs=None, prompt_logprobs=None, sampling_mask=None)


@pytest.mark.skipif(not STEP, reason="FastDeploy 2.6's engine side (2.5: above)")
@pytest.mark.parametrize("outcome", ["finish", "abort"])
def test_engine_side_partials_through_the_token_processor(env, monkeypatch, outcome):
    from fastdeploy import envs
    from fastdeploy.config import PREEMPTED_TOKEN_ID

    monkeypatch.setenv("FD_RR_CAPTURE__PARTIAL_EVERY_TOKENS", str(EVERY))
    monkeypatch.setattr(envs, "ENABLE_V1_KVCACHE_SCHEDULER", 1)
    inst = Instance(env, monkeypatch, "p", port=24801, seed=7)
    request_id = f"chatcmpl-{ROLLOUT}-{UUID}_0"
    prompt_len, new_tokens = 13, 24
    try:
        assert inst.engine.routing.handoff.partial_every == EVERY
        blocks = blocks_for(np.random.default_rng(3), 3)
        task = make_task(request_id, prompt_len, blocks)
        processor = processor_for(inst, task)
        inst._prompt_len = prompt_len
        reader = reader_at(inst.store_root)
        steps = [(0, prompt_len)] + [(prompt_len + i, 1) for i in range(new_tokens - 1)]
        sampled = [7 + i for i in range(new_tokens - 1)] + [EOS]
        rows, seen = [], []
        for i, (start_at, n) in enumerate(steps):
            last = outcome == "finish" and i == len(steps) - 1
            rows.append(inst.forward(blocks, start_at, n))
            inst.post_process(last=last)
            inst.capturer.flush_pending_save()
            processor._process_batch_output_use_zmq([output(sampled[i] if last or i < len(steps) - 1 else 8)])
            assert inst.engine.flush(60)
            partial = reader.get_partial(ROLLOUT)
            if partial is not None and (not seen or seen[-1] != partial.num_tokens):
                seen.append(partial.num_tokens)
                np.testing.assert_array_equal(partial.ids, np.concatenate(rows, axis=1)[:, :partial.num_tokens])
                assert partial.tokens_hash is not None                   # provenance: its tokens
                partial.check_tokens(task.prompt_token_ids + task.output_token_ids)
                assert partial.metadata["request_id"] == request_id
        if outcome == "abort":   # the worker's answer to an abort: FastDeploy recycles it, no finalize
            processor.resource_manager.to_be_aborted_req_id_set.add(request_id)
            processor._process_batch_output_use_zmq([output(PREEMPTED_TOKEN_ID)])
            assert processor.cached_generated_tokens.results[-1].error_msg == "Aborted"
        assert inst.engine.flush(60)
    finally:
        inst.close()
    assert seen == observable(prompt_len, new_tokens, outcome, step_buffer=True) and len(seen) >= 2
    if outcome == "finish":
        assert reader.get_partial(ROLLOUT) is None
        np.testing.assert_array_equal(reader.get(ROLLOUT).ids, np.concatenate(rows, axis=1))
    else:
        forwarded = prompt_len + new_tokens - 1
        assert reader.get(ROLLOUT) is None
        assert forwarded - reader.get_partial(ROLLOUT).num_tokens < EVERY   # at most N lost


@pytest.mark.skipif(not STEP, reason="FastDeploy 2.6's token processor")
def test_every_output_path_reports_progress_before_appending_the_tokens():
    """Both of FastDeploy's output paths call ``_record_metrics`` with the step's tokens before
    they extend ``task.output_token_ids`` (what :func:`report_progress` counts on)."""
    from fastdeploy.output.token_processor import TokenProcessor

    for method in (TokenProcessor._process_per_token, TokenProcessor._process_batch_output):
        source = inspect.getsource(method)
        call = source.index("self._record_metrics(task, current_time, token_id")
        assert call < source.index("task.output_token_ids.append(token_id)"), method.__name__


@pytest.mark.skipif(not STEP, reason="FastDeploy 2.6's engine side")
def test_response_mode_refuses_partials_and_a_prefill_instance_writes_none(env, monkeypatch):
    monkeypatch.setenv("FD_RR_CAPTURE__PARTIAL_EVERY_TOKENS", str(EVERY))
    with pytest.raises(ConfigError, match="capture.partial_every_tokens.*routing_store_type 'response'"):
        Instance(env, monkeypatch, "r", port=24803, routing={"routing_store_type": "response"})
    inst = Instance(env, monkeypatch, "q", port=24805, role="prefill")
    try:
        assert not inst.engine.routing.handoff.partial_every         # a prefill instance writes no record
        task = make_task(f"chatcmpl-{ROLLOUT}-{UUID}_0", 40, blocks_for(np.random.default_rng(1), 3))
        inst.processor()._record_metrics(task, 0.0, [7])        # FastDeploy's metrics, nothing of ours
        assert inst.engine.flush(60)
        assert reader_at(inst.store_root).get_partial(ROLLOUT) is None
        assert not (inst.store_root / "routing_replay").exists() or \
            partial_key(ROLLOUT) not in reader_at(inst.store_root).list_partials()
    finally:
        inst.close()
