"""Host-side routing cache indexed by KV-cache slot.

Why by KV slot and not by request: a position's routing is a property of the KV entry the
forward pass produced for it.  When a later request hits that block in the prefix cache,
or a preempted request is recomputed into other blocks, or a chunk of a long prompt is
prefilled in an earlier step, the slot cache already holds (or receives) exactly the
routing that goes with that KV — the record is assembled from the request's slots at
finish, whatever path each position took.

The array is plain NumPy: scatter and gather are single fancy-index operations (Paddle's
CPU build has no uint8 ``scatter`` kernel, and a pinned NumPy buffer is what a GPU
engine copies into anyway).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fd_routing_replay.errors import OpsError

__all__ = ["HostSlotCache", "checked_layer_columns"]


class HostSlotCache:
    """``[num_slots, num_layers, top_k]`` routing ids, ``fill_value`` where unknown.

    ``layer_columns``: when the array is laid out for someone else too (FastDeploy 2.6's
    view counts leading dense layers as rows), the array's row of each of our layers;
    :meth:`write` and :meth:`read` then take and return our ``L`` layers only, and the
    other rows stay at the fill value.  None: the array's rows are our layers.
    """

    def __init__(self, num_slots: int, num_layers: int, top_k: int, dtype: np.dtype,
                 fill_value: int, *, layer_columns: Sequence[int] | None = None) -> None:
        if num_slots <= 0 or num_layers <= 0 or top_k <= 0:
            raise OpsError(
                f"host slot cache needs positive sizes, got num_slots={num_slots}, "
                f"num_layers={num_layers}, top_k={top_k}")
        self.dtype = np.dtype(dtype)
        self.fill_value = int(fill_value)
        self.layer_columns = checked_layer_columns(layer_columns, num_layers)
        self.array = np.full((num_slots, num_layers, top_k), self.fill_value, dtype=self.dtype)

    @property
    def num_slots(self) -> int:
        return int(self.array.shape[0])

    @property
    def num_layers(self) -> int:
        """Our layers (the rows :meth:`write` takes)."""
        columns = self.layer_columns
        return int(self.array.shape[1]) if columns is None else len(columns)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def write(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Scatter ``rows[i]`` (``[N, L, K]``) into ``slots[i]`` in one vectorized store."""
        expected = (self.num_layers, self.array.shape[2])
        if rows.shape[1:] != expected:
            raise OpsError(
                f"rows of shape {rows.shape} do not fit the host cache rows {expected} (num_layers, top_k)")
        if self.layer_columns is None:
            self.array[slots] = rows
        else:
            self.array[np.asarray(slots)[:, None], self.layer_columns[None, :]] = rows

    def read(self, slots: np.ndarray) -> np.ndarray:
        """Gather ``[T, L, K]`` rows for ``slots`` (a copy)."""
        rows = self.array[slots]
        return rows if self.layer_columns is None else rows[:, self.layer_columns]

    def invalidate(self, slots: np.ndarray) -> None:
        """Forget the routing held for ``slots``."""
        self.array[slots] = self.fill_value

    def clear(self) -> None:
        """Forget everything (e.g. after an RL weight update the cached rows are stale)."""
        self.array.fill(self.fill_value)


def checked_layer_columns(layer_columns: Sequence[int] | None,
                          num_rows: int) -> np.ndarray | None:
    """``layer_columns`` as an index array after checking they are distinct rows in
    ``[0, num_rows)``; None when absent or the identity (no reordering needed)."""
    if layer_columns is None:
        return None
    columns = np.asarray(layer_columns, dtype=np.int64)
    if (columns.ndim != 1 or not len(columns) or columns.min() < 0 or columns.max() >= num_rows
            or len(np.unique(columns)) != len(columns)):
        raise OpsError(f"host slot cache layer_columns must be distinct rows in [0, {num_rows}), "
                       f"got {list(layer_columns)}")
    if np.array_equal(columns, np.arange(num_rows)):
        return None
    return columns
