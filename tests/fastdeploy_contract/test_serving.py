"""FastDeploy 2.6 serving features under capture, run through FastDeploy's own code.

Each instance is built the way FastDeploy builds it: the engine side by
``EngineService._init_routing_cache_manager`` (common_engine.py:2419-2450, which builds our
assembler through the ``RoutingCacheManager`` name we take over and attaches FastDeploy's
own view of the routing host buffer to the resource manager), the worker by
``GpuWorker.initialize_cache``.  Steps run FastDeploy's ``FusedMoE.forward`` and
``post_process_normal`` (helpers shared with test_capture.py).  The features' own routing
paths are FastDeploy's functions, called on stand-in ``self`` objects that carry only the
attributes those functions read:

* PD disaggregation: ``TokenProcessor._finalize_routing(is_prefill=True)`` on the prefill
  instance (token_processor.py:592-612) and ``ResourceManagerV1.add_prefilled_request`` on
  the decode instance (resource_manager_v1.py:1565-1624);
* CPU KV cache: ``CacheTransferManager._init_routing_aux_data`` and ``_swap_routing``
  (cache_transfer_manager.py:337-434), which ``_transfer_data`` calls with each KV swap
  (:1679-1681, :1722-1724); a KV storage tier: ``_write_routing_to_storage`` /
  ``_read_routing_from_storage`` (:436-512; the storage backend is a dict stand-in);
* overlap scheduling: ``execute_model_overlap``'s order of calls (gpu_model_runner.py:2314-2350);
* MTP: the draft model's ``ForwardMeta`` (spec_decode/mtp.py:667) carries no routing buffer.
"""

from __future__ import annotations

import copy
import logging
import threading
from types import MethodType, SimpleNamespace

import numpy as np
import paddle
import pytest

fdctx = pytest.importorskip("fdctx", reason="FastDeploy is not importable (see conftest)")

from test_capture import EOS, UUID, Gate, moe_layers, post_process  # noqa: E402

from fd_routing_replay import RoutingReader, open_store  # noqa: E402
from fd_routing_replay.integrations.fastdeploy import api as fd_api  # noqa: E402
from fd_routing_replay.integrations.fastdeploy.engine import (  # noqa: E402
    FASTDEPLOY_HOST_BUFFER,
    EngineRoutingManager,
)

pytestmark = pytest.mark.skipif(fdctx.GENERATION != fd_api.STEP_BUFFER,
                                reason="FastDeploy 2.6's routing paths (2.5 refuses these features: test_startup)")

ROLLOUT = "exp_1:7:0:0"
RID = f"chatcmpl-{ROLLOUT}-{UUID}_0"
BLOCKS = 64


