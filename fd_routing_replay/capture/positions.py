"""Which positions a step forwarded, and where their KV (and routing) lives.

Everything here is vectorized NumPy over the whole batch: the engine calls it once per
step, so a Python loop per running sequence (what the reference does) would cost
milliseconds at a few hundred sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fd_routing_replay.errors import OpsError

__all__ = ["StepPositions", "as_numpy", "compute_slot_mapping", "host_block_table", "lookup_blocks",
           "plan_positions", "request_slots", "token_positions"]


def as_numpy(value: object, dtype: object | None = None) -> np.ndarray:
    """A flat NumPy view/copy of a Paddle tensor, NumPy array or sequence."""
    if hasattr(value, "numpy") and not isinstance(value, np.ndarray):
        value = value.numpy()
    array = np.asarray(value)
    if dtype is not None:
        array = array.astype(dtype, copy=False)
    return array.reshape(-1)


@dataclass
class StepPositions:
    """The tokens one engine step forwards, flattened in batch order.

    ``batch_ids[i]`` / ``positions[i]`` locate token ``i`` (the order of the step's
    ragged token dimension); ``active`` lists the slots that forwarded anything, with
    their first position (``starts`` = ``seq_lens_decoder``) and token count.
    ``is_prefill`` (per active slot) is known when ``seq_lens_encoder`` was given.
    ``rows[i]`` is token ``i``'s row in the token-major step buffer (its index among
    *all* the step's tokens, tracked or not: ``cu_seqlens_q[b] + i - first``), and
    ``num_step_tokens`` the step's total token count (the rows to offload).
    """

    batch_ids: np.ndarray
    positions: np.ndarray
    active: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    is_prefill: np.ndarray | None = None
    rows: np.ndarray | None = None
    num_step_tokens: int = 0
    slots: np.ndarray | None = None     # KV slot per token (-1: none), when planned with a block table
    ledger: Any = None                  # the compiled ledger that planned it (views of its scratch)

    def __len__(self) -> int:
        return int(self.batch_ids.shape[0])

    @property
    def relative(self) -> np.ndarray:
        """Index of each token within its sequence's part of this step (0..count-1)."""
        return self.positions - np.repeat(self.starts, self.counts)

    @classmethod
    def empty(cls) -> StepPositions:
        zero = np.zeros(0, dtype=np.int64)
        return cls(zero, zero, zero, zero, zero, None, zero, 0)


def _step_lens(seq_lens_decoder: object, seq_lens_this_time: object) -> tuple[np.ndarray, np.ndarray]:
    """Both per-slot length arrays as int64, checked to cover every running slot."""
    decoder = as_numpy(seq_lens_decoder, np.int64)
    this_time = as_numpy(seq_lens_this_time, np.int64)
    if decoder.shape[0] < this_time.shape[0]:
        raise OpsError(
            f"seq_lens_decoder has {decoder.shape[0]} entries but seq_lens_this_time has "
            f"{this_time.shape[0]}; both must cover every running slot")
    return decoder, this_time


def token_positions(
    seq_lens_decoder: object,
    seq_lens_this_time: object,
    *,
    registered: np.ndarray | None = None,
    seq_lens_encoder: object | None = None,
) -> StepPositions:
    """Positions of this step's tokens: ``seq_lens_decoder[b] + 0 .. seq_lens_this_time[b]-1``.

    Slots not in ``registered`` (when given) are left out: their tokens are padding or
    belong to a request routing replay does not track.
    """
    decoder, this_time = _step_lens(seq_lens_decoder, seq_lens_this_time)
    forwarded = np.maximum(this_time, 0)
    step_ends = np.cumsum(forwarded)                  # cu_seqlens_q[1:] of the step
    mask = forwarded > 0
    if registered is not None:
        mask &= registered[: this_time.shape[0]]
    active = np.flatnonzero(mask).astype(np.int64)
    counts = forwarded[active]
    starts = decoder[active]
    total = int(counts.sum())
    batch_ids = np.repeat(active, counts)
    first = np.concatenate(([0], np.cumsum(counts)[:-1])) if len(counts) else counts
    index = np.arange(total, dtype=np.int64)
    positions = index - np.repeat(first - starts, counts)
    rows = index - np.repeat(first - (step_ends[active] - counts), counts)
    is_prefill = None
    if seq_lens_encoder is not None:
        is_prefill = as_numpy(seq_lens_encoder, np.int64)[active] > 0
    num_step_tokens = int(step_ends[-1]) if len(step_ends) else 0
    return StepPositions(batch_ids, positions, active, starts, counts, is_prefill, rows, num_step_tokens)


