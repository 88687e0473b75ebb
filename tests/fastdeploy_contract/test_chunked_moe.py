"""Chunked MoE (``enable_chunked_moe``): recorded exactly, through FastDeploy's own forward.

``FusedMoE.forward`` takes ``forward_chunked_moe`` when expert parallelism and chunked MoE
are on (moe.py:778-781 in 2.6, :728-734 in 2.5): the experts run on
``paddle.tensor_split(x, forward_meta.moe_num_chunk)`` in order, then on an empty input until
``forward_meta.max_moe_num_chunk`` calls (what the busiest EP rank needs), every call with
the same hook.  The runner sets both counts per step (gpu_model_runner.py:440-469 in 2.6:
``ceil(tokens / chunked_moe_size)``, the maximum over the EP ranks); here another EP rank is
played by a larger maximum.  The record is compared with the top-k the layers computed.
"""

from __future__ import annotations

import numpy as np
import pytest

fdctx = pytest.importorskip("fdctx", reason="FastDeploy is not importable (see conftest)")

import drive  # noqa: E402
from test_capture import Gate  # noqa: E402

CHUNK = 8


class ChunkExperts:
    """The expert computation stood in (fdctx.CpuExperts) for inputs of any size, the empty
    ones included (FastDeploy's kernels take them); keeps each call's rows per layer."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self.calls: list[tuple[int, np.ndarray]] = []

    def apply(self, layer, x, gate, topk_ids_hookfunc=None, **kwargs):
        import paddle

        if x.shape[0] == 0:
            topk_ids = paddle.zeros([0, self.top_k], dtype="int64")
        else:
            topk_ids = paddle.topk(gate(x), self.top_k, axis=-1)[1]
        self.calls.append((layer.layer_idx, topk_ids.numpy()))
        if topk_ids_hookfunc is not None:
            topk_ids_hookfunc(topk_ids=topk_ids)
        return x


def chunked(fd_config):
    pc = fd_config.parallel_config
    pc.use_ep, pc.enable_chunked_moe, pc.chunked_moe_size = True, True, CHUNK
    pc.expert_parallel_size = 2


@pytest.mark.parametrize("other_rank_chunks", [0, 2], ids=["alone", "another-rank-has-more"])
def test_chunks_are_recorded_in_token_order(env, monkeypatch, seed, other_rank_chunks):
    rng = np.random.default_rng(seed)
    quant = ChunkExperts(top_k=4)
    fd_config, runner, engine = drive.start(env, prepare=chunked)
    assert runner.routing_replay_manager.binding.assemble.chunks is not None
    layers = [fdctx.make_moe_layer(fd_config, i, quant) for i in (1, 2, 3, 4)]
    for layer in layers:
        layer.ep_size = 2
    gate = Gate(rng, fd_config.model_config.moe_num_experts)
    calls_per_step = []

    def forward(meta, step, n, cached):
        import paddle

        meta.moe_num_chunk = -(-n // CHUNK) if n > CHUNK else 1               # gpu_model_runner.py:440-449
        meta.max_moe_num_chunk = meta.moe_num_chunk + other_rank_chunks      # :463-469, the EP ranks' max
        quant.calls.clear()
        for layer in layers:
            layer.forward(paddle.zeros([n, 8], dtype="float32"), gate, meta)   # FastDeploy's forward
        calls_per_step.append([(layer_idx, ids.shape[0]) for layer_idx, ids in quant.calls])
        return np.stack([np.concatenate([ids for layer_idx, ids in quant.calls if layer_idx == layer.layer_idx])
                         for layer in layers])

    request = drive.Request(prompt_len=21, new_tokens=5, chunks=(19,))     # 19 tokens: 3 MoE chunks
    drive.run(env, monkeypatch, fd_config, runner, request, forward, seed=seed)
    binding = runner.routing_replay_manager.binding
    assert (binding.errors, binding.mismatches) == (0, 0)
    record = drive.finish(env, fd_config, runner, engine, request)
    np.testing.assert_array_equal(record.ids, drive.expected_rows(request))
    assert "missing_tokens" not in record.metadata
    # FastDeploy did split: 19 tokens in chunks of 7, 6, 6 (tensor_split), then empty calls.
    assert calls_per_step[0][: 3 + other_rank_chunks] == [(1, 7), (1, 6), (1, 6)] + [(1, 0)] * other_rank_chunks
    assert len(calls_per_step[0]) == 4 * (3 + other_rank_chunks)
    assert calls_per_step[-1][: 1 + other_rank_chunks] == [(1, 1)] + [(1, 0)] * other_rank_chunks


def test_without_the_assembly_the_chunks_would_not_be_recorded(env, monkeypatch, seed):
    """Why chunked MoE needs the assembly: the hook is bound once per layer with the step's
    token count and called per chunk (moe.py:745-760, 817-840), so a chunk's rows alone are
    counted as a mismatch and the layer's routing is lost, never written shifted."""
    rng = np.random.default_rng(seed)
    quant = ChunkExperts(top_k=4)
    fd_config, runner, engine = drive.start(env, prepare=chunked)
    binding = runner.routing_replay_manager.binding
    binding.assemble = runner.routing_replay_manager.step.assembler = None
    layer = fdctx.make_moe_layer(fd_config, 1, quant)
    layer.ep_size = 2
    meta, _, _ = fdctx.forward_meta(runner.routing_replay_manager.get_device_routing_buffer() if drive.STEP
                                    else runner.routing_replay_manager.get_routing_table(),
                                    lens_this_time=[19], lens_decoder=[0])
    meta.moe_num_chunk = meta.max_moe_num_chunk = 3
    import paddle

    layer.forward(paddle.zeros([19, 8], dtype="float32"), Gate(rng, 300), meta)
    assert binding.mismatches == 3 and binding.errors == 3
    runner.routing_replay_manager.close()
    if engine is not None:
        engine.close()
