"""A hand-driven engine step for manager unit tests: FastDeploy's call order, random routing.

Each step draws random top-k ids for every forwarded token, records them through the
real hook and custom ops, and remembers them in a plain dict — the independent
reference the assembled records are compared with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fd_routing_replay.capture.device import save_routing_to_buffer
from fd_routing_replay.capture.fd25 import CaptureGeometry, RoutingReplayManager
from fd_routing_replay.writer.record import build_record
from fdrr_dev.harness.paddle_runtime import paddle


class ListWriter:
    """The writer's engine-facing surface (``submit``, ``submit_put``, ``durable_prefix``,
    ``flush``, ``close``, ``stats``, ``export_metrics``) over a dict: a hand-off's rows become
    records through the production :func:`build_record` at once, so a unit test reads them
    right after the step.  ``fail_keys``: submits of these keys are dropped (``submit`` returns
    False, as the real writer does under ``writer.full_policy: drop``).  ``items`` keeps the
    last record per key, ``log`` every ``(key, record)`` in order."""

    def __init__(self, fail_keys: set[str] | None = None) -> None:
        self.items: dict[str, Any] = {}
        self.log: list[tuple[str, Any]] = []
        self.fail_keys = fail_keys or set()
        self.prefixes: dict[str, Any] = {}

    def submit(self, op, fill, **_) -> bool:
        if op.key in self.fail_keys:
            return False
        ids = np.empty(tuple(op.shape), np.dtype(op.dtype))
        fill(ids)
        previous = self.items.get(op.prefix_key) if op.prefix_key else None
        for key, record in build_record(op, op.record(ids), previous):
            self.items[key] = record
            self.log.append((key, record))
        return True

    def submit_put(self, key, record, **_) -> bool:
        if key in self.fail_keys:
            return False
        self.items[key] = record
        self.log.append((key, record))
        return True

    def durable_prefix(self, rollout_id):
        return self.prefixes.get(rollout_id)

    def flush(self, timeout=None):
        return True

    def close(self, timeout=None):
        pass

    def stats(self):
        return {"puts": len(self.log)}

    def export_metrics(self, stats, render):
        return None


def rid(user: str, n: int = 0) -> str:
    return f"chatcmpl-{user}-{n:08x}-0000-4000-8000-000000000000"


@dataclass
class Driver:
    """Owns share_inputs and one manager per rank; ``step`` runs one FastDeploy step."""

    geometry: CaptureGeometry
    seed: int
    tp_size: int = 1
    writer: Any = None
    reference: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)   # RoutingReplayManager keywords

    def __post_init__(self) -> None:
        g = self.geometry
        self.rng = np.random.default_rng(self.seed)
        width = -(-g.max_model_len // g.block_size)
        self.block_tables = np.full((g.max_num_seqs, width), -1, dtype=np.int32)
        self.share_inputs: dict[str, Any] = {
            "block_tables": paddle.to_tensor(self.block_tables),
        }
        self.managers = [RoutingReplayManager(g, block_table=self.share_inputs["block_tables"],
                                              writer=self.writer if rank == 0 else None, tp_rank=rank,
                                              share_inputs=self.share_inputs, **self.options)
                         for rank in range(self.tp_size)]

    @property
    def manager(self) -> RoutingReplayManager:
        return self.managers[0]

    def set_blocks(self, slot: int, blocks: list[int]) -> None:
        self.block_tables[slot] = -1
        self.block_tables[slot, : len(blocks)] = blocks
        self.share_inputs["block_tables"][slot] = paddle.to_tensor(self.block_tables[slot])

    def random_ids(self, count: int) -> np.ndarray:
        g = self.geometry
        return np.stack([np.stack([self.rng.choice(g.num_experts, g.top_k, replace=False)
                                   for _ in range(g.num_moe_layers)]) for _ in range(count)])

    def step(self, entries: dict[int, tuple[int, int]], *, finished: set[int] = frozenset(),
             stopped: set[int] = frozenset(), encoder: set[int] = frozenset(),
             extra: dict[str, Any] | None = None, group_hook=None,
             skip_layers: set[int] = frozenset()) -> dict[tuple[int, int], np.ndarray]:
        """entries: slot -> (start, count); ``skip_layers``: MoE layers that do not call the hook
        this step.  Returns the routing drawn per (slot, position)."""
        g = self.geometry
        n = g.max_num_seqs
        decoder = np.zeros(n, np.int32)
        this_time = np.zeros(n, np.int32)
        enc = np.zeros(n, np.int32)
        for slot, (start, count) in entries.items():
            decoder[slot], this_time[slot] = start, count
            if slot in encoder:
                enc[slot] = count
        si = self.share_inputs
        si["seq_lens_decoder"] = paddle.to_tensor(decoder.reshape(-1, 1))
        si["seq_lens_this_time"] = paddle.to_tensor(this_time.reshape(-1, 1))
        si["seq_lens_encoder"] = paddle.to_tensor(enc.reshape(-1, 1))
        stop = np.zeros(n, bool)
        stop[list(stopped)] = True
        si["stop_flags"] = paddle.to_tensor(stop.reshape(-1, 1))
        for key, value in (extra or {}).items():
            si[key] = value
        slots = sorted(entries)
        batch = np.concatenate([np.full(entries[s][1], s, np.int32) for s in slots])
        cu = np.zeros(n + 1, np.int32)
        cu[1:] = np.cumsum(this_time)
        for manager in self.managers:
            manager.pending_update_positions = manager.get_token_positions(
                seq_lens_decoder=si["seq_lens_decoder"], seq_lens_this_time=si["seq_lens_this_time"])
        drawn = self.random_ids(len(batch))                      # [T, L, K]
        self.last_drawn = drawn
        for layer in range(g.num_moe_layers):
            if layer in skip_layers:
                continue
            topk = paddle.to_tensor(drawn[:, layer, :].astype(np.int64))
            for manager in self.managers:
                kwargs = dict(routing_replay_table=manager.get_routing_table(), topk_ids=topk,
                              batch_id_per_token=paddle.to_tensor(batch),
                              seq_lens_decoder=si["seq_lens_decoder"],
                              cu_seqlens_q=paddle.to_tensor(cu), layer_idx=layer)
                if group_hook is not None:
                    group_hook(manager, kwargs)
                else:
                    save_routing_to_buffer(**kwargs)
        out = {}
        offset = 0
        for slot in slots:
            start, count = entries[slot]
            for i in range(count):
                out[(slot, start + i)] = drawn[offset + i]
            offset += count
        done = np.zeros(n, bool)
        done[list(finished)] = True
        for manager in self.managers:
            mapping = manager.compute_slot_mapping(positions=manager.pending_update_positions)
            manager.update_host_cache(positions=manager.pending_update_positions, slot_mapping=mapping)
            manager.put_finished_batch(finished_batch_ids=paddle.to_tensor(done),
                                       seq_lens_decoder=paddle.to_tensor((decoder + enc).reshape(-1, 1)))
        return out


def expected_record(rows: dict[int, np.ndarray], length: int) -> np.ndarray:
    """[L, T, K] from per-position rows 0..length-1."""
    return np.stack([rows[p] for p in range(length)], axis=1)
