"""CPU stand-ins that compute, for FastDeploy kernels the EPLB, multimodal and model-matrix
contract tests run through (the ones ``tests/fdcpu`` does not provide).

Each reproduces the CUDA kernel it names (custom_ops/gpu_ops in the public
PaddlePaddle/FastDeploy repository), read from its source; none is FastDeploy's code.

=====================================  =====================================================
stand-in                               CUDA source
=====================================  =====================================================
:class:`RedundantTopkSelect`           moe/moe_redundant_topk_select.cu (the
                                       ``apply_norm_weight`` path: ``moe_softmax`` then
                                       ``moe_redundant_top_k_normed``, moe/fused_moe_op.h)
=====================================  =====================================================
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["RedundantTopkSelect", "softmax_topk", "xorwow"]

_MASK = 0xFFFFFFFF


def read(tensor: Any) -> np.ndarray:
    return np.array(tensor.numpy()) if hasattr(tensor, "numpy") else np.asarray(tensor)


def xorwow(state: int) -> int:
    """``xorwow_moe`` (moe/fused_moe_op.h): the kernel's per-row random step (uint32)."""
    state ^= state >> 7
    state ^= (state << 9) & _MASK
    state ^= state >> 13
    return state & _MASK


def _c_int(value: int) -> int:
    """``(int)`` of a uint32, two's complement (what nvcc does)."""
    return value - (1 << 32) if value >= 1 << 31 else value


def _c_mod(a: int, b: int) -> int:
    """C's ``%``: truncates toward zero, the result takes the dividend's sign."""
    return int(np.fmod(a, b))


def softmax_topk(logits: np.ndarray, top_k: int, bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' selection: float32 softmax over the experts, the ``top_k`` best of
    ``softmax + bias`` (ties: the lower expert id); ``(ids [n, k], softmax [n, E])``."""
    logits = logits.astype(np.float32)
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32)
    scores = probs + bias.reshape(1, -1).astype(np.float32) if bias is not None else probs
    return np.argsort(-scores, axis=1, kind="stable")[:, :top_k], probs


class RedundantTopkSelect:
    """``moe_redundant_topk_select`` (EPLB's top-k with redundant experts), on the CPU.

    Per token row: softmax over the logical experts (float32); the ``k`` best of
    ``softmax + bias`` in turn (ties: the lower expert id, as ``cub::ArgMax``); for each, a
    replica drawn from the per-row random state ``state = block_row + blockIdx.x * 256``
    (blocks of 256 threads; one block per row up to 1024 rows, else a ``[ceil(n/256), 256]``
    grid, ``Get1DBlocksAnd2DGridsMoe``), ``state = xorwow(state)``,
    ``select = (int)state % expert_in_rank_num_list[e]`` and the physical slot
    ``expert_id_to_ep_rank_array[e * (R + 1) + select]``; ``tokens_per_expert_stats_list[e]``
    += 1; the weights are the softmax values over their sum.  Returns ``[topk_ids int64,
    topk_weights float32]`` like the op.

    The draw is cast to a signed int before the modulo, as the kernel does: a draw of 2^31
    or more gives a negative ``select``, so the kernel then reads the slot *before* the
    chosen expert's row (another expert's replica, or -1).  Reproduced: the slot read there
    is returned (-1 where the kernel would read before the array).  ``signed_draw=False``
    takes the modulo of the unsigned draw instead, so every slot is a replica of the chosen
    expert (for a test that compares records with the router's top-k row by row; the signed
    draw is exercised in test_eplb.py).  ``calls`` keeps, per call, the logical choice, the
    slots and whether each draw stayed inside the chosen expert's replicas.
    """

    def __init__(self, *, signed_draw: bool = True) -> None:
        self.signed_draw = signed_draw
        self.calls: list[dict[str, np.ndarray]] = []

    def __call__(self, gating_logits: Any, expert_id_to_ep_rank_array: Any, expert_in_rank_num_list: Any,
                 tokens_per_expert_stats_list: Any, bias: Any = None, moe_topk: int = 1,
                 apply_norm_weight: bool = True, enable_softmax_top_k_fused: bool = False,
                 redundant_ep_rank_num_plus_one: int = 1) -> list[Any]:
        import paddle

        if not apply_norm_weight or enable_softmax_top_k_fused:
            raise NotImplementedError("moe_redundant_topk_select stand-in: the apply_norm_weight, unfused "
                                      "path only (what FastDeploy's EPRunner.moe_select calls)")
        logits = read(gating_logits).astype(np.float32)
        rows, experts = logits.shape
        logical, probs = softmax_topk(logits, moe_topk, read(bias) if bias is not None else None)
        table = read(expert_id_to_ep_rank_array).reshape(-1)
        replicas = read(expert_in_rank_num_list).reshape(-1)
        width = int(redundant_ep_rank_num_plus_one)
        physical = np.empty_like(logical)
        inside = np.ones(logical.shape, bool)
        grid_x = rows if rows <= 1024 else -(-rows // 256)
        for row in range(rows):
            block_x = row if rows <= 1024 else row % grid_x
            state = (row + block_x * 256) & _MASK
            for j in range(moe_topk):
                state = xorwow(state)
                expert = int(logical[row, j])
                select = _c_mod(_c_int(state) if self.signed_draw else state, int(replicas[expert]))
                flat = expert * width + select
                inside[row, j] = select >= 0
                physical[row, j] = table[flat] if flat >= 0 else -1
        weights = np.take_along_axis(probs, logical, axis=1)
        weights = weights / weights.sum(axis=1, keepdims=True)
        stats = read(tokens_per_expert_stats_list)
        stats += np.bincount(logical.reshape(-1), minlength=experts).astype(stats.dtype)
        tokens_per_expert_stats_list.copy_(paddle.to_tensor(stats), False)
        self.calls.append({"logical": logical.astype(np.int64), "physical": physical.astype(np.int64),
                           "inside": inside})
        return [paddle.to_tensor(physical.astype(np.int64)), paddle.to_tensor(weights.astype(np.float32))]
