"""Paged causal attention on FastDeploy's KV cache, on the CPU (for the rig's tiny model).

FastDeploy's append attention (custom_ops/gpu_ops/append_attention.cu, ``AppendAttention``:
``encoder_write_cache_with_rope`` / ``decoder_write_cache_with_rope`` then the multi-query
attention kernels) writes each step's keys and values into the paged cache and attends
every query token to its sequence's cached positions ``0..p``.  This module does the same
for a float32 model, on the cache FastDeploy's runner allocates with
``AppendAttentionBackend.get_kv_cache_shape`` (layers/attention/append_attn_backend.py:
283-297): one key and one value tensor per layer, ``[num_blocks, kv_heads, block_size,
head_dim]``, in ``forward_meta.caches[2 * layer]`` / ``[2 * layer + 1]``
(gpu_model_runner.py:1560-1571).  A token at position ``p`` of sequence ``b`` lives in
block ``block_tables[b, p // block_size]`` at offset ``p % block_size``.

The step's layout comes from FastDeploy's own ``ForwardMeta``: ``batch_id_per_token``,
``cu_seqlens_q``, ``seq_lens_decoder`` (the positions already in the cache) and
``seq_lens_this_time``, filled by ``get_padding_offset`` and the runner.  No rotary
embedding is applied (the tiny model encodes positions in its input); grouped-query heads
are supported.  The computation is independent of the routing replay path: the model never
reads ``forward_meta.position_ids`` / ``slot_mapping``, which FastDeploy computes only when
routing replay is on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["StepLayout", "paged_attention", "step_layout"]


@dataclass(frozen=True)
class StepLayout:
    """Where the step's tokens are: per packed token its sequence and position, per
    sequence its first packed token, token count and cached length."""

    batch: np.ndarray          # [tokens] sequence of each token (-1: padding of an overlapped launch)
    positions: np.ndarray      # [tokens] position of each token in its sequence
    starts: np.ndarray         # [bsz] first packed token of each sequence
    counts: np.ndarray         # [bsz] tokens this step
    block_tables: np.ndarray   # [bsz, blocks_per_seq]


def step_layout(forward_meta: Any, num_tokens: int) -> StepLayout:
    """The step's layout from FastDeploy's ``ForwardMeta`` (int32 tensors on the CPU)."""
    cu = forward_meta.cu_seqlens_q.numpy().reshape(-1).astype(np.int64)
    this_time = forward_meta.seq_lens_this_time.numpy().reshape(-1).astype(np.int64)
    decoded = forward_meta.seq_lens_decoder.numpy().reshape(-1).astype(np.int64)
    bsz = len(this_time)
    starts = cu[:bsz]
    real = int(this_time.sum())
    if real > num_tokens:
        raise ValueError(f"paged attention: {num_tokens} tokens in the step, seq_lens_this_time sums to {real}")
    # an overlap-scheduled launch may carry padding tokens after the real ones (batch -1)
    batch = np.full(num_tokens, -1, dtype=np.int64)
    positions = np.zeros(num_tokens, dtype=np.int64)
    if real:
        batch[:real] = np.repeat(np.arange(bsz), this_time)
        positions[:real] = np.concatenate([decoded[b] + np.arange(this_time[b]) for b in range(bsz)])
    return StepLayout(batch=batch, positions=positions, starts=starts, counts=this_time,
                      block_tables=forward_meta.block_tables.numpy())


def _write_cache(cache: Any, values: Any, layout: StepLayout, block_size: int) -> None:
    """Store the step's keys (or values) ``[tokens, kv_heads, head_dim]`` in their slots."""
    import paddle

    for b in np.nonzero(layout.counts)[0]:
        first, count = int(layout.starts[b]), int(layout.counts[b])
        position = int(layout.positions[first])
        done = 0
        while done < count:
            pos = position + done
            block = int(layout.block_tables[b, pos // block_size])
            if block < 0:
                raise ValueError(f"paged attention: sequence {b} position {pos} has no KV block")
            offset = pos % block_size
            span = min(count - done, block_size - offset)
            chunk = values[first + done: first + done + span]                   # [span, H, D]
            cache[block, :, offset: offset + span, :] = paddle.transpose(chunk, [1, 0, 2])
            done += span


def _read_cache(cache: Any, layout: StepLayout, b: int, length: int, block_size: int) -> Any:
    """Sequence ``b``'s cached keys (or values) at positions ``0..length-1``: ``[length, H, D]``."""
    import paddle

    blocks = layout.block_tables[b, : (length + block_size - 1) // block_size]
    if (blocks < 0).any():
        raise ValueError(f"paged attention: sequence {b} reads {length} positions but its block table is "
                         f"{blocks.tolist()}")
    gathered = paddle.gather(cache, paddle.to_tensor(blocks.astype(np.int64)))      # [n, H, S, D]
    rows = paddle.transpose(gathered, [0, 2, 1, 3]).reshape([-1, cache.shape[1], cache.shape[3]])
    return rows[:length]


def paged_attention(q: Any, k: Any, v: Any, key_cache: Any, value_cache: Any, layout: StepLayout,
                    block_size: int, scale: float) -> Any:
    """Write ``k``/``v`` ``[tokens, kv_heads, head_dim]`` into the caches, then attend each
    query ``[tokens, heads, head_dim]`` to its sequence's positions ``0..p``; returns
    ``[tokens, heads * head_dim]``."""
    import paddle

    _write_cache(key_cache, k, layout, block_size)
    _write_cache(value_cache, v, layout, block_size)
    tokens, heads, head_dim = q.shape
    group = heads // k.shape[1]
    out = paddle.zeros([tokens, heads, head_dim], dtype=q.dtype)
    for b in np.nonzero(layout.counts)[0]:
        first, count = int(layout.starts[b]), int(layout.counts[b])
        length = int(layout.positions[first + count - 1]) + 1
        keys = _read_cache(key_cache, layout, b, length, block_size)               # [L, Hk, D]
        values = _read_cache(value_cache, layout, b, length, block_size)
        if group > 1:
            keys = paddle.repeat_interleave(keys, group, axis=1)
            values = paddle.repeat_interleave(values, group, axis=1)
        query = paddle.transpose(q[first: first + count], [1, 0, 2])               # [H, n, D]
        scores = paddle.matmul(query, paddle.transpose(keys, [1, 2, 0])) * scale   # [H, n, L]
        query_pos = paddle.to_tensor(layout.positions[first: first + count].reshape(-1, 1))
        key_pos = paddle.arange(length, dtype="int64").reshape([1, -1])
        scores = paddle.where((key_pos <= query_pos).unsqueeze(0), scores,
                              paddle.full_like(scores, float("-inf")))
        weights = paddle.nn.functional.softmax(scores, axis=-1)
        out[first: first + count] = paddle.transpose(paddle.matmul(weights, paddle.transpose(values, [1, 0, 2])),
                                                     [1, 0, 2])
    return out.reshape([tokens, heads * head_dim])
