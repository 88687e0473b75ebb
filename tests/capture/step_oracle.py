"""An independent NumPy model of the table-API manager's per-step rules: the oracle the
compiled ledger (custom_ops/step_ledger.cc, driven by capture/fd25.py) is tested against.

Written from the rules, vectorised over the batch, sharing no code with the runtime:

* a step forwards ``seq_lens_this_time[b]`` tokens of each slot from position
  ``seq_lens_decoder[b]``; token ``i`` of the step is row ``i`` of the step buffer, and its KV
  slot is ``block_table[b, p // block_size] * block_size + p % block_size`` (-1 where the block
  is unassigned or past the table);
* tokens of registered slots without a valid KV slot (or past ``max_model_len``) damage their
  request; a step whose hook failed damages every forwarding slot; a token whose row is past
  what the step buffer held damages its request; the rows of a MoE layer that recorded
  nothing this step (a failed hook records nothing) are stored as the fill, so a later
  prefix-cache hit on those slots finds them unknown, never stale;
* with speculative decoding a decode step keeps ``clip(accept_num, 1, count)`` tokens; each
  slot's forwarded length becomes ``start + kept``; the kept tokens with a valid slot are
  scattered into the host slot cache;
* a slot finishes when flagged (finished ids, stop flags; with speculation also when the kept
  tokens reach ``max_dec_len - step_idx``), registered, and past its prompt; its length is
  its forwarded positions, with speculation cut after the first EOS among the kept accepted
  tokens and at the length limit;
* a finished request that was not damaged and has a rollout id gets its record: the rows of
  positions ``0 .. length-1`` gathered from the host slot cache (none when one of those
  positions has no KV block any more).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class StepPositions:
    """The tokens one step forwards, in batch order (the ragged token dimension)."""

    batch_ids: np.ndarray
    positions: np.ndarray
    active: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    rows: np.ndarray
    num_step_tokens: int

    @property
    def relative(self) -> np.ndarray:
        """Index of each token within its slot's part of this step (0..count-1)."""
        return self.positions - np.repeat(self.starts, self.counts)


def flat(value, dtype=np.int64) -> np.ndarray:
    if hasattr(value, "numpy") and not isinstance(value, np.ndarray):
        value = value.numpy()
    return np.asarray(value).astype(dtype).reshape(-1)


def token_positions(decoder, this_time, registered=None) -> StepPositions:
    """Positions ``decoder[b] + 0 .. this_time[b]-1`` of the registered slots' tokens."""
    decoder, this_time = flat(decoder), flat(this_time)
    forwarded = np.maximum(this_time, 0)
    step_ends = np.cumsum(forwarded)
    mask = forwarded > 0
    if registered is not None:
        mask &= registered[: this_time.shape[0]]
    active = np.flatnonzero(mask).astype(np.int64)
    counts = forwarded[active]
    starts = decoder[active]
    total = int(counts.sum())
    first = np.concatenate(([0], np.cumsum(counts)[:-1])) if len(counts) else counts
    index = np.arange(total, dtype=np.int64)
    positions = index - np.repeat(first - starts, counts)
    rows = index - np.repeat(first - (step_ends[active] - counts), counts)
    return StepPositions(np.repeat(active, counts), positions, active, starts, counts, rows,
                         int(step_ends[-1]) if len(step_ends) else 0)


def compute_slot_mapping(block_table: np.ndarray, batch_ids, positions, block_size: int) -> np.ndarray:
    """KV slot of each (slot, position); -1 past the table or for an unassigned block."""
    block_index = positions // block_size
    in_table = (block_index >= 0) & (block_index < block_table.shape[1])
    blocks = block_table[batch_ids, np.where(in_table, block_index, 0)].astype(np.int64)
    valid = in_table & (blocks >= 0)
    return np.where(valid, blocks * block_size + positions % block_size, -1)


