"""Tiny random Hugging Face MoE models, a capture of what each MoE block dispatched, and a
NumPy reference of each family's routing weights (tests/trainers/test_hf.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import transformers

VOCAB = 64
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64, attn_implementation="eager")


def _qwen3(layers: int) -> Any:
    # Layer 0 dense (mlp_only_layers): the record's layer map skips it.
    return transformers.Qwen3MoeConfig(**_COMMON, num_hidden_layers=layers, head_dim=8,
                                       intermediate_size=48, moe_intermediate_size=16,
                                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                       mlp_only_layers=[0])


def _qwen2(layers: int) -> Any:
    return transformers.Qwen2MoeConfig(**_COMMON, num_hidden_layers=layers, intermediate_size=48,
                                       moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)


def _mixtral(layers: int) -> Any:
    return transformers.MixtralConfig(**_COMMON, num_hidden_layers=layers, intermediate_size=16,
                                      num_local_experts=4, num_experts_per_tok=2)


def _deepseek_v3(layers: int) -> Any:
    # MLA needs as many KV heads as heads; first_k_dense_replace=1: layer 0 is dense.
    common = {**_COMMON, "num_key_value_heads": 4}
    return transformers.DeepseekV3Config(
        **common, num_hidden_layers=layers, intermediate_size=48, moe_intermediate_size=16,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=None, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5,
        norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _gpt_oss(layers: int) -> Any:
    return transformers.GptOssConfig(**_COMMON, num_hidden_layers=layers, head_dim=8,
                                     intermediate_size=16, num_local_experts=4,
                                     num_experts_per_tok=2,
                                     layer_types=["full_attention"] * layers)


def _ernie(layers: int) -> Any:
    return transformers.Ernie4_5_MoeConfig(**_COMMON, num_hidden_layers=layers,
                                           intermediate_size=48, moe_intermediate_size=16,
                                           moe_num_experts=8, moe_k=2, moe_layer_start_index=1,
                                           moe_num_shared_experts=1)


CONFIGS = {"qwen3_moe": _qwen3, "qwen2_moe": _qwen2, "mixtral": _mixtral,
           "deepseek_v3": _deepseek_v3, "gpt_oss": _gpt_oss, "ernie4_5_moe": _ernie}


def tiny_model(model_type: str, layers: int = 3, seed: int = 0) -> Any:
    """A randomly initialised ``*ForCausalLM`` of ``model_type`` (hidden 32, 4-8 experts)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[model_type](layers))
    with torch.no_grad():  # ERNIE / DeepSeek start their choice bias at zero: make it matter
        for name, buffer in model.named_buffers():
            if "e_score_correction_bias" in name:
                buffer.uniform_(-0.1, 0.1)
    return model.train()


def _block(router_name: str, model: Any) -> Any:
    return model.get_submodule(router_name.rsplit(".", 1)[0])


@dataclass
class Capture:
    """What each MoE block's experts received, per decoder layer, one entry per call:
    ``ids[layer]`` int64 ``[tokens, K]``, ``weights[layer]`` float64, and the router's own
    output before any replay hook (``live_ids``, ``logits``)."""

    ids: dict[int, list[np.ndarray]] = field(default_factory=dict)
    weights: dict[int, list[np.ndarray]] = field(default_factory=dict)
    live_ids: dict[int, list[np.ndarray]] = field(default_factory=dict)
    logits: dict[int, list[np.ndarray]] = field(default_factory=dict)
    handles: list[Any] = field(default_factory=list)

    def last(self, layer: int) -> np.ndarray:
        return self.ids[layer][-1]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def capture(model: Any) -> Capture:
    """Hooks on every MoE block's experts (the ids and weights it dispatched with) and on
    every router (its live output); register before replay so the router hook runs first."""
    from fd_routing_replay.trainers.hf.patch import moe_routers

    seen = Capture()
    for router in moe_routers(model):
        layer = router.layer
        for store in (seen.ids, seen.weights, seen.live_ids, seen.logits):
            store[layer] = []

        def on_router(module, args, output, layer=layer):
            seen.logits[layer].append(output[0].detach().double().numpy())
            seen.live_ids[layer].append(output[2].detach().numpy().astype(np.int64))

        def on_experts(module, args, kwargs, layer=layer):
            values = list(args) + [kwargs[k] for k in kwargs]
            seen.ids[layer].append(values[1].detach().numpy().astype(np.int64))
            seen.weights[layer].append(values[2].detach().double().numpy())

        seen.handles.append(router.module.register_forward_hook(on_router))
        experts = _block(router.name, model).experts
        # A pre-hook: a checkpoint recompute may stop before the experts return.
        seen.handles.append(experts.register_forward_pre_hook(on_experts, with_kwargs=True))
    return seen


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def reference_weights(model_type: str, config: Any, logits: np.ndarray,
                      ids: np.ndarray) -> np.ndarray:
    """Each family's routing weights at ``ids`` from the router's ``logits`` (NumPy)."""
    if model_type == "gpt_oss":
        return _softmax(np.take_along_axis(logits, ids, axis=1))
    if model_type == "deepseek_v3":
        w = np.take_along_axis(1.0 / (1.0 + np.exp(-logits)), ids, axis=1)
        if config.norm_topk_prob:
            w = w / (w.sum(axis=1, keepdims=True) + 1e-20)
        return w * config.routed_scaling_factor
    w = np.take_along_axis(_softmax(logits), ids, axis=1)
    if model_type == "ernie4_5_moe":
        return w / np.maximum(w.sum(axis=1, keepdims=True), config.moe_norm_min)
    if model_type == "mixtral" or config.norm_topk_prob:
        return w / w.sum(axis=1, keepdims=True)
    return w
