"""Routing captured through FastDeploy's real ``FusedMoE.forward`` call site, end to end.

The MoE layers are FastDeploy's ``FusedMoE`` with its own ``forward`` (which binds the hook
as a ``functools.partial`` at every call, moe.py:697-712 in 2.5, :745-760 in 2.6); only the
quantized expert computation is a CPU stand-in (``fdctx.CpuExperts``).  After each
step FastDeploy's real ``post_process_normal`` (pre_and_post_process.py) runs its routing
replay block against our manager, with CPU stand-ins for the two compiled ops around it;
the runner-side calls it makes outside that function are made as the runner makes them
(cited per call).  The record is read back with :class:`RoutingReader` and compared with
the top-k the layers computed.
"""

from __future__ import annotations

import base64
import importlib
from types import SimpleNamespace

import numpy as np
import paddle
import pytest

fdctx = pytest.importorskip("fdctx", reason="FastDeploy is not importable (see conftest)")

from fd_routing_replay import RoutingReader, open_store  # noqa: E402
from fd_routing_replay.codec import decode_record  # noqa: E402
from fd_routing_replay.codec.record import tokens_digest  # noqa: E402
from fd_routing_replay.integrations.fastdeploy import api as fd_api  # noqa: E402
from fd_routing_replay.integrations.fastdeploy.engine import EngineRoutingManager  # noqa: E402
from fdrr_dev.testing.fastdeploy_standins import StandInOpError  # noqa: E402

STEP = fdctx.GENERATION == fd_api.STEP_BUFFER
UUID = "0f8fad5b-d9cb-469f-a165-70867728950e"


class Gate(paddle.nn.Layer):
    """Random scores per token: the MoE gate (its weights are not what is under test)."""

    def __init__(self, rng: np.random.Generator, num_experts: int) -> None:
        super().__init__()
        self.rng, self.num_experts = rng, num_experts

    def forward(self, x):
        return paddle.to_tensor(self.rng.random((x.shape[0], self.num_experts)).astype("float32"))


def start(env, model=None, routing=None):
    fd_config = fdctx.make_fd_config(env, model=model, routing=routing)
    runner = fdctx.make_runner(fdctx.runner_class(), fd_config, num_blocks=64)
    engine = EngineRoutingManager(fd_config, 64) if STEP else None
    fdctx.make_worker(runner, fd_config).initialize_cache(64)       # gpu_worker.py:182-189
    return fd_config, runner, engine


def moe_layers(fd_config, quant):
    from fd_routing_replay.integrations.fastdeploy.setup import moe_layer_map

    return [fdctx.make_moe_layer(fd_config, layer, quant) for layer in moe_layer_map(fd_config.model_config)]


class PostprocessOps:
    """CPU stand-ins for the two compiled ops FastDeploy's ``post_process_normal`` calls
    around the routing replay block (they update stop flags and the input buffers on the
    GPU); everything else in that function is FastDeploy's own code."""

    @staticmethod
    def set_stop_value_multi_ends(sampled, stop_flags, seq_lens_this_time, eos, *args):
        hit = paddle.to_tensor(np.isin(sampled.numpy(), eos.numpy()).reshape(stop_flags.shape))
        paddle.assign(paddle.logical_or(stop_flags, hit), stop_flags)

    @staticmethod
    def update_inputs_v1(*args, **kwargs):
        return None


def post_process(monkeypatch, manager, share_inputs, *, sampled, n, decoded, block_size):
    """FastDeploy's real ``post_process_normal`` for one sequence in slot 0."""
    ppp = importlib.import_module("fastdeploy.model_executor.pre_and_post_process")
    monkeypatch.setattr(ppp, "set_stop_value_multi_ends", PostprocessOps.set_stop_value_multi_ends)
    monkeypatch.setattr(ppp, "update_inputs_v1", PostprocessOps.update_inputs_v1)
    monkeypatch.setattr(ppp, "update_inputs", PostprocessOps.update_inputs_v1, raising=False)
    bsz = share_inputs["block_tables"].shape[0]

    def col(values, dtype):
        return paddle.to_tensor(np.array(values, dtype=dtype).reshape(bsz, 1))

    model_output = SimpleNamespace(
        stop_flags=col([False] * bsz, "bool"), step_idx=col([0] * bsz, "int64"),
        max_dec_len=col([1000] * bsz, "int64"),
        seq_lens_this_time=paddle.to_tensor(np.array([n] + [0] * (bsz - 1), dtype="int32")),
        eos_token_id=paddle.to_tensor(np.array([[EOS]], dtype="int64")), next_tokens=col([0] * bsz, "int64"),
        pre_ids=None, stop_token_ids=None, stop_seqs_len=None, min_tokens=None, not_need_stop_device=None,
        seq_lens_encoder=col([n if decoded == 0 else 0] + [0] * (bsz - 1), "int32"),
        seq_lens_decoder=col([decoded] + [0] * (bsz - 1), "int32"), input_ids=None, is_block_step=None,
        token_ids_all=None, prompt_lens=None)     # read on FastDeploy's CUDA path (the model matrix's)
    sampler_output = SimpleNamespace(sampled_token_ids=col([sampled] + [0] * (bsz - 1), "int64"), logits=None)
    ppp.post_process_normal(sampler_output, model_output, share_inputs, None, block_size=block_size,
                            routing_replay_manager=manager)
    return bool(model_output.stop_flags.numpy()[0, 0])