class OracleCapture:
    """The manager's rules over plain arrays (see the module docstring)."""

    def __init__(self, *, max_num_seqs: int, max_model_len: int, block_size: int, num_slots: int,
                 num_layers: int, top_k: int, fill: int, dtype=np.uint8) -> None:
        n = max_num_seqs
        self.max_model_len, self.block_size = max_model_len, block_size
        self.registered = np.zeros(n, bool)
        self.forwarded = np.zeros(n, np.int64)
        self.damaged = np.zeros(n, bool)
        self.rollout_ids: list[str | None] = [None] * n
        self.cache = np.full((num_slots, num_layers, top_k), fill, dtype)
        self.records: dict[str, np.ndarray] = {}
        self.unmapped = 0
        self.finished = 0                    # finishes of requests with a rollout id

    def register(self, slot: int, rollout_id: str | None) -> None:
        self.registered[slot], self.forwarded[slot], self.damaged[slot] = True, 0, False
        self.rollout_ids[slot] = rollout_id

    def clear(self, slot: int) -> None:
        self.registered[slot], self.forwarded[slot], self.damaged[slot] = False, 0, False
        self.rollout_ids[slot] = None

    def step(self, block_table: np.ndarray, decoder, this_time, step_rows: np.ndarray, *, encoder=None,
             staged_rows: int | None = None, hook_failed: bool = False, missing_layers=(), finished=None, stop=None,
             prompt_lens=None, accept_num=None, step_idx=None, max_dec_len=None, accept_tokens=None,
             eos=None) -> list[tuple[int, int]]:
        """One step; returns the finished ``(slot, length)`` in slot order.  ``step_rows`` are
        the step buffer's rows of every token of the step (tracked or not)."""
        p = token_positions(decoder, this_time, self.registered)
        slots = compute_slot_mapping(block_table, p.batch_ids, p.positions, self.block_size)
        valid = (slots >= 0) & (p.positions < self.max_model_len)
        self.unmapped += int((~valid).sum())
        self.damaged[np.unique(p.batch_ids[~valid])] = True
        prefill = flat(encoder)[p.active] > 0 if encoder is not None else np.zeros(len(p.active), bool)
        kept = p.counts.copy()
        if accept_num is not None:
            kept = np.where(prefill, p.counts, np.clip(flat(accept_num)[p.active], 1, p.counts))
        self.forwarded[p.active] = p.starts + kept
        staged = p.num_step_tokens if staged_rows is None else staged_rows
        if hook_failed and len(p.batch_ids):
            self.damaged[p.active] = True
        outside = p.rows >= min(staged, step_rows.shape[0])
        self.damaged[np.unique(p.batch_ids[outside])] = True
        keep = valid & ~outside & (p.relative < np.repeat(kept, p.counts))
        rows = step_rows[p.rows[keep]].copy()
        rows[:, list(missing_layers)] = np.iinfo(self.cache.dtype).max
        self.cache[slots[keep]] = rows
        n = len(self.registered)
        flags = np.zeros(n, bool)
        for given in (finished, stop):
            if given is not None:
                values = flat(given) != 0
                flags[: min(n, len(values))] |= values[:n]
        done = flags[p.active]
        remaining = None
        if step_idx is not None and max_dec_len is not None:
            remaining = flat(max_dec_len)[p.active] - flat(step_idx)[p.active]
            done |= ~prefill & (kept >= remaining)
        done &= self.registered[p.active]
        if prompt_lens is not None:
            done &= p.starts + p.counts >= flat(prompt_lens)[p.active]
        out = []
        for index in np.flatnonzero(done):
            slot = int(p.active[index])
            length = int(self.forwarded[slot])
            speculative = accept_num is not None and not prefill[index]
            if speculative:
                cut = int(kept[index])
                if accept_tokens is not None and eos is not None:
                    accepted = flat(accept_tokens).reshape(n, -1)[slot]
                    for j in range(min(cut, accepted.shape[0])):
                        if accepted[j] in set(flat(eos).tolist()):
                            cut = j + 1
                            break
                if remaining is not None:
                    cut = min(cut, max(int(remaining[index]), 1))
                length = int(p.starts[index]) + cut
            out.append((slot, length))
            self.finished += self.rollout_ids[slot] is not None
            positions = np.arange(length)
            blocks = block_table[slot][positions // self.block_size].astype(np.int64) \
                if length == 0 or (length - 1) // self.block_size < block_table.shape[1] else None
            if not self.damaged[slot] and self.rollout_ids[slot] is not None \
                    and blocks is not None and (blocks >= 0).all():   # else: lost (no KV block)
                kv = blocks * self.block_size + positions % self.block_size
                self.records[self.rollout_ids[slot]] = np.ascontiguousarray(self.cache[kv].transpose(1, 0, 2))
            self.clear(slot)
        return out
