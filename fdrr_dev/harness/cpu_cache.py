"""The CPU KV cache's data moves, as FastDeploy's cache transfer manager makes them.

FastDeploy swaps a block between GPU and CPU in ``CacheTransferManager._transfer_data``
(cache_manager/cache_transfer_manager.py:1616-1727): ``swap_cache_all_layers`` copies the
block's K and V of every layer, and with routing replay on, ``_swap_routing``
(:404-430; called at :1681 "to_cpu" and :1724 "to_gpu") copies the block's rows between
the host routing buffer (indexed by GPU KV slot) and a CPU swap buffer (indexed by CPU
slot), so a block's routes follow its KV.  :class:`CacheTransfer` is that at toy scale,
wired to :class:`~fdrr_dev.harness.kv.BlockManager` as its ``swapper``.
``swap_routing=False`` moves only the KV: the negative case, where a swapped-in block
shows the routes of the GPU block's previous occupant.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fd_routing_replay.capture.slots import HostSlotCache

__all__ = ["CacheTransfer"]


class CacheTransfer:
    """Swap blocks' KV and routing rows between the GPU tier and CPU buffers."""

    def __init__(self, runner: Any, host: Callable[[], HostSlotCache | None], *, num_cpu_blocks: int,
                 block_size: int, swap_routing: bool = True) -> None:
        self.runner = runner                 # its kv_cache is read at each call (weights swap it)
        self.host = host
        self.block_size = int(block_size)
        self.swap_routing = swap_routing
        self.num_cpu_slots = int(num_cpu_blocks) * self.block_size
        self.cpu_kv: list[tuple[np.ndarray, np.ndarray]] | None = None
        self.routing_swap_buffer: np.ndarray | None = None
        self.blocks_moved = {"to_cpu": 0, "to_gpu": 0}
        self._origin: dict[int, int] = {}    # CPU block -> the GPU block it was swapped out of
        self.moved_elsewhere = 0             # swap-ins that landed in another GPU block

    def _slots(self, blocks: Sequence[int]) -> np.ndarray:
        base = np.asarray(blocks, dtype=np.int64)[:, None] * self.block_size
        return (base + np.arange(self.block_size, dtype=np.int64)[None, :]).reshape(-1)

    def __call__(self, gpu_blocks: Sequence[int], cpu_blocks: Sequence[int], direction: str) -> None:
        if direction not in self.blocks_moved:
            raise ValueError(f"direction must be 'to_cpu' or 'to_gpu', got {direction!r}")
        gpu, cpu = self._slots(gpu_blocks), self._slots(cpu_blocks)
        self._swap_kv(gpu, cpu, direction)
        host = self.host()
        if self.swap_routing and host is not None:
            if getattr(self.runner, "overlap_schedule", False):
                self.runner.sync_routing()   # the scheduler swaps after the outputs it saw were flushed
            self._swap_routing(host, gpu, cpu, direction)
        self.blocks_moved[direction] += len(gpu_blocks)
        for gpu_block, cpu_block in zip(gpu_blocks, cpu_blocks, strict=True):
            if direction == "to_cpu":
                self._origin[cpu_block] = gpu_block
            else:
                self.moved_elsewhere += int(self._origin.pop(cpu_block, gpu_block) != gpu_block)

    def _swap_kv(self, gpu: np.ndarray, cpu: np.ndarray, direction: str) -> None:
        """swap_cache_all_layers for K and V (cache_transfer_manager.py:1641-1676, :1684-1719)."""
        if direction == "to_cpu":
            entries = self.runner.copy_kv(gpu)
            if self.cpu_kv is None:
                self.cpu_kv = [(np.zeros((self.num_cpu_slots,) + k.shape[1:], k.dtype),
                                np.zeros((self.num_cpu_slots,) + v.shape[1:], v.dtype)) for k, v in entries]
            for (k_cpu, v_cpu), (k, v) in zip(self.cpu_kv, entries, strict=True):
                k_cpu[cpu], v_cpu[cpu] = k, v
        else:
            if self.cpu_kv is None:
                raise RuntimeError("swap to GPU before anything was swapped to CPU")
            self.runner.write_kv(gpu, [(k_cpu[cpu], v_cpu[cpu]) for k_cpu, v_cpu in self.cpu_kv])

    def _swap_routing(self, host: HostSlotCache, gpu: np.ndarray, cpu: np.ndarray, direction: str) -> None:
        """``_swap_routing`` (cache_transfer_manager.py:404-430), one vectorised copy."""
        if self.routing_swap_buffer is None:
            self.routing_swap_buffer = np.full((self.num_cpu_slots,) + host.array.shape[1:],
                                               host.fill_value, dtype=host.array.dtype)
        if direction == "to_cpu":
            self.routing_swap_buffer[cpu] = host.array[gpu]
        else:
            host.array[gpu] = self.routing_swap_buffer[cpu]