def host_block_table(block_table: object) -> np.ndarray | None:
    """A zero-copy host view of a CPU block table (None for a device table).

    FastDeploy (and the harness) update ``share_inputs["block_tables"]`` in place, so the
    view stays current; taking it once saves a DLPack export per step and per finish.
    """
    if isinstance(block_table, np.ndarray):
        return block_table
    place = getattr(block_table, "place", None)
    if place is not None and place.is_cpu_place() and len(block_table.shape) == 2:
        view = np.from_dlpack(block_table)
        if view.dtype in (np.int32, np.int64) and view.flags.c_contiguous:
            return view
    return None


def plan_positions(seq_lens_decoder: object, seq_lens_this_time: object, *,
                   registered: np.ndarray | None = None, seq_lens_encoder: object | None = None,
                   block_table: np.ndarray | None = None, block_size: int = 0) -> StepPositions:
    """:func:`token_positions` and, with a host ``block_table``, the KV slots, in one pass.

    The per-token arrays come from one call of the compiled step plan
    (:func:`fd_routing_replay.ops.plan_step`); ``active``/``starts``/``counts`` per slot.
    """
    from fd_routing_replay import ops

    decoder, this_time = _step_lens(seq_lens_decoder, seq_lens_this_time)
    tracked = None if registered is None else registered[: this_time.shape[0]]
    batch_ids, positions, rows, slots, active, step_tokens = ops.plan_step(
        decoder, this_time, tracked, block_table, block_size)
    is_prefill = None
    if seq_lens_encoder is not None:
        is_prefill = as_numpy(seq_lens_encoder, np.int64)[active] > 0
    return StepPositions(batch_ids, positions, active, decoder[active], this_time[active], is_prefill,
                         rows, int(step_tokens), slots if block_table is not None else None)


def lookup_blocks(block_table: object, batch_ids: np.ndarray, block_index: np.ndarray) -> np.ndarray:
    """``block_table[batch_ids, block_index]`` as int64 NumPy.

    A Paddle table is indexed where it lives (one gather) and only the looked-up ids
    cross to the host, not the whole ``[max_num_seqs, max_blocks]`` table.
    """
    if isinstance(block_table, np.ndarray):
        return block_table[batch_ids, block_index].astype(np.int64)
    if len(batch_ids) == 0:
        return np.zeros(0, dtype=np.int64)
    if block_table.place.is_cpu_place():      # zero-copy view of a host table
        return np.from_dlpack(block_table)[batch_ids, block_index].astype(np.int64)
    import paddle  # a Paddle tensor was passed, so Paddle is importable

    index = paddle.to_tensor(np.stack([batch_ids, block_index], axis=1), place=block_table.place)
    return as_numpy(paddle.gather_nd(block_table, index), np.int64)


def compute_slot_mapping(
    block_table: object, batch_ids: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """KV slot of each (slot, position): ``block_table[b, p // bs] * bs + p % bs``.

    Positions past the table, or whose block is unassigned (negative), map to -1 so the
    caller can count them instead of writing someone else's slot.
    """
    block_index = positions // block_size
    width = int(block_table.shape[1])
    in_table = (block_index >= 0) & (block_index < width)
    safe_index = np.where(in_table, block_index, 0)
    blocks = lookup_blocks(block_table, batch_ids, safe_index)
    valid = in_table & (blocks >= 0)
    return np.where(valid, blocks * block_size + positions % block_size, -1)


def request_slots(block_row: object, length: int, block_size: int) -> np.ndarray:
    """KV slots of positions ``0 .. length-1`` of one request, from its block-table row.

    Raises :class:`OpsError` when the row has too few blocks or an unassigned (negative)
    block among them: such a request's routing cannot be assembled, only reported.
    """
    from fd_routing_replay.errors import OpsError

    row = block_row if isinstance(block_row, np.ndarray) else as_numpy(block_row, np.int64)
    row = np.asarray(row, dtype=np.int64).reshape(-1)
    positions = np.arange(int(length), dtype=np.int64)
    index = positions // block_size
    if length and index[-1] >= row.shape[0]:
        raise OpsError(f"{length} positions need {index[-1] + 1} blocks; the block table "
                       f"has {row.shape[0]} for this request")
    blocks = row[index]
    if (blocks < 0).any():
        raise OpsError(f"{int((blocks < 0).sum())} of {length} positions have no KV block")
    return blocks * block_size + positions % block_size
