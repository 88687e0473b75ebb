"""FastDeploy's EPLB pieces for the contract tests (test_eplb.py, parallel_rank.py).

FastDeploy's own ``RedundantExpertManger`` (worker/experts_manager.py) holds the placement,
its ``rebalance_experts`` (worker/eplb.py) changes it, its ``EPRunner.moe_select``
(layers/moe/ep.py:493-530) selects through it; only the expert computation after the
selection is stood in (:class:`EplbExperts`).
"""

from __future__ import annotations

import fdctx
import numpy as np
from test_capture import Gate

EP = 2


class EplbExperts:
    """``apply_ep_decode`` up to the hook: the gate in float32, FastDeploy's own
    ``EPRunner.moe_select``, the hook with its ``topk_idx`` (the DeepEP dispatch and the expert
    FFN after it are not what is under test; the layer's output is its input)."""

    def __init__(self, top_k: int, kernel=None) -> None:
        from fastdeploy.model_executor.layers.moe.ep import EPRunner

        self.ep_decoder_runner = EPRunner.__new__(EPRunner)       # init_ep's runner, without DeepEP
        self.ep_decoder_runner.top_k = top_k
        self.kernel = kernel              # the moe_redundant_topk_select stand-in, for calls
        self.calls: list[np.ndarray] = []

    def apply(self, layer, x, gate, topk_ids_hookfunc=None, **kwargs):
        gate_out = gate(x).cast("float32")
        topk_idx, _ = self.ep_decoder_runner.moe_select(layer, gate_out)
        if self.kernel is not None:       # the router's logical top-k (not what the hook gets)
            self.calls.append(self.kernel.calls[-1]["logical"])
        if topk_ids_hookfunc is not None:
            topk_ids_hookfunc(topk_ids=topk_idx)
        return x


class HotGate(Gate):
    """Random scores, the ``hot`` experts ahead: most tokens pick replicated experts once the
    rebalance has replicated them, so their replicas are drawn."""

    def __init__(self, rng, num_experts, hot) -> None:
        super().__init__(rng, num_experts)
        self.bonus = np.zeros(num_experts, np.float32)
        self.bonus[hot] = 0.3

    def forward(self, x):
        import paddle

        return paddle.to_tensor(self.rng.random((x.shape[0], self.num_experts)).astype("float32") + self.bonus)


def eplb_config(redundant: int, ep: int = EP):
    """An ``FDConfig`` preparation: EPLB on with ``redundant`` experts, EP ``ep``."""
    def prepare(fd_config):
        from fastdeploy.config import EPLBConfig

        fd_config.eplb_config = EPLBConfig({"enable_eplb": True, "redundant_experts_num": redundant})
        fd_config.parallel_config.expert_parallel_size = ep
    return prepare


class EplbModel:
    """The MoE layers of an ERNIE-4.5 MoE model under EPLB, as ``Ernie4_5_Model`` wires them
    (models/ernie4_5_moe.py:423-446): one ``RedundantExpertManger`` shared by every layer."""

    def __init__(self, fd_config, quant, ep: int = EP) -> None:
        import paddle
        from fastdeploy.worker.experts_manager import RedundantExpertManger

        from fd_routing_replay.integrations.fastdeploy.setup import moe_layer_map

        model = fd_config.model_config
        self.manager = RedundantExpertManger(n_routed_experts=model.moe_num_experts,
                                             num_hidden_layers=model.num_hidden_layers,
                                             redundant_experts_num=fd_config.eplb_config.redundant_experts_num,
                                             ep_size=ep)
        self.layers = []
        for layer_idx in moe_layer_map(model):
            layer = fdctx.make_moe_layer(fd_config, layer_idx, quant)
            layer.ep_size = ep
            layer.top_k = model.moe_k
            layer.redundant_table_manger = self.manager
            self.layers.append(layer)
        self.module = paddle.nn.LayerList(self.layers)

    def table(self) -> np.ndarray:
        return self.manager.model_ep_rank_to_expert_id_list.numpy().copy()

    def rebalance(self, rng, hot=()) -> None:
        """FastDeploy's own rebalance on fresh token statistics (``hot`` experts the busiest,
        so they get the redundant replicas), applied the way the worker applies it
        (worker_process.py:314-317)."""
        from fastdeploy.worker.eplb import rebalance_experts

        m = self.manager
        stats = rng.integers(1, 1000, (m.num_hidden_layers, m.num_expert))
        stats[:, list(hot)] += 100_000
        ranks, logical_to_physical, counts = rebalance_experts(stats, m.num_replicas, m.num_groups,
                                                               m.num_nodes, m.num_gpus)
        m.update_expert_rank_table(ranks, logical_to_physical, counts)
