"""Pure-numpy reference implementations of the routing custom ops.

These functions define what the compiled ops (custom_ops/routing_kernels.h and .cuh)
must compute: the tests use them as the oracle, and fd_routing_replay.ops falls back to
them (with one warning) when the compiled ops cannot load.  They work on numpy arrays;
the ops hand them zero-copy views of CPU Paddle tensors.  Arguments are assumed to be
validated by ops.checks (dtypes, ranks, shapes); index *values* are handled here exactly as
the kernels handle them: out-of-range tokens are skipped, bad expert ids are counted.
"""

from __future__ import annotations

import numpy as np

ROUTING_DTYPES: tuple[np.dtype, ...] = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32))


def fill_of(dtype: np.dtype) -> int:
    """The "no routing" fill of a routing dtype: its maximum (all bits set)."""
    return int(np.iinfo(dtype).max)


def record_routing_np(
    table: np.ndarray,
    topk_ids: np.ndarray,
    batch_id_per_token: np.ndarray,
    cu_seqlens_q: np.ndarray,
    seq_lens_decoder: np.ndarray,
    layer: int,
    num_experts: int,
) -> int:
    """Write one MoE layer's top-k ids into ``table`` in place; return the bad-id count.

    For token ``t`` of sequence ``b = batch_id_per_token[t]`` at position
    ``p = seq_lens_decoder[b] + t - cu_seqlens_q[b]``, ``table[b, p, layer, :]`` receives
    ``topk_ids[t, :]``.  Padding (``b < 0``), ``b`` past the table or the index arrays
    (``cu_seqlens_q`` needs ``b + 1`` entries), a token outside its sequence's span
    ``[cu_seqlens_q[b], cu_seqlens_q[b+1])`` (a stale batch id) and ``p`` outside
    ``[0, max_len)`` are skipped.  Ids outside ``[0, num_experts)`` are
    written as the fill value and counted (written tokens only).
    """
    max_num_seqs, max_len = table.shape[0], table.shape[1]
    batch = batch_id_per_token.reshape(-1).astype(np.int64, copy=False)
    cu = cu_seqlens_q.reshape(-1).astype(np.int64, copy=False)
    dec = seq_lens_decoder.reshape(-1).astype(np.int64, copy=False)
    num_tokens = batch.shape[0]
    if num_tokens == 0:
        return 0
    seq_bound = min(max_num_seqs, cu.shape[0] - 1, dec.shape[0])
    tokens = np.flatnonzero((batch >= 0) & (batch < seq_bound))
    seqs = batch[tokens]
    inside = (tokens >= cu[seqs]) & (tokens < cu[seqs + 1])   # a stale batch id is skipped
    tokens, seqs = tokens[inside], seqs[inside]
    positions = dec[seqs] + tokens - cu[seqs]
    keep = (positions >= 0) & (positions < max_len)
    tokens, seqs, positions = tokens[keep], seqs[keep], positions[keep]
    ids = topk_ids[tokens].astype(np.int64, copy=False)
    bad = (ids < 0) | (ids >= num_experts)
    values = np.where(bad, fill_of(table.dtype), ids).astype(table.dtype)
    table[seqs, positions, layer, :] = values
    return int(np.count_nonzero(bad))


def record_rows_np(buffer: np.ndarray, topk_ids: np.ndarray, layer: int, num_experts: int) -> int:
    """Token-major step buffer: ``buffer[t, layer, :] = topk_ids[t, :]`` for every token.

    ``buffer`` is ``[max_batched_tokens, L, K]``; token ``t`` of the step is row ``t``
    (no index arrays).  Ids outside ``[0, num_experts)`` are written as the fill value;
    returns their count.
    """
    num_tokens = topk_ids.shape[0]
    if num_tokens == 0:
        return 0
    ids = topk_ids.astype(np.int64, copy=False)
    bad = (ids < 0) | (ids >= num_experts)
    buffer[:num_tokens, layer, :] = np.where(bad, fill_of(buffer.dtype), ids).astype(buffer.dtype)
    return int(np.count_nonzero(bad))


