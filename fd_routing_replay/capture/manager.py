"""The routing replay manager: FastDeploy's runner interface over our capture path.

:class:`RoutingReplayManager` keeps the method names, keyword names and call order of
FastDeploy's ``RoutingReplayManager`` (``register_request``, ``clear_request``,
``get_token_positions``, ``compute_slot_mapping``, ``update_host_cache``,
``put_finished_batch``, ``get_routing_table``, ``clear_all_request``), so FastDeploy's
runner and post-processing drive it unchanged.  What differs is inside:

* **A token-major step buffer, not a table.**  ``get_routing_table()`` returns the
  step buffer ``[max_num_batched_tokens, L, K]`` (FastDeploy 2.6's and vLLM's layout):
  each MoE layer writes its rows with one bound call, token ``t`` of the step in row
  ``t``; no ``[max_num_seqs, max_model_len, L, K]`` table (gigabytes of KV-cache memory)
  and nothing to clear per request on the device.
* **Per-step bookkeeping compiled** (:mod:`~fd_routing_replay.capture.ledger`): one
  asynchronous device→host copy of the step's rows and counters, then one bound call per
  FastDeploy method -- no loop over sequences, no allocation.  Finished requests' rows
  are gathered here; their records are built off this thread (``self.outlet``).
* **Token coverage.**  A record holds one row per position that went through the
  forward pass: every prompt token and every generated token that was fed back,
  *including the last forwarded one* (the reference takes the length before the inputs
  update and drops it), and nothing for a sampled token that was never fed back.  With
  speculative decoding only accepted positions count.
* **Finish detection.**  Besides FastDeploy's ``finished_batch_ids`` (EOS in the sampled
  tokens) a request also finishes when its ``stop_flags`` entry is set (length limit,
  stop sequences), so no record is silently lost and no slot is found still occupied.
* **Errors never stop the step**: counted; a request whose routing was lost is logged
  with its rollout id and not written wrong.  **TP > 1**: only rank 0 offloads and writes.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from fd_routing_replay import ops
from fd_routing_replay.capture.assembly import RecordAssembler
from fd_routing_replay.capture.geometry import CaptureGeometry
from fd_routing_replay.capture.hook import TableBinding, bind_table, unbind_table
from fd_routing_replay.capture.host_cache import HostSlotCache
from fd_routing_replay.capture.ledger import StepLedger
from fd_routing_replay.capture.outlet import RecordOutlet
from fd_routing_replay.capture.partial import NO_PARTIALS, PartialRecords, SlotPartials
from fd_routing_replay.capture.positions import (
    StepPositions,
    as_numpy,
    compute_slot_mapping,
    host_block_table,
    plan_positions,
    request_slots,
)
from fd_routing_replay.capture.sink import RecordSink
from fd_routing_replay.capture.step_buffer import StepBuffer
from fd_routing_replay.errors import InvalidRolloutId
from fd_routing_replay.keys import parse_request_id

__all__ = ["CaptureGeometry", "RoutingReplayManager"]

logger = logging.getLogger(__name__)

SUSPEND_ENV_VAR = "FD_SUSPEND_ROUTING_REPLAY"


def _guarded(*, damages_step: bool = False):
    """Run an engine-facing method; on any exception log, count, and return None.

    ``damages_step``: a failure there can lose this step's rows, so the step's requests
    are marked and reported at finish instead of being written with holes.
    """
    def decorate(method):
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            except Exception as exc:
                self.counters["errors"] += 1
                logger.exception("routing replay: %s failed (counted; the engine step goes on): %r",
                                 method.__name__, exc)
                if damages_step:
                    self._on_step_error()
                return None
            finally:
                self.counters["capture_seconds"] += time.perf_counter() - started
        return guarded
    return decorate


class RoutingReplayManager:
    """Request-level routing capture with FastDeploy's runner interface."""

    enabled = True
    fdrr_manager = True          # marks ours among FastDeploy's own managers

    def __init__(
        self,
        geometry: CaptureGeometry,
        *,
        block_table: Any,
        sink: RecordSink | None = None,
        tp_rank: int = 0,
        fused: bool = True,
        pad_to_max_model_len: bool = False,
        share_inputs: Mapping[str, Any] | None = None,
        place: Any = None,
        metadata: dict[str, Any] | None = None,
        layer_rows: tuple[int, ...] | None = None,
    ) -> None:
        self.geometry = geometry
        self.block_table = block_table
        self._block_host = host_block_table(block_table)   # None for a device table
        self.block_size = geometry.block_size
        self.max_num_seqs = geometry.max_num_seqs
        self.num_moe_layers = geometry.num_moe_layers
        self.moe_top_k = geometry.top_k
        self.tp_rank = tp_rank
        self.sink = sink if tp_rank == 0 else None
        self.share_inputs = share_inputs
        self.routing_dtype = geometry.dtype
        self.fill_value = ops.fill_value(self.routing_dtype)
        self.step = StepBuffer(max_tokens=geometry.step_tokens, num_layers=geometry.num_moe_layers,
                               top_k=geometry.top_k, num_experts=geometry.num_experts,
                               table_experts=geometry.num_experts + geometry.num_shared_experts,
                               layer_rows=layer_rows, place=place)
        self.routing_replay_table = self.step.buffer       # what FastDeploy's forward meta carries
        self.binding = TableBinding(num_experts=geometry.num_experts, step=self.step,
                                    on_error=self._on_hook_error, layer_rows=layer_rows)
        bind_table(self.routing_replay_table, self.binding)
        self.host_cache: HostSlotCache | None = None
        self.assembler: RecordAssembler | None = None
        if self.tp_rank == 0:
            self.host_cache = HostSlotCache(geometry.total_block_num * geometry.block_size,
                                            geometry.num_moe_layers, geometry.top_k,
                                            self.routing_dtype, self.fill_value)
            self.assembler = RecordAssembler(
                self.host_cache, num_experts=geometry.num_experts, fused=fused,
                pad_to=geometry.max_model_len if pad_to_max_model_len else None,
                metadata=metadata, layer_map=geometry.layers)
        n = geometry.max_num_seqs
        self.routing_batch_to_request: dict[int, str] = {}
        self._rollout_ids: list[str | None] = [None] * n
        self._registered = np.zeros(n, dtype=bool)
        self._forwarded = np.zeros(n, dtype=np.int64)
        self._damaged = np.zeros(n, dtype=bool)
        self._step_kept: np.ndarray | None = None
        self.pending_update_positions: StepPositions | None = None
        # the per-step bookkeeping, compiled (capture/ledger.py); None: the NumPy path below
        self.ledger: StepLedger | None = None
        if self._block_host is not None and not geometry.num_speculative_tokens:
            self.ledger = StepLedger.bind(
                registered=self._registered, forwarded=self._forwarded, damaged=self._damaged,
                block_table=self._block_host, block_size=geometry.block_size,
                max_model_len=geometry.max_model_len, max_tokens=geometry.step_tokens,
                host_cache=self.host_cache, step=self.step)
        self.counters: dict[str, float] = {
            "registered": 0, "re_registered": 0, "slot_conflicts": 0, "invalid_request_ids": 0,
            "cleared": 0, "records_submitted": 0, "records_failed": 0, "records_incomplete": 0,
            "tokens_offloaded": 0, "offload_seconds": 0.0, "steps": 0, "errors": 0,
            "unmapped_positions": 0, "suspended_skips": 0, "capture_seconds": 0.0,
            "missing_layer_steps": 0,
        }
        # records are built and handed to the sink off the engine's thread
        self.outlet = RecordOutlet(self.assembler, self.sink, self.counters, name=f"fdrr-finish-tp{tp_rank}")
        self.partials: SlotPartials = NO_PARTIALS       # capture.partial_every_tokens: enable_partials
        self.suspend_routing_replay = False
        self.update_suspend_routing_replay()

    # ------------------------------------------------------------------ FastDeploy API
    def update_suspend_routing_replay(self) -> None:
        """Re-read ``FD_SUSPEND_ROUTING_REPLAY`` (1 = keep capturing, write nothing)."""
        self.suspend_routing_replay = os.environ.get(SUSPEND_ENV_VAR, "0").strip() == "1"

    def get_routing_table(self) -> Any:
        """The step buffer the MoE layers write (``ForwardMeta.routing_replay_table``)."""
        return self.routing_replay_table

    @_guarded()
    def register_request(self, batch_id: int, request_id: str) -> None:
        """Bind slot ``batch_id`` to ``request_id`` (each prefill chunk calls it again)."""
        previous = self.routing_batch_to_request.get(batch_id)
        if previous == request_id:
            self.counters["re_registered"] += 1          # next chunk of a chunked prefill
            return
        if previous is not None:
            self.counters["slot_conflicts"] += 1
            logger.warning(
                "routing replay: slot %d still held request %s (rollout %s) when %s arrived; "
                "its routing is dropped", batch_id, previous, self._rollout_ids[batch_id], request_id)
        try:
            rollout_id: str | None = parse_request_id(request_id).text
        except InvalidRolloutId as exc:
            rollout_id = None
            self.counters["invalid_request_ids"] += 1
            logger.error("routing replay: request %r carries no valid rollout id, its routing "
                         "will not be stored: %s", request_id, exc)
        self.routing_batch_to_request[batch_id] = request_id
        self._rollout_ids[batch_id] = rollout_id
        self._registered[batch_id] = True
        self._forwarded[batch_id] = 0
        self._damaged[batch_id] = False
        self.counters["registered"] += 1
        self.partials.registered_request(batch_id, request_id)

    @_guarded()
    def clear_request(self, batch_id: int) -> None:
        """Preempt/abort: forget the slot's request (nothing on the device to clear)."""
        if self.routing_batch_to_request.pop(batch_id, None) is not None:
            self.counters["cleared"] += 1
        self._deregister(np.array([batch_id], dtype=np.int64))

    @_guarded(damages_step=True)
    def get_token_positions(self, seq_lens_decoder: Any, seq_lens_this_time: Any) -> StepPositions:
        """Positions this step forwards (vectorized; also kept as ``pending_update_positions``)."""
        encoder = self._bound("seq_lens_encoder")
        if self.ledger is not None:
            planned = self.ledger.plan(seq_lens_decoder, seq_lens_this_time, encoder)
            if planned is not None:
                self.pending_update_positions = planned
                return planned
        positions = plan_positions(seq_lens_decoder, seq_lens_this_time, registered=self._registered,
                                   seq_lens_encoder=encoder, block_table=self._block_host,
                                   block_size=self.block_size)
        self.pending_update_positions = positions
        return positions

    @_guarded(damages_step=True)
    def compute_slot_mapping(self, positions: StepPositions) -> np.ndarray:
        """KV slot of every forwarded token (-1 where its block is unassigned).

        Also queues the step's one asynchronous device→host copy (rank 0), which
        ``update_host_cache`` waits for: the forward is already enqueued by now.
        """
        if positions is None:
            return np.zeros(0, dtype=np.int64)
        if self.host_cache is not None:
            self.step.start_offload(positions.num_step_tokens)
        if positions.slots is not None:          # computed with the positions, in one pass
            return positions.slots
        return compute_slot_mapping(self.block_table, positions.batch_ids, positions.positions,
                                    self.block_size)

    @_guarded(damages_step=True)
    def update_host_cache(self, positions: StepPositions, slot_mapping: np.ndarray) -> None:
        """This step's rows into the host slot cache: one D2H copy, one vectorised scatter."""
        if positions is None or slot_mapping is None:
            return
        started = time.perf_counter()
        if self.ledger is not None and self.ledger.planned(positions) and slot_mapping is positions.slots:
            self._commit_planned(positions)
            self.counters["offload_seconds"] += time.perf_counter() - started
            return
        self.counters["steps"] += 1
        valid = (slot_mapping >= 0) & (positions.positions < self.geometry.max_model_len)
        if not valid.all():
            unmapped = ~valid
            self.counters["unmapped_positions"] += int(unmapped.sum())
            self._damaged[np.unique(positions.batch_ids[unmapped])] = True
        kept = positions.counts
        if self.geometry.num_speculative_tokens and len(positions):
            accept = self._bound("accept_num")
            if accept is not None:
                accept_num = as_numpy(accept, np.int64)[positions.active]
                decode = ~positions.is_prefill if positions.is_prefill is not None else np.ones_like(accept_num, bool)
                kept = np.where(decode, np.clip(accept_num, 1, positions.counts), positions.counts)
                valid &= positions.relative < np.repeat(kept, positions.counts)
        self._step_kept = kept
        self._forwarded[positions.active] = positions.starts + kept
        if self.host_cache is None:
            return
        if not self.step.pending:
            self.step.start_offload(positions.num_step_tokens)
        step = self.step.finish_offload()
        if step is None or len(positions) == 0:
            return
        if not step.layer_calls.all():   # rows of a layer that did not record are a previous step's
            self.counters["missing_layer_steps"] += 1
            logger.error("routing replay: MoE layers %s recorded nothing this step; the step's "
                         "requests are marked lost", step.missing_layers.tolist())
            self._damaged[positions.active] = True
            return
        if positions.num_step_tokens > step.rows.shape[0]:   # more tokens than the buffer holds
            outside = positions.rows >= step.rows.shape[0]
            self._damaged[np.unique(positions.batch_ids[outside])] = True
        written = ops.scatter_rows(self.host_cache.array, step.rows,
                                   np.where(valid, slot_mapping, -1), positions.rows)
        self.counters["tokens_offloaded"] += written
        self.counters["offload_seconds"] += time.perf_counter() - started

    @_guarded()
    def put_finished_batch(self, finished_batch_ids: Any, seq_lens_decoder: Any = None) -> None:
        """Assemble and submit the records of requests that finished this step.

        ``seq_lens_decoder`` is accepted for FastDeploy compatibility and ignored: the
        length is what the manager saw forwarded (the reference's value misses the last
        forwarded token of a request finishing in decode).
        """
        positions = self.pending_update_positions
        if positions is None or len(positions.active) == 0:
            return
        if self.ledger is not None and self.ledger.planned(positions):
            finished = self.ledger.finished(positions, finished_batch_ids, self._bound("stop_flags"),
                                            self._bound("prompt_lens"))
            finished = finished.copy() if len(finished) else finished
        else:
            finished = self._finished_slots(finished_batch_ids, positions)
        if len(finished):
            lengths = self._finish_lengths(finished, positions)
            for batch_id, length in zip(finished.tolist(), lengths.tolist(), strict=True):
                self._put_one(batch_id, length)
                self.routing_batch_to_request.pop(batch_id, None)
            self._deregister(finished)
        self.partials.after_step(positions.active, finished, self.suspend_routing_replay)

    @_guarded()
    def clear_all_request(self) -> None:
        """RL weight update: forget every request and every cached row."""
        self.routing_batch_to_request.clear()
        self._deregister(np.arange(self.max_num_seqs, dtype=np.int64))
        self.step.fill()
        if self.host_cache is not None:
            self.host_cache.clear()
        self.pending_update_positions = None
        self.partials.clear()

    def split_request_id(self, request_id: str) -> str:
        """``chatcmpl-{user}-{uuid}`` → rollout id (strict; raises InvalidRolloutId)."""
        return parse_request_id(request_id).text

    def enable_partials(self, every_tokens: int) -> None:
        """Partial records every ``every_tokens`` positions (:mod:`fd_routing_replay.capture.partial`)."""
        if self.sink is not None and self.assembler is not None and every_tokens > 0:
            self.partials = SlotPartials(PartialRecords(every_tokens, self.outlet), self._forwarded, self._registered,
                                         self._damaged, self._rollout_ids, self._request_slots)

    # ------------------------------------------------------------------ lifecycle
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted record is durable (True) or ``timeout`` passes."""
        return self.outlet.flush(timeout)

    def wait_finished(self, timeout: float | None = None) -> bool:
        """Wait until the records of every request finished so far were handed to the
        sink (built off the engine's thread); False if ``timeout`` passed first."""
        return self.outlet.wait_finished(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Finish the records in hand, flush and close the sink; unbind the table from the hook."""
        unbind_table(self.routing_replay_table)
        self.outlet.close(timeout)
        if self.sink is not None:
            self.sink.close(timeout)

    def stats(self) -> dict[str, Any]:
        """Counters of this manager, the hook and the sink."""
        out: dict[str, Any] = dict(self.counters)
        out["hook_calls"] = self.binding.calls
        out["hook_seconds"] = self.binding.seconds
        out["capture_seconds"] = self.counters["capture_seconds"] + self.binding.seconds
        out["hook_errors"] = self.binding.errors
        out["hook_mismatches"] = self.binding.mismatches
        out["bad_expert_ids"] = self.binding.bad_ids
        out["host_cache_bytes"] = self.host_cache.nbytes if self.host_cache is not None else 0
        out["capture_device_bytes"] = self.step.device_bytes
        out["step_buffer_rows"] = self.step.max_tokens
        out["dtype"] = self.routing_dtype.name
        out["finishing"] = self.outlet.stats()
        if self.sink is not None:
            out["sink"] = self.sink.stats()
        return out

    # ------------------------------------------------------------------ internals
    def _commit_planned(self, positions: StepPositions) -> None:
        """update_host_cache through the compiled ledger (no speculative tokens)."""
        self.counters["steps"] += 1
        self._step_kept = None               # read by the speculative path only, which is NumPy's
        staged = None
        if self.host_cache is not None:
            if not self.step.pending:
                self.step.start_offload(positions.num_step_tokens)
            staged = self.step.wait_offload()
        written, unmapped, missing, _ = self.ledger.commit(positions, None if staged is None else staged[0])
        if unmapped:
            self.counters["unmapped_positions"] += unmapped
        if missing and len(positions):
            self.counters["missing_layer_steps"] += 1
            logger.error("routing replay: MoE layers %s recorded nothing this step; the step's "
                         "requests are marked lost",
                         np.flatnonzero(self.step.counter_delta[1:] == 0).tolist())
        self.counters["tokens_offloaded"] += written

    def _bound(self, name: str) -> Any:
        if self.share_inputs is None:
            return None
        try:
            return self.share_inputs[name]
        except Exception:  # a mapping without the key (FastDeploy versions differ)
            return None

    def _deregister(self, batch_ids: np.ndarray) -> None:
        for batch_id in batch_ids.tolist():
            self._rollout_ids[batch_id] = None
        self._registered[batch_ids] = False
        self._forwarded[batch_ids] = 0
        self._damaged[batch_ids] = False

    def _finished_slots(self, finished_batch_ids: Any, positions: StepPositions) -> np.ndarray:
        """Slots that forwarded this step and finished (EOS, stop flag or length)."""
        n = self.max_num_seqs
        flags = np.zeros(n, dtype=bool)
        given = as_numpy(finished_batch_ids, bool) if finished_batch_ids is not None else flags
        flags[: min(n, given.shape[0])] |= given[:n]
        stop = self._bound("stop_flags")
        if stop is not None:
            stop_np = as_numpy(stop, bool)
            flags[: min(n, stop_np.shape[0])] |= stop_np[:n]
        active = positions.active
        done = flags[active]
        if self.geometry.num_speculative_tokens and self._step_kept is not None:
            step_idx, max_dec = self._bound("step_idx"), self._bound("max_dec_len")
            if step_idx is not None and max_dec is not None:
                remaining = as_numpy(max_dec, np.int64)[active] - as_numpy(step_idx, np.int64)[active]
                decode = ~positions.is_prefill if positions.is_prefill is not None else True
                done |= decode & (self._step_kept >= remaining)
        done &= self._registered[active]
        if not done.any():            # the common step: nothing finished
            return active[:0]
        prompt_lens = self._bound("prompt_lens")
        if prompt_lens is not None:   # an unfinished prefill chunk cannot end the request
            ends = positions.starts + positions.counts
            done &= ends >= as_numpy(prompt_lens, np.int64)[active]
        return active[done]

    def _finish_lengths(self, finished: np.ndarray, positions: StepPositions) -> np.ndarray:
        """Forwarded positions of each finished request, trimmed at EOS / length (speculative)."""
        lengths = self._forwarded[finished].copy()
        if not self.geometry.num_speculative_tokens or self._step_kept is None:
            return lengths
        order = np.searchsorted(positions.active, finished)
        starts = positions.starts[order]
        kept = self._step_kept[order].copy()
        decode = ~positions.is_prefill[order] if positions.is_prefill is not None else np.ones_like(kept, bool)
        tokens, eos = self._bound("accept_tokens"), self._bound("eos_token_id")
        if tokens is not None and eos is not None:
            accepted = as_numpy(tokens, np.int64).reshape(self.max_num_seqs, -1)[finished]
            width = accepted.shape[1]
            in_kept = np.arange(width)[None, :] < kept[:, None]
            is_eos = np.isin(accepted, as_numpy(eos, np.int64)) & in_kept
            first = np.where(is_eos.any(1), is_eos.argmax(1) + 1, kept)
            kept = np.where(decode, np.minimum(kept, first), kept)
        step_idx, max_dec = self._bound("step_idx"), self._bound("max_dec_len")
        if step_idx is not None and max_dec is not None:
            remaining = as_numpy(max_dec, np.int64)[finished] - as_numpy(step_idx, np.int64)[finished]
            kept = np.where(decode, np.minimum(kept, np.maximum(remaining, 1)), kept)
        return starts + kept

    def _put_one(self, batch_id: int, length: int) -> None:
        """Gather one finished request's rows now; build and hand on its record(s) on the
        finishing thread (:mod:`fd_routing_replay.capture.handoff`)."""
        rollout_id = self._rollout_ids[batch_id]
        request_id = self.routing_batch_to_request.get(batch_id)
        if self.sink is None or self.assembler is None or rollout_id is None:
            return
        if self.suspend_routing_replay:
            self.counters["suspended_skips"] += 1
            return
        if self._damaged[batch_id]:
            self.outlet.count("records_failed")
            logger.error("routing replay: routing of rollout %s (request %s) was lost during "
                         "capture; no record written", rollout_id, request_id)
            return
        try:
            if self._block_host is not None:        # one compiled call from the block-table row
                ids = self.assembler.gather_request(self._block_host[batch_id], length, self.block_size)
            else:
                ids = self.assembler.gather(self._request_slots(batch_id, length))
        except Exception as exc:
            self.outlet.count("records_failed")
            logger.error("routing replay: could not gather the routing of rollout %s "
                         "(request %s): %r", rollout_id, request_id, exc)
            return
        self.outlet.submit(rollout_id, request_id, ids)

    def _request_slots(self, batch_id: int, length: int) -> np.ndarray:
        """KV slots of positions 0..length-1 of one slot: one block-table row to the host."""
        row = self._block_host[batch_id] if self._block_host is not None else self.block_table[batch_id]
        return request_slots(row, length, self.block_size)

    def _on_hook_error(self, layer_idx: int, exc: BaseException) -> None:
        self._on_step_error()

    def _on_step_error(self) -> None:
        """Routing of the step's requests may be incomplete: mark them, never guess."""
        positions = self.pending_update_positions
        if positions is not None and len(positions.active):
            self._damaged[positions.active] = True