EOS = 2


def run_request(env, monkeypatch, *, prompt_len=21, new_tokens=5, model=None, routing=None, seed=0):
    """Prefill + decode one request through FastDeploy's FusedMoE.forward and post_process_normal."""
    rng = np.random.default_rng(seed)
    fd_config, runner, engine = start(env, model=model, routing=routing)
    manager = runner.routing_replay_manager
    num_experts = fd_config.model_config.moe_num_experts
    quant = fdctx.CpuExperts(fd_config.model_config.moe_k)
    layers = moe_layers(fd_config, quant)
    gate = Gate(rng, num_experts)
    block_size = fd_config.cache_config.block_size
    blocks = rng.permutation(64)[: (prompt_len + new_tokens) // block_size + 1].astype("int32")
    share = runner.share_inputs
    share["block_tables"][0, : len(blocks)] = paddle.to_tensor(blocks)
    request_id = f"chatcmpl-exp_1:7:0:0-{UUID}_0"
    if not STEP:
        manager.register_request(batch_id=0, request_id=request_id)        # gpu_model_runner.py:825
    expected = []
    steps = [(prompt_len, 0)] + [(1, prompt_len + i) for i in range(new_tokens - 1)]
    for step, (n, decoded) in enumerate(steps):
        buffer = manager.get_device_routing_buffer() if STEP else manager.get_routing_table()
        meta, batch, positions = fdctx.forward_meta(buffer, lens_this_time=[n], lens_decoder=[decoded])
        if not STEP:   # gpu_model_runner.py:2316-2320
            manager.pending_update_positions = manager.get_token_positions(
                seq_lens_decoder=paddle.to_tensor(np.array([decoded] + [0] * 7, dtype="int32")),
                seq_lens_this_time=paddle.to_tensor(np.array([n] + [0] * 7, dtype="int32")))
        x = paddle.zeros([n, 8], dtype="float32")
        quant.calls.clear()
        for layer in layers:
            layer.forward(x, gate, meta)                                  # FastDeploy's forward
        expected.append(np.stack(quant.calls))                            # [L, n, K]
        share["step_seq_lens_decoder"] = paddle.zeros([8, 1], dtype="int32")
        share["prompt_lens"] = paddle.to_tensor(np.array([[prompt_len]] + [[0]] * 7, dtype="int64"))
        # Stand-in for get_position_ids_and_slot_mapping (a GPU op, gpu_model_runner.py:1334):
        slots = blocks[positions // block_size].astype("int64") * block_size + positions % block_size
        share["slot_mapping_buffer"] = paddle.to_tensor(slots)
        share["position_ids_buffer"] = paddle.to_tensor(positions)
        share["ids_remove_padding"] = paddle.zeros([n], dtype="int64")
        last = step == len(steps) - 1
        post_process(monkeypatch, manager, share, sampled=EOS if last else 7, n=n, decoded=decoded,
                     block_size=block_size)
        if STEP:       # after post_process_event.synchronize(): gpu_model_runner.py:2328-2329
            manager.flush_pending_save()
    return fd_config, runner, engine, request_id, np.concatenate(expected, axis=1), blocks


def finish_on_engine(runner, engine, request_id, prompt_len, new_tokens, blocks, eos_last=True):
    """2.6: FastDeploy's token processor finalizes the finished request (token_processor.py:613)."""
    from fastdeploy.plugins.token_processor import load_token_processor_plugins

    cls = load_token_processor_plugins()
    processor = cls.__new__(cls)
    processor.cfg = runner.fd_config
    processor.routing_cache_manager = engine
    output = list(range(new_tokens))
    task = SimpleNamespace(prompt_token_ids_len=prompt_len, output_token_ids=output,
                           prompt_token_ids=list(range(1000, 1000 + prompt_len)),
                           eos_token_ids=[output[-1]] if eos_last else [-7], block_tables=blocks.tolist())
    result = SimpleNamespace(finished=True, error_code=200, routing_data=None)
    processor._finalize_routing(request_id, task, result)
    return result


def read_back(env, fd_config, runner, engine):
    manager = runner.routing_replay_manager
    if engine is not None:
        engine.close()
    manager.close()
    store = open_store(f"local://{env / 'store'}")
    return RoutingReader(store).get("exp_1:7:0:0")


def test_capture_through_fusedmoe_forward_matches_the_routing(env, monkeypatch):
    monkeypatch.setenv("FD_RR_CAPTURE__WEIGHTS_VERSION", "step-7")
    prompt_len, new_tokens = 21, 5
    fd_config, runner, engine, rid, expected, blocks = run_request(env, monkeypatch, prompt_len=prompt_len,
                                                                   new_tokens=new_tokens)
    if STEP:
        finish_on_engine(runner, engine, rid, prompt_len, new_tokens, blocks)
    record = read_back(env, fd_config, runner, engine)
    assert record is not None
    assert record.ids.dtype == np.uint16                  # 300 experts, and ids above 256 survive
    assert expected.max() > 256
    assert record.ids.shape == expected.shape == (4, prompt_len + new_tokens - 1, 4)
    np.testing.assert_array_equal(record.ids, expected)
    assert list(record.layers) == [1, 2, 3, 4]
    assert record.num_decoder_layers == fd_config.model_config.num_hidden_layers
    assert record.weights_version == "step-7"
    if STEP:   # 2.6's engine knows the request's tokens: provenance ties routes to them
        forwarded = list(range(1000, 1000 + prompt_len)) + list(range(new_tokens - 1))
        record.check_tokens(forwarded + [new_tokens - 1])
        assert record.tokens_hash == tokens_digest(forwarded)
        assert record.num_decoder_layers == fd_config.model_config.num_hidden_layers


def test_leading_dense_layers_are_mapped_not_lost(env, monkeypatch):
    """DeepSeek-V3 style first_k_dense_replace: FastDeploy keeps moe_layer_start_index 0."""
    model = {"moe_layer_start_index": 0, "first_k_dense_replace": 2, "num_hidden_layers": 5}
    fd_config, runner, engine, rid, expected, blocks = run_request(env, monkeypatch, model=model, seed=3)
    assert fd_config.model_config.moe_layer_start_index == 0
    if STEP:
        finish_on_engine(runner, engine, rid, 21, 5, blocks)
    record = read_back(env, fd_config, runner, engine)
    assert list(record.layers) == [2, 3, 4]
    assert "missing_tokens" not in record.metadata
    np.testing.assert_array_equal(record.ids, expected)


def test_a_buffer_that_is_not_ours_goes_to_fastdeploys_function(env):
    fd_config, runner, engine = start(env)
    quant = fdctx.CpuExperts(4)
    layer = moe_layers(fd_config, quant)[0]
    foreign = paddle.zeros([1, 64, 4, 4], dtype="int32") if not STEP else paddle.zeros([64, 4, 4], dtype="int32")
    meta, _, _ = fdctx.forward_meta(foreign, lens_this_time=[3], lens_decoder=[0])
    try:
        # FastDeploy's own function (a Triton kernel here stood in) gets the call, not our op.
        with pytest.raises(StandInOpError):
            layer.forward(paddle.zeros([3, 8]), Gate(np.random.default_rng(1), 300), meta)
        assert not foreign.any()
    finally:
        runner.routing_replay_manager.close()
        if engine is not None:
            engine.close()


def test_hook_row_mismatch_is_counted_not_written_shifted(env):
    fd_config, runner, engine = start(env)
    manager = runner.routing_replay_manager
    buffer = manager.get_device_routing_buffer() if STEP else manager.get_routing_table()
    hook = getattr(importlib.import_module(fd_api.MOE_MODULE), fdctx.API.hook_name)
    topk = paddle.to_tensor(np.full((5, 4), 7, dtype="int64"))
    try:
        if STEP:
            hook(device_routing_buffer=buffer, topk_ids=topk, layer_idx=0, tp_size=1, ep_size=1,
                 tp_group=None, total_token_num=3)
        else:
            meta, _, _ = fdctx.forward_meta(buffer, lens_this_time=[3], lens_decoder=[0])
            hook(routing_replay_table=buffer, topk_ids=topk, batch_id_per_token=meta.batch_id_per_token,
                 seq_lens_decoder=meta.seq_lens_decoder, cu_seqlens_q=meta.cu_seqlens_q, layer_idx=0)
        assert manager.binding.mismatches == 1 and manager.binding.errors == 1
        assert not (buffer.cast("int64") == 7).any()
    finally:
        manager.close()
        if engine is not None:
            engine.close()


@pytest.mark.skipif(not STEP, reason="routing_store_type 'response' is FastDeploy 2.6's engine-side mode")
def test_response_mode_returns_our_record_base64(env, monkeypatch):
    fd_config, runner, engine, rid, expected, blocks = run_request(
        env, monkeypatch, routing={"routing_store_type": "response"}, seed=5)
    result = finish_on_engine(runner, engine, rid, 21, 5, blocks, eos_last=False)
    # What FastDeploy's serving_chat.py:730-733 puts in `routed_experts`:
    routed_experts = base64.b64encode(np.asarray(result.routing_data).tobytes()).decode()
    record = decode_record(base64.b64decode(routed_experts))
    assert record.rollout_id == "exp_1:7:0:0"
    np.testing.assert_array_equal(record.ids, expected)
    engine.close()
    runner.routing_replay_manager.close()
    assert not (env / "store").exists() or not any((env / "store").rglob("*.rr"))


def _fastdeploy_test_utils():
    """FastDeploy's own R3 test utilities (tests/rollout_routing_replay_test_utils.py)."""
    import importlib.util
    from pathlib import Path

    import fastdeploy

    path = Path(fastdeploy.__file__).resolve().parents[1] / "tests" / "rollout_routing_replay_test_utils.py"
    if not path.exists():
        pytest.skip("FastDeploy's tests/rollout_routing_replay_test_utils.py is not beside these sources")
    spec = importlib.util.spec_from_file_location("fd_r3_test_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fastdeploy_raw_layout_is_read_by_fastdeploys_own_test_utilities(env, monkeypatch):
    """capture.record_format fastdeploy-raw, per layer: FastDeploy's files, FastDeploy's checks."""
    utils = _fastdeploy_test_utils()
    monkeypatch.setenv("FD_RR_CAPTURE__RECORD_FORMAT", "fastdeploy-raw")
    monkeypatch.setenv("FD_RR_CAPTURE__FUSED", "false")
    monkeypatch.setenv("FD_RR_STORE__LOCAL__LAYOUT", "fastdeploy")
    model = {"moe_num_experts": 64}                      # uint8, as FastDeploy's baselines are
    fd_config, runner, engine, rid, expected, blocks = run_request(env, monkeypatch, model=model, seed=11)
    if STEP:
        finish_on_engine(runner, engine, rid, 21, 5, blocks)
        engine.close()
    runner.routing_replay_manager.close()
    rollout_dir = env / "store" / "exp_1:7:0:0"
    num_layers = expected.shape[0]
    # What check_routing_replay_chat_completion checks: one file per MoE layer ...
    assert utils.wait_for_file(str(rollout_dir), timeout=1, moe_layer_num=num_layers)
    assert sorted(p.name for p in rollout_dir.iterdir()) == [f"layer_{i}.pdtensor" for i in range(num_layers)]
    for layer in range(num_layers):
        # ... each loaded with paddle.load as FastDeploy's test loads it, padded to
        # max_model_len with the fill value (255 for uint8) ...
        stored = paddle.load(str(rollout_dir / f"layer_{layer}.pdtensor"))
        padded = np.full((fd_config.model_config.max_model_len, 4), 255, dtype=np.uint8)
        padded[: expected.shape[1]] = expected[layer]
        np.testing.assert_array_equal(np.asarray(stored.numpy()), padded)
        # ... and compared with FastDeploy's own overlap ratio against what FastDeploy writes.
        baseline = paddle.to_tensor(padded)
        assert float(utils.calculate_routing_ratio(baseline, stored)) == 1.0
        assert utils.get_real_routing_length(stored) == utils.get_real_routing_length(baseline)
    # RoutingReader reads the same files back, padding trimmed, layers assembled.
    store = open_store(f"local://{env / 'store'}?layout=fastdeploy")
    record = RoutingReader(store, num_layers=num_layers).get("exp_1:7:0:0")
    np.testing.assert_array_equal(record.ids, expected)


@pytest.mark.skipif(not STEP, reason="prefix omission runs on FastDeploy 2.6's engine side")
def test_multi_turn_prefix_omission_on_the_engine(env, monkeypatch):
    """Turn 1 hands over only its new rows; the writer prepends turn 0's stored record."""
    from fd_routing_replay.capture.slots import request_slots

    monkeypatch.setenv("FD_RR_CAPTURE__PREFIX_OMISSION", "true")
    prompt_len, new_tokens = 21, 5
    fd_config, runner, engine, rid, _, blocks = run_request(env, monkeypatch, prompt_len=prompt_len,
                                                            new_tokens=new_tokens)
    finish_on_engine(runner, engine, rid, prompt_len, new_tokens, blocks)
    assert engine.flush(60)
    store = open_store(f"local://{env / 'store'}")
    turn0 = RoutingReader(store).get("exp_1:7:0:0")
    turn0_tokens = list(range(1000, 1000 + prompt_len)) + list(range(new_tokens))
    rng = np.random.default_rng(3)
    block_size = fd_config.cache_config.block_size
    num_experts = fd_config.model_config.moe_num_experts

    def turn(index, tokens, num_tokens):
        """Rows for every position of the turn in the shared slot cache; finish it."""
        table = rng.permutation(64)[: num_tokens // block_size + 1].astype("int64")
        slots = request_slots(table, num_tokens, block_size)
        rows = rng.integers(0, num_experts, size=(num_tokens,) + engine.host.array.shape[1:])
        engine.host.array[slots] = rows.astype(engine.host.array.dtype)
        engine.routing.finish(f"chatcmpl-exp_1:7:{index}:0-{UUID}_0", table, num_tokens, token_ids=tokens)
        assert engine.flush(60)
        return RoutingReader(store).get(f"exp_1:7:{index}:0"), rows.transpose(1, 0, 2)

    n0 = turn0.num_tokens
    tokens1 = turn0_tokens + [5, 6, 7] + list(range(2000, 2030))       # tool output, new turn
    record1, rows1 = turn(1, tokens1, len(tokens1) - 1)
    assert engine.stats()["prefix_omitted"] == 1
    np.testing.assert_array_equal(record1.ids[:, :n0], turn0.ids)       # the stored turn's rows
    np.testing.assert_array_equal(record1.ids[:, n0:], rows1[:, n0:])
    record1.check_tokens(tokens1)
    assert record1.num_tokens == len(tokens1) - 1
    tokens2 = [9] + tokens1[1:] + [3000]                                # history rewritten
    record2, rows2 = turn(2, tokens2, len(tokens2) - 1)
    assert engine.stats()["prefix_fallbacks"] == 1 and engine.stats()["prefix_omitted"] == 1
    np.testing.assert_array_equal(record2.ids, rows2)                   # handed over whole
    engine.close()
    runner.routing_replay_manager.close()


@pytest.mark.skipif(not STEP, reason="2.6: the worker publishes, the engine exports")
def test_worker_capture_counters_are_exported_by_the_engine(env, monkeypatch):
    """The worker runs no writer: its hook and step counters reach Prometheus through the
    engine's writer, labelled with the worker's rank."""
    fd_config, runner, engine, rid, _, blocks = run_request(env, monkeypatch)
    worker = runner.routing_replay_manager.stats()
    assert worker["steps"] > 0 and worker["hook_calls"] > 0
    ranks = engine.stats()["ranks"]
    assert set(ranks) == {"dp0-tp0"}
    assert ranks["dp0-tp0"]["steps"] == worker["steps"]
    assert ranks["dp0-tp0"]["hook_calls"] == worker["hook_calls"]
    registry = engine.routing.writer.metrics_registry
    labels = {"namespace": "routing_replay", "store": "local", "rank": "dp0-tp0"}
    assert registry.get_sample_value("fd_rr_capture_steps_total", labels) == worker["steps"]
    assert registry.get_sample_value("fd_rr_capture_bad_expert_ids_total", labels) == 0
    engine.close()
    runner.routing_replay_manager.close()
