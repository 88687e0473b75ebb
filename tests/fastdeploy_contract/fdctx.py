"""FastDeploy objects for the contract tests: real configs, real runner/worker classes.

What is real: ``FDConfig`` and its parts built by FastDeploy's own constructors from a
tiny ``config.json``, FastDeploy's plugin loader, ``GpuWorker.initialize_cache``,
``GPUModelRunner`` methods, ``FusedMoE.forward``, FastDeploy's token processor.  What is
stood in (each says why): the GPU KV-cache allocation, the quantized expert computation.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import paddle
from fastdeploy import config as fd_config_module
from fastdeploy.worker import gpu_worker

from fd_routing_replay.integrations.fastdeploy.api import STEP_BUFFER, detect_api

API = detect_api()
GENERATION = API.generation

MODEL = {
    "architectures": ["Ernie4_5_MoeForCausalLM"], "hidden_size": 64, "num_hidden_layers": 5,
    "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1000,
    "intermediate_size": 128, "moe_num_experts": 300, "moe_k": 4, "moe_layer_start_index": 1,
    "moe_intermediate_size": 32, "max_position_embeddings": 512, "dtype": "bfloat16",
}
"""300 experts: uint16 routing, so a bfloat16 mix-up cannot hide (ids above 256)."""


def make_fd_config(tmp_path: Path, *, routing: dict[str, Any] | None = None, model: dict[str, Any] | None = None,
                   cache: dict[str, Any] | None = None, max_num_seqs: int = 8, max_model_len: int = 256,
                   block_size: int = 16, port: int = 0) -> Any:
    """A real ``FDConfig`` (FastDeploy's constructors, its RoutingReplayConfig parsing)."""
    C = fd_config_module
    port = port or 20000 + (abs(hash(str(tmp_path))) % 20000)   # names the engine's slot cache
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(dict(MODEL, **(model or {}))))
    mc = C.ModelConfig({"model": str(model_dir), "max_model_len": max_model_len})
    rr = C.RoutingReplayConfig({"enable_routing_replay": True, "local_store_dir": str(tmp_path / "store"),
                                **(routing or {})})
    cc = C.CacheConfig({"block_size": block_size, "model_cfg": mc, **(cache or {})})
    fd_config = C.FDConfig(
        model_config=mc, cache_config=cc, parallel_config=C.ParallelConfig({"tensor_parallel_size": 1, "engine_worker_queue_port": str(port)}),
        scheduler_config=C.SchedulerConfig({"max_num_seqs": max_num_seqs, "max_num_batched_tokens": 256}),
        load_config=C.LoadConfig({}), graph_opt_config=C.GraphOptimizationConfig({}),
        routing_replay_config=rr, device_config=C.DeviceConfig({}), speculative_config=C.SpeculativeConfig({}))
    # Set by the worker's distributed start-up (worker_process.py); one rank here.
    fd_config.parallel_config.tp_group = None
    return fd_config


def runner_class() -> type:
    """The runner class FastDeploy's own plugin loader returns (FD_PLUGINS=fd_routing_replay)."""
    from fastdeploy.plugins.model_runner import load_model_runner_plugins

    return load_model_runner_plugins()


def make_runner(cls: type, fd_config: Any, num_blocks: int) -> Any:
    """A runner instance without GPU state; only what the routing replay paths read."""
    runner = cls.__new__(cls)
    runner.fd_config = fd_config
    runner.scheduler_config = fd_config.scheduler_config
    runner.cache_config = fd_config.cache_config
    runner.model_config = fd_config.model_config
    runner.routing_replay_manager = None
    runner.speculative_method = None          # 2.5 / develop
    runner.spec_method = None                 # 2.6
    runner.num_gpu_blocks = num_blocks
    max_seqs = fd_config.scheduler_config.max_num_seqs
    width = (fd_config.model_config.max_model_len + fd_config.cache_config.block_size - 1) // \
        fd_config.cache_config.block_size
    runner.share_inputs = {
        "block_tables": paddle.full([max_seqs, width], -1, dtype="int32"),
        "stop_flags": paddle.zeros([max_seqs, 1], dtype="bool"),
    }
    runner.prompt_logprobs_reqs = {}
    runner.in_progress_prompt_logprobs = {}
    runner.forward_batch_reqs_list = [None] * max_seqs
    # Stand-in: allocating the KV cache needs a GPU; update_share_input_block_num calls it.
    runner.initialize_kv_cache = lambda *a, **k: None
    return runner


def make_worker(runner: Any, fd_config: Any) -> Any:
    """FastDeploy's ``GpuWorker`` around ``runner`` (its constructor probes the GPU)."""
    worker = gpu_worker.GpuWorker.__new__(gpu_worker.GpuWorker)
    worker.fd_config = fd_config
    worker.model_runner = runner
    return worker


class CpuExperts:
    """Stand-in for the quantized expert computation (CUDA/Triton kernels): the gate's top-k
    on the CPU, then the hook FastDeploy passes, exactly where every backend calls it."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self.calls: list[np.ndarray] = []

    def apply(self, layer: Any, x: Any, gate: Any, topk_ids_hookfunc: Any = None, **kwargs: Any) -> Any:
        scores = gate(x)
        topk_ids = paddle.topk(scores, self.top_k, axis=-1)[1]
        self.calls.append(topk_ids.numpy())
        if topk_ids_hookfunc is not None:
            topk_ids_hookfunc(topk_ids=topk_ids)
        return x


def make_moe_layer(fd_config: Any, layer_idx: int, quant: CpuExperts) -> Any:
    """A real ``FusedMoE`` object (its forward is FastDeploy's) without expert weights."""
    moe = importlib.import_module("fastdeploy.model_executor.layers.moe.moe")
    layer = moe.FusedMoE.__new__(moe.FusedMoE)
    paddle.nn.Layer.__init__(layer)
    layer.fd_config = fd_config
    layer.enable_routing_replay = fd_config.routing_replay_config.enable_routing_replay
    layer.layer_idx = layer_idx
    layer.quant_method = quant
    layer.ep_size = layer.tp_size = layer.attn_tp_size = 1
    layer.reduce_results = False
    layer.tp_group = None
    layer.moe_tag = ""                    # FusedMoE.__init__'s defaults (moe.py:181-189 in 2.6)
    layer.redundant_table_manger = None
    layer.topk_method = ""
    layer.gate_correction_bias = None
    layer.hidden_size = fd_config.model_config.hidden_size
    return layer


def forward_meta(buffer: Any, *, lens_this_time: list[int], lens_decoder: list[int]) -> Any:
    """The ForwardMeta fields FusedMoE.forward reads, for a step with these sequences."""
    batch = np.repeat(np.arange(len(lens_this_time)), lens_this_time).astype("int32")
    cu = np.concatenate([[0], np.cumsum(lens_this_time)]).astype("int32")
    positions = np.concatenate([np.arange(d, d + n) for d, n in zip(lens_decoder, lens_this_time, strict=True)]).astype("int64")
    meta = SimpleNamespace(
        batch_id_per_token=paddle.to_tensor(batch), cu_seqlens_q=paddle.to_tensor(cu),
        seq_lens_decoder=paddle.to_tensor(np.array(lens_decoder, dtype="int32")),
        position_ids=paddle.to_tensor(positions))
    if GENERATION == STEP_BUFFER:
        meta.device_routing_buffer = buffer
    else:
        meta.routing_replay_table = buffer
    return meta, batch, positions
