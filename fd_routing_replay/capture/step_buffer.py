"""The token-major device step buffer, its bound recorder and its host staging.

One object per manager (2.5 / develop table API) or capturer (2.6):

* ``buffer``: ``[max_batched_tokens, L, K]`` of the routing dtype on the device; token
  ``t`` of the current step is row ``t`` (FastDeploy 2.6's and vLLM's layout).  It
  replaces the request-major table ``[max_num_seqs, max_model_len, L, K]``: at 256
  sequences x 32k x 60 layers x top-8 that table is ~4 GB of KV-cache memory, the step
  buffer at 8k batched tokens is ~4 MB.
* ``counters``: int64 ``[1 + L]`` on the device — bad expert ids, then calls per layer —
  written by the record kernel, read once per step with the rows (so they stay right
  under CUDA-graph replay, where no Python runs per layer).
* ``record(topk_ids, layer_idx, expected_rows)``: the bound entry point
  (:func:`fd_routing_replay.ops.bind_step_recorder`), validated once here.
* ``start_offload(n)`` / ``finish_offload()``: one asynchronous copy of rows ``[0, n)``
  and the counters into host staging (page-locked on a GPU), then the event wait; the
  caller scatters the rows into its slot cache with one vectorised store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fd_routing_replay import ops
from fd_routing_replay.ops.dtypes import PD_INDEX

__all__ = ["StepBuffer", "StepRows"]


@dataclass
class StepRows:
    """One step's rows on the host and what the device counters say about them."""

    rows: np.ndarray          # [n, L, K] view of the staging (valid until the next offload)
    bad_ids: int              # ids outside [0, num_experts) recorded this step
    layer_calls: np.ndarray   # [L] record calls per layer this step
    extra: np.ndarray | None  # the first n elements of the extra tensor, when one was given

    @property
    def missing_layers(self) -> np.ndarray:
        """Layers not recorded this step: their rows are a previous step's (stale)."""
        return np.flatnonzero(self.layer_calls == 0)


class StepBuffer:
    """Device step buffer + device counters + bound recorder + host staging."""

    def __init__(self, *, max_tokens: int, num_layers: int, top_k: int, num_experts: int,
                 table_experts: int | None = None, layer_rows: tuple[int, ...] | None = None,
                 place: Any = None, extra_itemsize: int = 0) -> None:
        import paddle

        self.max_tokens = int(max_tokens)
        self.num_layers = int(num_layers)
        self.top_k = int(top_k)
        experts_in_table = int(table_experts if table_experts is not None else num_experts)
        self.dtype = ops.routing_dtype(experts_in_table)
        self.fill_value = ops.fill_value(self.dtype)
        self.buffer = ops.new_step_buffer(self.max_tokens, self.num_layers, self.top_k,
                                          experts_in_table, place=place)
        self.place = self.buffer.place
        self.counters = paddle.zeros([1 + self.num_layers], dtype="int64", device=self.place)
        self.host_rows = np.full((self.max_tokens, self.num_layers, self.top_k), self.fill_value,
                                 dtype=self.dtype)
        self.host_counters = np.zeros(1 + self.num_layers, dtype=np.int64)
        self.host_extra = np.zeros(self.max_tokens * int(extra_itemsize), dtype=np.uint8)
        self.recorder = ops.bind_step_recorder(
            self.buffer, self.counters, num_experts=int(num_experts), layer_rows=layer_rows,
            host_rows=self.host_rows, host_counters=self.host_counters, host_extra=self.host_extra)
        self.record = self.recorder.record            # the hook's per-layer call
        # the counters as last read, and the step's change (fixed arrays: the manager's
        # compiled ledger reads and updates them in place)
        self.seen_counters = np.zeros(1 + self.num_layers, dtype=np.int64)
        self.counter_delta = np.zeros(1 + self.num_layers, dtype=np.int64)
        self._pending: tuple[int, np.dtype | None] | None = None

    @property
    def device_bytes(self) -> int:
        """Device memory capture holds: the step buffer and the counters."""
        return int(self.max_tokens * self.num_layers * self.top_k * self.dtype.itemsize
                   + 8 * (1 + self.num_layers))

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def start_offload(self, num_tokens: int, extra: Any = None, *, extra_dtype: np.dtype | None = None) -> None:
        """Queue the copy of rows ``[0, num_tokens)`` (+ counters, + ``extra``) to the host;
        ``extra_dtype``: ``extra``'s dtype as NumPy's, when the caller knows it already."""
        num_tokens = max(0, min(int(num_tokens), self.max_tokens))
        if extra is not None and extra_dtype is None:
            extra_dtype = np.dtype(PD_INDEX.get(extra.dtype) or np.int64)
        self.recorder.offload(num_tokens, extra)
        self._pending = (num_tokens, extra_dtype)

    def wait_offload(self) -> tuple[int, np.dtype | None] | None:
        """Wait for the queued copy; ``(rows staged, dtype of the staged extra)``, or None if
        none was queued.  The counter deltas are left to the caller (the compiled ledger or
        flush, which read ``host_counters`` against ``seen_counters``)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        self.recorder.wait()
        return pending

    def finish_offload(self) -> StepRows | None:
        """Wait for the queued copy; the step's rows and counter deltas (None if none queued)."""
        staged = self.wait_offload()
        if staged is None:
            return None
        num_tokens, extra_dtype = staged
        np.subtract(self.host_counters, self.seen_counters, out=self.counter_delta)
        self.seen_counters[...] = self.host_counters
        delta = self.counter_delta.copy()
        extra = None
        if extra_dtype is not None:
            extra = self.host_extra[: num_tokens * extra_dtype.itemsize].view(extra_dtype)
        return StepRows(self.host_rows[:num_tokens], int(delta[0]), delta[1:], extra)

    def bad_ids_total(self) -> int:
        """All bad expert ids recorded so far (reads the device counters: not per step)."""
        return int(self.counters.numpy()[0])

    def calls_total(self) -> int:
        """All record calls so far (reads the device counters: not per step)."""
        return int(self.counters.numpy()[1:].sum())

    def fill(self) -> None:
        """Every row back to the fill (RL round cleanup)."""
        self._pending = None
        self.recorder.fill()
