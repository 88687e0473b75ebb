"""EPLB with redundant experts: records hold logical experts, across a rebalance.

FastDeploy's own code runs: its ``RedundantExpertManger`` (worker/experts_manager.py) and
``rebalance_experts`` (worker/eplb.py) build and change the placement, its
``EPRunner.moe_select`` (layers/moe/ep.py:493-530) looks the layer's tables up and calls
``moe_redundant_topk_select`` -- the one CUDA kernel stood in, by a CPU reproduction of its
random replica choice (``cpu_kernels.RedundantTopkSelect``) -- and ``FusedMoE.forward``
binds our hook, which gets the kernel's physical replica slots.  The expert computation
after the selection is the only other stand-in (``EplbExperts``: what
``CutlassMoEMethod.apply_ep_decode`` does up to the hook, fused_moe_cutlass_backend.py:
275-289).  The TP x EP multi-rank case is in test_parallel.py.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

fdctx = pytest.importorskip("fdctx", reason="FastDeploy is not importable (see conftest)")

import drive  # noqa: E402
from cpu_kernels import RedundantTopkSelect  # noqa: E402
from eplbctx import EplbExperts, EplbModel, HotGate, eplb_config  # noqa: E402
from test_capture import Gate  # noqa: E402

EXPERTS, REDUNDANT = 254, 10
"""254 logical experts fit uint8 with its fill (255); the 264 physical slots do not: FastDeploy's
own sizing (config.py:1881-1890, redundant experts ignored) would store slots 255..263 in uint8."""


def test_records_hold_logical_experts_across_a_rebalance(env, monkeypatch, seed):
    """Every row equals the logical expert of the replica slot the kernel dispatched the
    token to, mapped with the placement of that row's step; where the kernel's draw stayed in
    the chosen expert's replicas (nearly everywhere) that is the router's own top-k.  A
    rebalance in the middle of the request changes the placement; mapping the later steps
    with the earlier table would be wrong (checked), so the test sees which table was used."""
    rng = np.random.default_rng(seed)
    kernel = RedundantTopkSelect()
    gpu = importlib.import_module("fastdeploy.model_executor.ops.gpu")
    monkeypatch.setattr(gpu, "moe_redundant_topk_select", kernel, raising=False)
    quant = EplbExperts(top_k=4)
    holder = {}

    def build(fd_config):
        holder["model"] = EplbModel(fd_config, quant)
        return holder["model"].module

    fd_config, runner, engine = drive.start(env, model={"moe_num_experts": EXPERTS}, prepare=eplb_config(REDUNDANT),
                                            loaded_model=build)
    model = holder["model"]
    hot = rng.choice(np.arange(REDUNDANT, EXPERTS), REDUNDANT, replace=False)   # not replicated at start
    gate = HotGate(rng, EXPERTS, hot)
    tables, router, inside, physical = [], [], [], []

    def forward(meta, step, n, cached):
        import paddle

        tables.append(model.table())
        kernel.calls.clear()
        for layer in model.layers:
            layer.forward(paddle.zeros([n, 8], dtype="float32"), gate, meta)      # FastDeploy's forward
        router.append(np.stack([c["logical"] for c in kernel.calls]))
        inside.append(np.stack([c["inside"] for c in kernel.calls]))
        slots = np.stack([c["physical"] for c in kernel.calls])                  # [L, n, K]
        physical.append(slots)
        rows = [layer.layer_idx for layer in model.layers]
        mapped = np.stack([tables[-1][row][np.clip(s, 0, None)] for row, s in zip(rows, slots, strict=True)])
        return np.where(slots < 0, 255, np.where(mapped < 0, 255, mapped))

    # Chunked prefill, the rebalance between the first and second chunk: the later steps
    # route several tokens (one-token steps always draw replica 0: the kernel seeds its draw
    # with the row index only, and row 0's state stays 0).
    request = drive.Request(prompt_len=40, new_tokens=4, chunks=(16, 28))
    drive.run(env, monkeypatch, fd_config, runner, request, forward, seed=seed,
              between=lambda step: model.rebalance(rng, hot) if step == 1 else None)
    record = drive.finish(env, fd_config, runner, engine, request)
    expected = drive.expected_rows(request)
    assert record.ids.dtype == np.uint8 and record.num_experts == EXPERTS
    np.testing.assert_array_equal(record.ids, expected)
    router, inside = np.concatenate(router, axis=1), np.concatenate(inside, axis=1)
    np.testing.assert_array_equal(record.ids[inside], router[inside])
    assert inside.mean() > 0.5
    physical = np.concatenate(physical, axis=1)
    assert physical.max() >= 255                          # slots FastDeploy's own uint8 could not hold
    assert (physical != router).any()                     # the hook did get physical slots
    rows = [layer.layer_idx for layer in model.layers]
    late = request.steps()[1][1]                          # rows of the steps after the rebalance
    stale = np.stack([tables[0][row][np.clip(s, 0, None)] for row, s in zip(rows, physical[:, late:], strict=True)])
    assert (stale != record.ids[:, late:]).any()          # the earlier table would have been wrong
    assert not np.array_equal(tables[0], tables[-1])
    assert record.metadata["eplb_redundant_experts"] == REDUNDANT


def test_without_expert_parallelism_the_ids_are_logical_already(env, monkeypatch, seed):
    """EPLB on, EP off: FastDeploy selects with ``apply_tp`` (no redundant select, the ids
    are logical), so nothing is mapped although the model has a placement table."""
    rng = np.random.default_rng(seed)
    quant = fdctx.CpuExperts(4)
    holder = {}

    def build(fd_config):
        holder["model"] = EplbModel(fd_config, quant, ep=1)
        return holder["model"].module

    fd_config, runner, engine = drive.start(env, model={"moe_num_experts": EXPERTS},
                                            prepare=eplb_config(REDUNDANT, ep=1), loaded_model=build)
    assert runner.routing_replay_manager.binding.assemble is None
    model = holder["model"]
    gate = Gate(rng, EXPERTS)

    def forward(meta, step, n, cached):
        import paddle

        quant.calls.clear()
        for layer in model.layers:
            layer.forward(paddle.zeros([n, 8], dtype="float32"), gate, meta)
        return np.stack(quant.calls)

    request = drive.Request(prompt_len=9, new_tokens=3)
    drive.run(env, monkeypatch, fd_config, runner, request, forward, seed=seed)
    record = drive.finish(env, fd_config, runner, engine, request)
    np.testing.assert_array_equal(record.ids, drive.expected_rows(request))


def test_eplb_without_a_loaded_model_is_refused(env):
    from fd_routing_replay.errors import ConfigError

    with pytest.raises(ConfigError, match="placement table from the loaded model"):
        drive.start(env, prepare=eplb_config(REDUNDANT))