class Instance:
    """One FastDeploy 2.6 instance (engine side + one worker) on its own worker-queue port."""

    def __init__(self, env, monkeypatch, name, *, port, role="mixed", cache=None, overlap=False, seed=0,
                 model=None, routing=None):
        from fastdeploy.engine.common_engine import EngineService
        from fastdeploy.plugins.token_processor import load_token_processor_plugins

        root = env / name
        root.mkdir()
        self.monkeypatch = monkeypatch
        self.fd_config = fdctx.make_fd_config(root, cache=cache, port=port, model=model, routing=routing)
        self.fd_config.scheduler_config.splitwise_role = role
        self.fd_config.scheduler_config.enable_overlap_schedule = overlap
        self.store_root = root / "store"
        # The token processor plugin installs our assembler as FastDeploy's RoutingCacheManager.
        self.processor_cls = load_token_processor_plugins()
        engine = SimpleNamespace(cfg=self.fd_config, token_processor=SimpleNamespace(),
                                 resource_manager=SimpleNamespace(routing_host_view=None),
                                 llm_logger=logging.getLogger("fd-contract"))
        self.fd_config.cache_config.reset(BLOCKS)                # EngineService._stop_profile (:2409)
        EngineService._init_routing_cache_manager(engine, BLOCKS)
        self.engine = engine.routing_cache_manager
        assert isinstance(self.engine, EngineRoutingManager)
        self.routing_host_view = engine.resource_manager.routing_host_view
        self.runner = fdctx.make_runner(fdctx.runner_class(), self.fd_config, num_blocks=BLOCKS)
        fdctx.make_worker(self.runner, self.fd_config).initialize_cache(BLOCKS)
        self.capturer = self.runner.routing_replay_manager
        self.quant = fdctx.CpuExperts(self.fd_config.model_config.moe_k)
        self.layers = moe_layers(self.fd_config, self.quant)
        self.gate = Gate(np.random.default_rng(seed), self.fd_config.model_config.moe_num_experts)
        self.block_size = self.fd_config.cache_config.block_size
        self._prompt_len = 0

    # ---------------------------------------------------------------- one sequence, slot 0
    def forward(self, blocks, start, n):
        """FusedMoE.forward of every MoE layer for positions start..start+n-1: rows [L, n, K]."""
        buffer = self.capturer.get_device_routing_buffer()
        meta, _, positions = fdctx.forward_meta(buffer, lens_this_time=[n], lens_decoder=[start])
        self.quant.calls.clear()
        for layer in self.layers:
            layer.forward(paddle.zeros([n, 8], dtype="float32"), self.gate, meta)
        self._pending = (blocks, start, n, positions)
        return np.stack(self.quant.calls)

    def post_process(self, *, padding=0, padding_slots=None, last=False):
        """FastDeploy's post_process_normal for the forwarded step; with ``padding`` the
        launch holds that many padding tokens beyond the step's (their slots: ``padding_slots``)."""
        blocks, start, n, positions = self._pending
        share = self.runner.share_inputs
        share["block_tables"][0, :] = -1
        share["block_tables"][0, : len(blocks)] = paddle.to_tensor(np.asarray(blocks, dtype="int32"))
        share["step_seq_lens_decoder"] = paddle.zeros([8, 1], dtype="int32")
        share["prompt_lens"] = paddle.to_tensor(np.array([[self._prompt_len]] + [[0]] * 7, dtype="int64"))
        blocks = np.asarray(blocks, dtype="int64")
        slots = blocks[positions // self.block_size] * self.block_size + positions % self.block_size
        if padding:
            slots = np.concatenate([slots, np.asarray(padding_slots, dtype="int64")])
        share["slot_mapping_buffer"] = paddle.to_tensor(slots)      # get_position_ids_and_slot_mapping
        share["position_ids_buffer"] = paddle.to_tensor(np.concatenate([positions, np.zeros(padding, "int64")]))
        share["ids_remove_padding"] = paddle.zeros([n + padding], dtype="int64")
        post_process(self.monkeypatch, self.capturer, share, sampled=EOS if last else 7, n=n,
                      decoded=start, block_size=self.block_size)

    def run(self, blocks, steps, *, last=True):
        """Non-overlapped steps (execute_model: forward, post-process, flush: gpu_model_runner.py:2302-2311)."""
        rows = []
        for i, (start, n) in enumerate(steps):
            rows.append(self.forward(blocks, start, n))
            self.post_process(last=last and i == len(steps) - 1)
            self.capturer.flush_pending_save()
        return np.concatenate(rows, axis=1)

    def processor(self):
        processor = self.processor_cls.__new__(self.processor_cls)
        processor.cfg = self.fd_config
        processor.routing_cache_manager = self.engine
        processor.routing_host_view = None                    # token_processor.py:146-148
        processor._routing_host_view_init_attempted = False
        return processor

    def finish(self, blocks, prompt_len, output, *, is_prefill=False):
        """FastDeploy's token processor finalizes the request (token_processor.py:340)."""
        task = SimpleNamespace(prompt_token_ids_len=prompt_len, output_token_ids=list(output),
                               prompt_token_ids=list(range(1000, 1000 + prompt_len)),
                               eos_token_ids=[EOS], block_tables=list(map(int, blocks)))
        result = SimpleNamespace(finished=not is_prefill, error_code=200, routing_data=None)
        self.processor()._finalize_routing(RID, task, result, is_prefill)
        return result

    def record(self, rollout_id=ROLLOUT):
        assert self.engine.flush(60)
        return RoutingReader(open_store(f"local://{self.store_root}")).get(rollout_id)

    def close(self):
        self.engine.close()
        self.capturer.close()


def blocks_for(rng, count, exclude=()):
    return rng.permutation([b for b in range(BLOCKS) if b not in set(exclude)])[:count].astype("int64")


def test_the_slot_cache_is_fastdeploys_routing_host_buffer(env, monkeypatch):
    """FastDeploy's own views attach to it, with FastDeploy's shape and dtype."""
    inst = Instance(env, monkeypatch, "i", port=24101)
    try:
        assert inst.engine.host.name == f"{FASTDEPLOY_HOST_BUFFER}24101"
        view = inst.routing_host_view                  # built by common_engine.py:2436-2450
        assert view is not None and view.buffer.shape == inst.engine.host.array.shape
        assert view.buffer.dtype == inst.engine.host.array.dtype
        inst.engine.host.array[5] = 9
        assert (view.buffer[5] == 9).all()
    finally:
        inst.close()


# DeepSeek-V3 style: leading dense layers that FastDeploy's view counts as rows
# (moe_layer_start_index stays 0, config.py:1876); our three MoE layers are its rows 2..4.
DENSE_FIRST = {"moe_layer_start_index": 0, "first_k_dense_replace": 2}


@pytest.mark.parametrize("model", [None, DENSE_FIRST], ids=["moe-from-start-index", "leading-dense-layers"])
def test_pd_disaggregation_prompt_routes_reach_the_decode_instance(env, monkeypatch, model):
    from fastdeploy.engine.request import RequestMetrics
    from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

    rng = np.random.default_rng(7)
    prefill = Instance(env, monkeypatch, "p", port=24201, role="prefill", seed=1, model=model)
    decode = Instance(env, monkeypatch, "d", port=24202, role="decode", seed=2, model=model)
    num_rows = decode.fd_config.routing_replay_config.num_moe_layers         # FastDeploy's view
    prompt_len, new_tokens = 37, 6
    try:
        p_blocks = blocks_for(rng, 3)
        decode_blocks = blocks_for(rng, 3, exclude=p_blocks)       # D's own blocks, other ids
        prefill._prompt_len = prompt_len
        prompt_rows = prefill.run(p_blocks, [(0, 16), (16, prompt_len - 16)], last=False)   # chunked
        # P: FastDeploy's _finalize_routing(is_prefill=True) gathers the prompt's rows
        sent = prefill.finish(p_blocks, prompt_len, [11], is_prefill=True).routing_data
        assert sent is not None and sent.shape == (prompt_len, num_rows, 4)
        columns = [layer - prefill.fd_config.model_config.moe_layer_start_index
                   for layer in prefill.engine.geometry.layers]
        np.testing.assert_array_equal(sent.transpose(1, 0, 2)[columns], prompt_rows)
        assert prefill.record() is None                          # a prefill instance stores nothing
        # D: FastDeploy's add_prefilled_request writes them into D's buffer by D's block table
        request = SimpleNamespace(request_id=RID, idx=0, output_token_ids=[], block_tables=decode_blocks.tolist(),
                                  prompt_token_ids=list(range(1000, 1000 + prompt_len)),
                                  metrics=RequestMetrics())
        resource_manager = SimpleNamespace(
            lock=threading.Lock(), config=decode.fd_config, requests={RID: request}, tasks_list=[None] * 8,
            running=[], routing_host_view=decode.routing_host_view)
        resource_manager._write_prefill_routing_to_host_buffer = MethodType(
            ResourceManagerV1._write_prefill_routing_to_host_buffer, resource_manager)
        output = SimpleNamespace(request_id=RID, outputs=SimpleNamespace(token_ids=[11], draft_token_ids=[]),
                                 num_cached_tokens=0, metrics=copy.deepcopy(RequestMetrics()), routing_data=sent)
        ResourceManagerV1.add_prefilled_request(resource_manager, output)
        assert request.output_token_ids == [11] and resource_manager.running == [request]
        decode._prompt_len = prompt_len
        decode_rows = decode.run(decode_blocks, [(prompt_len + i, 1) for i in range(new_tokens - 1)])
        decode.finish(decode_blocks, prompt_len, request.output_token_ids + [7] * (new_tokens - 2) + [EOS])
        record = decode.record()
        assert record is not None and "missing_tokens" not in record.metadata
        assert record.num_tokens == prompt_len + new_tokens - 1
        np.testing.assert_array_equal(record.ids, np.concatenate([prompt_rows, decode_rows], axis=1))
        assert list(record.layers) == list(decode.engine.geometry.layers)
    finally:
        prefill.close()
        decode.close()


def test_cpu_kv_cache_routes_follow_the_blocks(env, monkeypatch):
    """A request's blocks go to the CPU, another request reuses those GPU blocks, the first
    comes back in other GPU blocks: each record is its own request's routing."""
    from fastdeploy.cache_manager import cache_transfer_manager
    from fastdeploy.cache_manager.cache_transfer_manager import CacheTransferManager

    # The module's logger is made in its __main__ block (cache_transfer_manager.py:1843-1846).
    monkeypatch.setattr(cache_transfer_manager, "logger", logging.getLogger("cache_transfer"), raising=False)
    rng = np.random.default_rng(11)
    inst = Instance(env, monkeypatch, "i", port=24301, cache={"swap_space": 1})
    fd_config = inst.fd_config
    # The cache transfer manager's own set-up (cache_transfer_manager.py:337-395), rank 0
    ctm = SimpleNamespace(routing_replay_config=fd_config.routing_replay_config, num_cpu_blocks=16, rank=0,
                          engine_worker_queue_port=fd_config.parallel_config.local_engine_worker_queue_port,
                          block_size=inst.block_size, num_gpu_blocks=BLOCKS, aux_data_specs={},
                          routing_host_view=None, routing_swap_buffer=None)
    CacheTransferManager._init_routing_aux_data(ctm)
    try:
        assert ctm.routing_host_view is not None and "routing" in ctm.aux_data_specs
        prompt_len = 40
        gpu_blocks = blocks_for(rng, 3)
        cpu_blocks = [3, 9, 4]
        rows_a = inst.run(gpu_blocks, [(0, prompt_len)], last=False)
        CacheTransferManager._swap_routing(ctm, list(gpu_blocks), cpu_blocks, "to_cpu")      # SWAP2CPU
        # B reuses the freed GPU blocks and finishes
        rows_b = inst.run(gpu_blocks, [(0, 30), (30, 1), (31, 1)])
        inst.finish(gpu_blocks, 30, [7, 7, EOS])
        record_b = inst.record()
        np.testing.assert_array_equal(record_b.ids, rows_b)
        # A comes back (SWAP2GPU) into other GPU blocks and decodes on
        back = blocks_for(rng, 3, exclude=gpu_blocks)
        CacheTransferManager._swap_routing(ctm, list(back), cpu_blocks, "to_gpu")
        inst._prompt_len = prompt_len
        rows_a2 = inst.run(back, [(prompt_len + i, 1) for i in range(3)])
        inst.engine.routing.finish(f"chatcmpl-exp_1:8:0:0-{UUID}_0", back, prompt_len + 3)
        record_a = inst.record("exp_1:8:0:0")
        assert "missing_tokens" not in record_a.metadata
        np.testing.assert_array_equal(record_a.ids, np.concatenate([rows_a, rows_a2], axis=1))
    finally:
        for name in ("routing_swap_buffer", "routing_host_view"):
            if getattr(ctm, name, None) is not None:
                getattr(ctm, name).close()
        inst.close()


def test_overlap_scheduling_captures_the_step_whose_tokens_are_accepted(env, monkeypatch):
    """execute_model_overlap: step N's forward runs before step N-1's rows are flushed, and
    the launch is padded beyond the step's tokens; each position keeps its own step's rows."""
    rng = np.random.default_rng(5)
    inst = Instance(env, monkeypatch, "i", port=24401, overlap=True)
    prompt_len, new_tokens = 21, 6
    blocks = blocks_for(rng, 2)
    bs = inst.block_size
    early_slots = [int(blocks[0]) * bs + p for p in range(3)]     # padding aimed at positions 0..2
    steps = [(0, prompt_len)] + [(prompt_len + i, 1) for i in range(new_tokens - 1)]
    try:
        inst._prompt_len = prompt_len
        rows, cached = [], False
        for i, (start, n) in enumerate(steps):
            rows.append(inst.forward(blocks, start, n))              # _execute (current batch)
            if cached:
                inst.capturer.flush_pending_save()                   # save output (last batch)
            inst.capturer.token_num_overlap = n                      # gpu_model_runner.py:2342-2343
            inst.post_process(padding=3, padding_slots=early_slots, last=i == len(steps) - 1)
            cached = True
        inst.capturer.flush_pending_save()                           # the next call's save
        inst.finish(blocks, prompt_len, [7] * (new_tokens - 1) + [EOS])
        record = inst.record()
        np.testing.assert_array_equal(record.ids, np.concatenate(rows, axis=1))
    finally:
        inst.close()


def test_mtp_draft_layers_and_rejected_drafts_stay_out_of_the_record(env, monkeypatch):
    """Draft-model MoE layers run with the proposer's ForwardMeta, which has no routing
    buffer (spec_decode/mtp.py:667-690, forward_meta.py:150): FusedMoE binds no hook
    (moe.py:745-748).  Verify steps forward [token, drafts]; a rejected draft's position is
    forwarded again by the next step, whose rows replace it."""
    rng = np.random.default_rng(9)
    inst = Instance(env, monkeypatch, "i", port=24501)
    draft_quant = fdctx.CpuExperts(4)
    draft_layer = fdctx.make_moe_layer(inst.fd_config, 1, draft_quant)
    blocks = blocks_for(rng, 3)
    prompt_len = 20
    try:
        inst._prompt_len = prompt_len
        rows = {}
        # (start, tokens forwarded, accepted): 1 + 2 drafts per verify step
        plan = [(0, prompt_len, prompt_len), (20, 3, 2), (22, 3, 3), (25, 3, 1), (26, 3, 3)]
        for i, (start, n, accepted) in enumerate(plan):
            step_rows = inst.forward(blocks, start, n)
            inst.post_process(last=i == len(plan) - 1)
            inst.capturer.flush_pending_save()
            for j in range(n):
                rows[start + j] = step_rows[:, j]
            # the proposer's forward: its ForwardMeta has no device_routing_buffer
            before = inst.capturer.get_device_routing_buffer().numpy().copy()
            calls = inst.capturer.stats()["hook_calls"]
            draft_meta = SimpleNamespace(device_routing_buffer=None)
            draft_layer.forward(paddle.zeros([accepted, 8], dtype="float32"), inst.gate, draft_meta)
            assert inst.capturer.stats()["hook_calls"] == calls
            np.testing.assert_array_equal(inst.capturer.get_device_routing_buffer().numpy(), before)
        forwarded = 29                                   # accepted positions 0..28; 29 is the last sampled
        inst.finish(blocks, prompt_len, [7] * (forwarded - prompt_len) + [EOS])
        record = inst.record()
        expected = np.stack([rows[p] for p in range(forwarded)], axis=1)
        np.testing.assert_array_equal(record.ids, expected)
        assert len(draft_quant.calls) == len(plan)       # the draft layers did run
    finally:
        inst.close()


class DictStorage:
    """Stand-in for FastDeploy's KV storage backend (mooncake / file): the two calls the
    routing paths make, ``batch_set`` from and ``get`` into raw memory
    (cache_transfer_manager.py:467-469, :497-507)."""

    def __init__(self):
        self.data = {}

    def batch_set(self, keys, target_locations, target_sizes):
        import ctypes

        for key, ptr, size in zip(keys, target_locations, target_sizes, strict=True):
            self.data[key] = ctypes.string_at(ptr, size)

    def get(self, key, target_location, target_size):
        import ctypes

        value = self.data.get(key)
        if value is None or len(value) != target_size:
            return -1
        ctypes.memmove(target_location, value, target_size)
        return target_size


def test_kv_storage_tier_brings_a_prefix_back_with_its_routes(env, monkeypatch):
    """A request's full blocks go to the KV storage tier with their rows; its GPU blocks are
    reused; a later request whose prompt extends it reads the prefix back into other GPU
    blocks (no recompute) and computes only the rest: its record is exact."""
    from fastdeploy.cache_manager import cache_transfer_manager
    from fastdeploy.cache_manager.cache_transfer_manager import CacheTransferManager

    monkeypatch.setattr(cache_transfer_manager, "logger", logging.getLogger("cache_transfer"), raising=False)
    rng = np.random.default_rng(13)
    inst = Instance(env, monkeypatch, "i", port=24601, cache={"kvcache_storage_backend": "file"})
    fd_config = inst.fd_config
    ctm = SimpleNamespace(routing_replay_config=fd_config.routing_replay_config, num_cpu_blocks=0, rank=0,
                          engine_worker_queue_port=fd_config.parallel_config.local_engine_worker_queue_port,
                          block_size=inst.block_size, num_gpu_blocks=BLOCKS, aux_data_specs={},
                          routing_host_view=None, routing_swap_buffer=None, storage_backend_type="file",
                          storage_backend=DictStorage(), key_prefix="_t")
    CacheTransferManager._init_routing_aux_data(ctm)
    try:
        bs = inst.block_size
        first = blocks_for(rng, 2)
        rows_a = inst.run(first, [(0, 2 * bs)], last=False)                 # two full blocks
        hashes = ["h0", "h1"]
        CacheTransferManager._write_routing_to_storage(ctm, hashes, list(first))
        assert len(ctm.storage_backend.data) == 2
        inst.run(first, [(0, 2 * bs)], last=False)                          # reused by another request
        again = blocks_for(rng, 3, exclude=first)
        CacheTransferManager._read_routing_from_storage(ctm, hashes, list(again[:2]))
        inst._prompt_len = 2 * bs + 5
        rows_c = inst.run(again, [(2 * bs, 5), (2 * bs + 5, 1), (2 * bs + 6, 1)])
        inst.engine.routing.finish(f"chatcmpl-exp_1:9:0:0-{UUID}_0", again, 2 * bs + 7)
        record = inst.record("exp_1:9:0:0")
        assert "missing_tokens" not in record.metadata
        np.testing.assert_array_equal(record.ids, np.concatenate([rows_a, rows_c], axis=1))
    finally:
        if ctm.routing_host_view is not None:
            ctm.routing_host_view.close()
        inst.close()