def plan_step_np(decoder: np.ndarray, this_time: np.ndarray, tracked: np.ndarray | None,
                 block_table: np.ndarray | None, block_size: int) -> tuple[np.ndarray, ...]:
    """Reference of the compiled step plan (see ``fd_routing_replay.ops.plan_step``)."""
    forwarded = np.maximum(this_time, 0)
    step_ends = np.cumsum(forwarded)
    mask = forwarded > 0
    if tracked is not None:
        mask &= tracked
    active = np.flatnonzero(mask)
    counts = forwarded[active]
    total = int(counts.sum())
    relative = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    batch_ids = np.repeat(active, counts).astype(np.int64)
    positions = relative + np.repeat(decoder[active], counts)
    rows = relative + np.repeat(step_ends[active] - counts, counts)
    slots = np.full(total, -1, dtype=np.int64)
    if block_table is not None and total:
        index = np.where(positions >= 0, positions // block_size, -1)
        ok = (index >= 0) & (index < block_table.shape[1]) & (batch_ids < block_table.shape[0])
        blocks = np.full(total, -1, dtype=np.int64)
        blocks[ok] = block_table[batch_ids[ok], index[ok]]
        ok &= blocks >= 0
        slots[ok] = blocks[ok] * block_size + positions[ok] % block_size
    return batch_ids, positions, rows, slots, active.astype(np.int64), int(step_ends[-1]) if len(step_ends) else 0


def scatter_rows_np(cache: np.ndarray, staging: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> int:
    """Reference of the compiled scatter: ``cache[slots[i]] = staging[rows[i]]`` where in range."""
    ok = (slots >= 0) & (slots < cache.shape[0]) & (rows >= 0) & (rows < staging.shape[0])
    cache[slots[ok]] = staging[rows[ok]]
    return int(ok.sum())


def _check_index(index: np.ndarray, bound: int, name: str) -> None:
    """Raise IndexError naming the first entry of ``index`` outside ``[0, bound)``."""
    bad = np.flatnonzero((index < 0) | (index >= bound))
    if bad.size:
        i = int(bad[0])
        raise IndexError(f"{name}[{i}] = {int(index[i])} is out of range [0, {bound})")


def pack_routing_np(source: np.ndarray, slots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Gather ``source[slots[t], l, :]`` into ``out[l, t, :]`` ([S, L, K] -> [L, T, K]).

    One ``np.take`` of the slot rows, then one transposed copy into ``out``.  Slots out of
    range raise ``IndexError`` before anything is written.
    """
    slots = np.asarray(slots).reshape(-1)
    _check_index(slots, source.shape[0], "slots")
    num_layers, top_k = source.shape[1], source.shape[2]
    if out is None:
        out = np.empty((num_layers, slots.shape[0], top_k), dtype=source.dtype)
    if slots.shape[0] == 0 or out.size == 0:
        return out
    rows = np.take(source, slots, axis=0)  # [T, L, K]
    row_bytes = top_k * source.dtype.itemsize
    if row_bytes in (1, 2, 4, 8) and out.flags.c_contiguous:
        # Move each (t, l) row of ids as one machine word: numpy's strided copy is far
        # faster on [L, T] words than on [L, T, K] narrow elements.
        word = np.dtype(f"u{row_bytes}")
        out.view(word).reshape(num_layers, -1)[...] = rows.view(word).reshape(slots.shape[0], num_layers).T
    else:
        out[...] = rows.transpose(1, 0, 2)
    return out


def gather_routing_rows_np(table: np.ndarray, batch_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Return ``table[batch_ids[i], positions[i], :, :]`` stacked as ``[N, L, K]``."""
    batch_ids = np.asarray(batch_ids).reshape(-1)
    positions = np.asarray(positions).reshape(-1)
    _check_index(batch_ids, table.shape[0], "batch_ids")
    _check_index(positions, table.shape[1], "positions")
    return table[batch_ids, positions]


def clear_routing_rows_np(table: np.ndarray, batch_ids: np.ndarray) -> None:
    """Fill whole sequences ``table[batch_ids[i]]`` with the fill value, in place."""
    batch_ids = np.asarray(batch_ids).reshape(-1)
    _check_index(batch_ids, table.shape[0], "batch_ids")
    table[batch_ids] = fill_of(table.dtype)
