"""Tiny random PaddleFormers MoE models on the CPU (paddleformers 1.2.0's own modeling code)
and probes that record what each MoE block and each expert received."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from tests.trainers.paddle.standins import install_paddlefleet_probe

install_paddlefleet_probe()

import paddle  # noqa: E402

VOCAB = 64
HIDDEN = 32


def tiny_deepseek_v3(seed: int = 0, **overrides: Any) -> Any:
    """4 decoder layers (layer 0 dense), 8 routed experts in 2 groups, top-2, a shared
    expert, ``noaux_tc`` with a nonzero correction bias (so the bias changes the choice)."""
    from paddleformers.transformers.deepseek_v3.configuration import DeepseekV3Config
    from paddleformers.transformers.deepseek_v3.modeling import DeepseekV3ForCausalLM

    settings = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64, norm_topk_prob=True,
        routed_scaling_factor=2.5, topk_method="noaux_tc",
        rope_scaling={"rope_type": "default", "factor": 1.0},   # modeling.py:661 reads "factor"
        fuse_rms_norm=False)                                     # fused_rms_norm_ext: GPU only
    settings.update(overrides)
    config = DeepseekV3Config(**settings)
    for key, value in overrides.items():      # the base class resets some (MTP) after init
        setattr(config, key, value)
    paddle.seed(seed)
    model = DeepseekV3ForCausalLM(config)
    gen = np.random.default_rng(seed)
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.weight.set_value(gen.normal(0, 1, gate.weight.shape).astype("float32"))
            gate.e_score_correction_bias.set_value(
                gen.normal(0, 0.5, gate.e_score_correction_bias.shape).astype("float32"))
    return model


def tiny_ernie(seed: int = 0, **overrides: Any) -> Any:
    """4 decoder layers (layer 0 dense), 8 experts, top-2, aux-free correction bias."""
    from paddleformers.transformers.ernie4_5_moe.configuration import Ernie4_5_MoeConfig
    from paddleformers.transformers.ernie4_5_moe.modeling import Ernie4_5_MoeForCausalLM

    settings = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        moe_num_experts=8, moe_k=2, moe_layer_start_index=1, moe_num_shared_experts=0,
        max_position_embeddings=64, num_nextn_predict_layers=0, fuse_rms_norm=False)
    settings.update(overrides)
    paddle.seed(seed)
    model = Ernie4_5_MoeForCausalLM(Ernie4_5_MoeConfig(**settings))
    gen = np.random.default_rng(seed)
    for layer in model.model.layers:
        statics = getattr(layer.mlp, "moe_statics", None)
        if statics is not None:
            bias = statics.e_score_correction_bias
            bias.set_value(gen.normal(0, 0.1, bias.shape).astype("float32"))
    return model


class ExpertProbe:
    """Forward pre-hooks on each MoE block and on each of its experts: which tokens (rows of
    the block's flattened input) every expert was given, found by matching the rows."""

    def __init__(self, blocks: dict[int, Any]) -> None:
        self.inputs: dict[int, list[np.ndarray]] = defaultdict(list)
        self.expert_rows: dict[int, list[dict[int, np.ndarray]]] = defaultdict(list)
        self._hooks = []
        for layer, block in blocks.items():
            self._hooks.append(block.register_forward_pre_hook(self._block(layer)))
            for expert_id, expert in enumerate(block.experts):
                if expert is not None:
                    self._hooks.append(expert.register_forward_pre_hook(
                        self._expert(layer, expert_id)))

    def _block(self, layer: int):
        def grab(module, inputs):
            hidden = inputs[0].detach().numpy()
            self.inputs[layer].append(hidden.reshape(-1, hidden.shape[-1]))
            self.expert_rows[layer].append({})
        return grab

    def _expert(self, layer: int, expert_id: int):
        def grab(module, inputs):
            self.expert_rows[layer][-1][expert_id] = inputs[0].detach().numpy()
        return grab

    def tokens_of_experts(self, layer: int, call: int = -1) -> dict[int, set[int]]:
        """Expert id -> the token rows it processed in that call (all-zero placeholder rows,
        which PaddleFormers feeds an expert without tokens, are left out)."""
        hidden = self.inputs[layer][call]
        found = {}
        for expert_id, rows in self.expert_rows[layer][call].items():
            tokens = set()
            for row in rows.reshape(-1, rows.shape[-1]):
                match = np.flatnonzero((hidden == row).all(axis=1))
                if match.size == 0:
                    assert not row.any(), f"expert {expert_id} got a row of no token"
                    continue
                assert match.size == 1, "two tokens share a hidden state: use other inputs"
                tokens.add(int(match[0]))
            found[expert_id] = tokens
        return found

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
