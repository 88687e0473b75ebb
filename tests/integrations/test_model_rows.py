"""integrations/fastdeploy/model_rows.py: what the hook's row assembly is bound to, read
from a loaded model (plain stand-ins for FastDeploy's layers here; FastDeploy's own model
code runs in tests/fastdeploy_contract: test_eplb.py, test_chunked_moe.py, test_models.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from fd_routing_replay.errors import ConfigError
from fd_routing_replay.integrations.fastdeploy.model_rows import (
    expert_groups,
    placement,
    row_assembler,
)
from fdrr_dev.harness.paddle_runtime import paddle


class Model:
    """Something with FastDeploy's ``sublayers(include_self=True)``."""

    def __init__(self, layers, **attrs):
        self.layers = layers
        self.__dict__.update(attrs)

    def sublayers(self, include_self=False):
        return ([self] if include_self else []) + list(self.layers)


def moe(layer_idx, *, ep=2, manager=None, runner=True, tag=""):
    method = SimpleNamespace(ep_decoder_runner=object() if runner else None)
    return SimpleNamespace(layer_idx=layer_idx, ep_size=ep, quant_method=method, moe_tag=tag,
                           redundant_table_manger=manager, forward=lambda x: x)


def config(*, eplb=True, start=1, experts=16, chunked=False):
    return SimpleNamespace(
        eplb_config=SimpleNamespace(enable_eplb=eplb, redundant_experts_num=4),
        model_config=SimpleNamespace(moe_layer_start_index=start, moe_num_experts=experts,
                                     architectures=["Ernie4_5_MoeForCausalLM"]),
        parallel_config=SimpleNamespace(use_ep=chunked, enable_chunked_moe=chunked))


def test_only_layers_that_select_replica_slots_are_mapped():
    table = paddle.to_tensor(np.arange(5 * 20, dtype=np.int32).reshape(5, 20) % 16)
    manager = SimpleNamespace(model_ep_rank_to_expert_id_list=table)
    layers = [moe(1, manager=manager), moe(2, manager=manager, ep=1),          # EP off: apply_tp, logical
              moe(3, manager=manager, runner=False), moe(4, manager=manager)]  # no EP runner: logical
    found = placement(config(), Model(layers))
    # hook layer_idx (global - moe_layer_start_index) -> table row (the global layer moe_select reads)
    assert found.rows == (1, -1, -1, 4) and found.table is table              # FastDeploy's tensor itself
    assert placement(config(eplb=False), Model(layers)) is None
    assert placement(config(), Model([moe(1), moe(2, ep=1)])) is None          # no placement table built
    other = SimpleNamespace(model_ep_rank_to_expert_id_list=table)
    with pytest.raises(ConfigError, match="2 expert placement tables"):
        placement(config(), Model([moe(1, manager=manager), moe(2, manager=other)]))
    with pytest.raises(ConfigError, match="runner has no model"):
        placement(config(), None)


def test_expert_groups_bind_to_the_image_moe_and_fastdeploys_buffers():
    buffers = {name: paddle.zeros([8], dtype="int32") for name in ("token_type_ids", "text_index", "image_index")}
    text, image = moe(1, ep=1, tag="Text"), moe(1, ep=1, tag="Image")
    cfg = config(eplb=False, experts=[8, 8])
    groups = expert_groups(cfg, Model([text, image], _cuda_graph_buffers=buffers))
    assert groups.counts == (8, 8) and groups.token_types is buffers["token_type_ids"]
    assert image.forward.fdrr_original is not None and not hasattr(text.forward, "fdrr_original")
    assert expert_groups(config(eplb=False), Model([text, image])) is None     # int moe_num_experts
    with pytest.raises(ConfigError, match="found no text/image MoE of Ernie4_5_MoeForCausalLM"):
        expert_groups(cfg, Model([text]))


def test_the_assembly_is_made_only_when_something_needs_it():
    assert row_assembler(config(eplb=False), Model([moe(1)])) is None
    chunked = row_assembler(config(eplb=False, chunked=True), Model([moe(1)]))
    assert chunked.chunks is not None and chunked.placement is None and chunked.groups is None
