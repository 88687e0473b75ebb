"""Worker-side capture for FastDeploy 2.6's step-buffer interface.

FastDeploy 2.6's runner drives a *step capturer* (``fastdeploy/worker/gpu_model_runner.py``
and ``fastdeploy/model_executor/pre_and_post_process.py``; the members it uses are listed
by :func:`fd_routing_replay.integrations.fd_api.manager_members_used`):

* ``get_device_routing_buffer()`` → the token-major buffer the MoE hook writes;
* ``prepare_pending_save(num_tokens, slot_mapping, position_ids)`` after sampling (TP rank
  0 only): queue the copy of this step's rows and KV slots to the host;
* ``flush_pending_save()`` after the step's event synchronised: scatter the rows into the
  host slot cache by KV slot, where the engine process assembles finished requests;
* ``token_num_overlap`` (overlap scheduling: the launch's token count), ``clear()`` (RL
  round cleanup), ``tp_rank`` and ``debug_mode``.

Ours keeps that interface; inside, the buffer is allocated in the real unsigned dtype
(FastDeploy allocates with the dtype *string* ``"uint16"``, which Paddle treats as
bfloat16), the hook validates expert ids, invalid KV slots are counted and skipped
instead of corrupting other requests' rows, and the host cache is
:class:`~fd_routing_replay.capture.shared_slots.SharedSlotCache`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from fd_routing_replay import ops
from fd_routing_replay.capture.hook import (
    TableBinding,
    bind_table,
    new_error_count,
    step_indices,
    unbind_table,
)
from fd_routing_replay.capture.host_cache import HostSlotCache

__all__ = ["StepRoutingCapturer"]

logger = logging.getLogger(__name__)


class StepRoutingCapturer:
    """FastDeploy 2.6's ``RoutedExpertsCapturer`` interface over our capture path."""

    enabled = True
    fdrr_manager = True
    debug_mode = False         # FastDeploy's debug mode (positions instead of routing) is refused

    def __init__(
        self,
        *,
        max_batched_tokens: int,
        num_moe_layers: int,
        top_k: int,
        num_experts: int,
        num_shared_experts: int = 0,
        tp_rank: int = 0,
        overlap_schedule: bool = False,
        attach_host: Callable[[], HostSlotCache] | None = None,
        layer_rows: tuple[int, ...] | None = None,
        place: Any = None,
    ) -> None:
        self.max_batched_tokens = int(max_batched_tokens)
        self.num_moe_layers = int(num_moe_layers)
        self.moe_top_k = int(top_k)
        self.tp_rank = int(tp_rank)
        self.overlap_schedule = bool(overlap_schedule)
        self.token_num_overlap = 0
        self.routing_dtype = ops.routing_dtype(num_experts + num_shared_experts)
        self.fill_value = ops.fill_value(self.routing_dtype)
        # [1, tokens, layers, top_k]: one "sequence" whose position t is the step's token t.
        self.device_routing_buffer = ops.new_routing_table(
            1, self.max_batched_tokens, self.num_moe_layers, self.moe_top_k,
            num_experts + num_shared_experts, place=place)
        place = self.device_routing_buffer.place
        self.binding = TableBinding(num_experts=int(num_experts), error_count=new_error_count(place),
                                    on_error=self._on_hook_error, layer_rows=layer_rows,
                                    step_indices=step_indices(self.max_batched_tokens, place))
        bind_table(self.device_routing_buffer, self.binding)
        import paddle

        self._arange = paddle.arange(self.max_batched_tokens, dtype="int32").to(place)
        self._attach_host = attach_host
        self.host_cache: HostSlotCache | None = None
        self._host_missing_logged = False
        self._pending: tuple[int, Any, Any, bool] | None = None
        self._step_damaged = False
        self.counters: dict[str, float] = {
            "steps": 0, "tokens_offloaded": 0, "invalid_slots": 0, "damaged_steps": 0,
            "host_missing_steps": 0, "errors": 0, "offload_seconds": 0.0,
        }

    # ------------------------------------------------------------------ FastDeploy API
    def get_device_routing_buffer(self) -> Any:
        """The step buffer the MoE layers write (``ForwardMeta.device_routing_buffer``)."""
        return self.device_routing_buffer

    def prepare_pending_save(self, num_tokens: int, slot_mapping_gpu: Any, position_ids_gpu: Any = None) -> None:
        """Queue this step's rows and KV slots for the host (no host sync on a GPU)."""
        try:
            if self.overlap_schedule:
                num_tokens = self.token_num_overlap
            num_tokens = int(num_tokens)
            damaged, self._step_damaged = self._step_damaged, False
            if num_tokens <= 0:
                self._pending = None
                return
            if num_tokens > self.max_batched_tokens:
                raise ValueError(f"{num_tokens} tokens exceed the step buffer's {self.max_batched_tokens} rows")
            # One gather op (Paddle has no CPU slice kernel for uint16) into a fresh tensor,
            # so the next step can reuse the buffer.
            batch, _, _ = self.binding.step_indices
            rows = ops.gather_routing_rows(self.device_routing_buffer, batch[:num_tokens],
                                           self._arange[:num_tokens])
            slots = slot_mapping_gpu[:num_tokens]
            if not self.device_routing_buffer.place.is_cpu_place():
                rows, slots = rows.cpu(), slots.cpu()       # not run on a GPU yet (docs/fastdeploy.md)
            else:
                slots = slots.clone()
            self._pending = (num_tokens, rows, slots, damaged)
        except Exception as exc:  # never stop the engine step
            self._pending = None
            self.counters["errors"] += 1
            self.counters["damaged_steps"] += 1
            logger.error("routing replay: prepare_pending_save failed, this step's routing is lost "
                         "(counted): %r", exc)

    def flush_pending_save(self) -> None:
        """Scatter the queued rows into the host slot cache (after the step's sync)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        started = time.perf_counter()
        try:
            host = self._host()
            if host is None:
                self.counters["host_missing_steps"] += 1
                return
            num_tokens, rows, slots, damaged = pending
            if damaged:
                self.counters["damaged_steps"] += 1
            rows_np = np.asarray(rows.numpy()).view(self.routing_dtype).reshape(
                num_tokens, self.num_moe_layers, self.moe_top_k)
            slots_np = np.asarray(slots.numpy()).astype(np.int64, copy=False).reshape(-1)
            valid = (slots_np >= 0) & (slots_np < host.num_slots)
            if damaged:          # a layer failed: its rows are stale; mark the slots unknown
                host.invalidate(slots_np[valid])
                return
            if not valid.all():
                bad = int((~valid).sum())
                self.counters["invalid_slots"] += bad
                logger.warning("routing replay: %d of %d tokens this step have no valid KV slot "
                               "(range [0, %d)); their routing is skipped", bad, num_tokens, host.num_slots)
                host.write(slots_np[valid], rows_np[valid])
            else:
                host.write(slots_np, rows_np)
            self.counters["steps"] += 1
            self.counters["tokens_offloaded"] += int(valid.sum())
        except Exception as exc:  # never stop the engine step
            self.counters["errors"] += 1
            logger.error("routing replay: flush_pending_save failed, this step's routing is lost "
                         "(counted): %r", exc)
        finally:
            self.counters["offload_seconds"] += time.perf_counter() - started

    def clear(self) -> None:
        """RL round cleanup: forget the step buffer and anything queued."""
        self._pending = None
        self._step_damaged = False
        ops.clear_routing_rows(self.device_routing_buffer, np.zeros(1, dtype=np.int64))

    # ------------------------------------------------------------------ lifecycle
    def flush(self, timeout: float | None = None) -> bool:
        """Nothing is written from the worker in this generation (the engine writes)."""
        return True

    def close(self, timeout: float | None = None) -> None:
        unbind_table(self.device_routing_buffer)
        host, self.host_cache = self.host_cache, None
        if host is not None and hasattr(host, "close"):
            host.close()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters)
        out.update(hook_calls=self.binding.calls, hook_seconds=self.binding.seconds,
                   hook_errors=self.binding.errors, hook_mismatches=self.binding.mismatches,
                   bad_expert_ids=int(self.binding.error_count.numpy().reshape(-1)[0]),
                   dtype=self.routing_dtype.name)
        return out

    # ------------------------------------------------------------------ internals
    def _host(self) -> HostSlotCache | None:
        if self.host_cache is None and self._attach_host is not None:
            try:
                self.host_cache = self._attach_host()
            except FileNotFoundError as exc:
                if not self._host_missing_logged:
                    self._host_missing_logged = True
                    logger.error("routing replay: the engine's shared slot cache is missing (%s); is "
                                 "the fd_routing_replay token processor plugin loaded in the engine "
                                 "(FD_PLUGINS)? Routing is not captured until it exists", exc)
        return self.host_cache

    def _on_hook_error(self, layer_idx: int, exc: BaseException) -> None:
        self._step_damaged = True
