"""CPU stand-ins for the expert computation of FastDeploy's default (Cutlass) MoE backend.

``CutlassMoEMethod.apply_tp`` (model_executor/layers/moe/fused_moe_cutlass_backend.py:
332-507 in 2.6), for an unquantized model (``moe_quant_type`` ``w16a16``), computes

    gate_out = gate(x).cast("float32")
    ... = moe_expert_dispatch(x, gate_out, gate_correction_bias, None, top_k, False,
                              "w16a16", topk_only_mode=False)
    topk_ids_hookfunc(topk_ids=topk_idx)            # FusedMoE's routing replay hook
    ffn_out = moe_expert_ffn(permute_input, token_nums_per_expert, up_gate_proj_weight,
                             down_proj_weight, ...)
    out = moe_expert_reduce(ffn_out, topk_weights, permute_indices_per_token, topk_idx,
                            None, norm_topk_prob=True, routed_scaling_factor=1.0)

so the routing the hook records is what ``moe_expert_dispatch`` selects.  Sources:
custom_ops/gpu_ops/moe/moe_dispatch.cu (``MoeDispatchKernel``: ``topk_gating_softmax``,
a stable sort of the (token, k) pairs by expert, ``initialize_moe_routing``,
``compute_total_rows_before_expert``), moe/moe_ffn.cu (``MoeExpertFFNFunc``: per expert
``up_gate_proj`` GEMM, SwiGLU, ``down_proj`` GEMM) and moe/moe_reduce.cu
(``finalize_moe_routing``).

The CUDA kernels take bfloat16 / float16 activations; the stand-ins also take float32,
which the rig's tiny model uses so its routes can be recomputed exactly (Paddle's CPU build
has no bfloat16 matmul).  Quantized weights, grouped gating and ``topk_only_mode`` (a
``noaux_tc`` model) are refused by name.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .tensors import read, require_none

__all__ = ["moe_expert_dispatch", "moe_expert_ffn", "moe_expert_reduce", "top_k_gating"]


def top_k_gating(gating_output: np.ndarray, top_k: int, bias: np.ndarray | None = None) -> tuple:
    """``topk_gating_softmax`` (moe/fused_moe_op.h): softmax over the experts, the ``top_k``
    largest in decreasing order (ties: lower expert id first), selected by ``softmax +
    bias`` when a correction bias is given; the weights are the softmax values.  Returns
    ``(ids int32 [tokens, top_k], weights float32 [tokens, top_k])``."""
    logits = gating_output.astype(np.float32)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    probs = np.exp(shifted)
    probs /= probs.sum(axis=-1, keepdims=True)
    scores = probs + bias.reshape(1, -1).astype(np.float32) if bias is not None else probs
    order = np.argsort(-scores, axis=-1, kind="stable")[:, :top_k]
    return order.astype(np.int32), np.take_along_axis(probs, order, axis=-1).astype(np.float32)


def moe_expert_dispatch(input: Any, gating_output: Any, gating_correction_bias: Any = None,
                        w4a8_in_scale: Any = None, moe_topk: int = 1, group_moe: bool = False,
                        moe_quant_type: str = "w16a16", topk_only_mode: bool = False) -> list:
    """Top-k routing and the expert-sorted copy of the tokens (moe/moe_dispatch.cu).

    Returns ``[permute_input [tokens*k, hidden], tokens_expert_prefix_sum (int64 [experts],
    entries with expert id <= e), permute_indices_per_token (int32 [k, tokens]: where pair
    (token, j) went), topk_weight (float32 [tokens, k]), topk_idx (int32 [tokens, k]),
    expert_idx_per_token (int32 [tokens*k], sorted), dequant_scale, max_tokens_per_expert]``.
    Pairs are ordered by expert, and within an expert by ``token * k + j`` (the radix sort
    is stable).  ``max_tokens_per_expert`` (2.6's eighth output) is only read by the
    FFN of a quantized path; here the largest expert's count.
    """
    import paddle

    require_none("moe_expert_dispatch", w4a8_in_scale=w4a8_in_scale)
    if group_moe or topk_only_mode or moe_quant_type != "w16a16":
        raise NotImplementedError(f"moe_expert_dispatch stand-in: unquantized softmax top-k only (group_moe="
                                  f"{group_moe}, topk_only_mode={topk_only_mode}, quant={moe_quant_type!r})")
    x = read(input)
    gates = read(gating_output)
    experts = gates.shape[-1]
    bias = read(gating_correction_bias) if gating_correction_bias is not None else None
    ids, weights = top_k_gating(gates, moe_topk, bias)
    tokens = x.shape[0]
    flat = ids.reshape(-1)                                    # pair p = token * k + j
    order = np.argsort(flat, kind="stable")
    permute_input = x[order // moe_topk]
    where = np.empty(tokens * moe_topk, dtype=np.int32)
    where[order] = np.arange(tokens * moe_topk, dtype=np.int32)
    permute_indices = where.reshape(tokens, moe_topk).T.copy()   # [k, tokens]
    counts = np.bincount(flat, minlength=experts)
    prefix = np.cumsum(counts).astype(np.int64)
    outputs = [permute_input, prefix, permute_indices, weights, ids, flat[order].astype(np.int32),
               np.zeros(1, np.float32), np.array([counts.max() if len(flat) else 0], dtype=np.int64)]
    tensors = [paddle.to_tensor(value) for value in outputs]
    tensors[0] = tensors[0].astype(input.dtype).reshape([tokens * moe_topk, x.shape[-1]])
    return tensors


def _swiglu(h: np.ndarray) -> np.ndarray:
    gate, up = np.split(h, 2, axis=-1)
    return gate / (1.0 + np.exp(-gate)) * up


def moe_expert_ffn(permute_input: Any, tokens_expert_prefix_sum: Any, up_gate_proj_weight: Any,
                   down_proj_weight: Any, up_proj_in_scale: Any = None, up_gate_proj_bias: Any = None,
                   up_gate_proj_scale: Any = None, down_proj_scale: Any = None, down_proj_in_scale: Any = None,
                   expert_idx_per_token: Any = None, max_tokens_per_expert: Any = None,
                   quant_method: str = "w16a16", used_in_ep_low_latency: bool = False,
                   estimate_total_token_nums: int = -1, hadamard_block_size: int = 128,
                   activation: str = "swiglu") -> Any:
    """Each expert's FFN on its rows (moe/moe_ffn.cu): rows ``[prefix[e-1], prefix[e])`` of
    ``permute_input`` go through ``up_gate_proj_weight[e]`` ``[hidden, 2*inter]``, SwiGLU
    (SiLU of the first half times the second) and ``down_proj_weight[e]`` ``[inter, hidden]``.
    ``up_proj_in_scale`` receives the dispatch's ``dequant_scale`` (fused_moe_cutlass_backend.py:
    486-495), which only the FP8 paths read."""
    import paddle

    require_none("moe_expert_ffn", up_gate_proj_bias=up_gate_proj_bias,
                 up_gate_proj_scale=up_gate_proj_scale, down_proj_scale=down_proj_scale,
                 down_proj_in_scale=down_proj_in_scale)
    if quant_method != "w16a16" or used_in_ep_low_latency or activation != "swiglu":
        raise NotImplementedError(f"moe_expert_ffn stand-in: unquantized SwiGLU only (quant={quant_method!r}, "
                                  f"low_latency={used_in_ep_low_latency}, activation={activation!r})")
    x = read(permute_input)
    prefix = read(tokens_expert_prefix_sum).reshape(-1)
    w1 = read(up_gate_proj_weight)
    w2 = read(down_proj_weight)
    out = np.zeros((x.shape[0], w2.shape[-1]), dtype=x.dtype)
    start = 0
    for expert, end in enumerate(prefix):
        end = int(end)
        if end > start:
            out[start:end] = _swiglu(x[start:end] @ w1[expert]) @ w2[expert]
        start = end
    return paddle.to_tensor(out).astype(permute_input.dtype)


def moe_expert_reduce(ffn_out: Any, top_k_weight: Any, permute_indices_per_token: Any, top_k_indices: Any,
                      down_proj_bias: Any = None, norm_topk_prob: bool = True,
                      routed_scaling_factor: float = 1.0) -> Any:
    """Weighted sum of each token's expert outputs, back in token order (moe/moe_reduce.cu):
    ``out[t] = scale * sum_j w[t, j] * ffn_out[permute_indices_per_token[j, t]]`` with the
    weights renormalised to sum 1 per token when ``norm_topk_prob``."""
    import paddle

    require_none("moe_expert_reduce", down_proj_bias=down_proj_bias)
    rows = read(ffn_out)
    weights = read(top_k_weight).astype(np.float32)
    where = read(permute_indices_per_token)
    if norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    weights = weights * np.float32(routed_scaling_factor)
    gathered = rows[where.T]                                   # [tokens, k, hidden]
    out = (gathered * weights[:, :, None]).sum(axis=1).astype(rows.dtype)
    return paddle.to_tensor(out).astype(ffn_out.dtype)
