"""FastDeploy 2.5 / develop's routing-table generation: the runner's manager over our capture.

:class:`RoutingReplayManager` keeps the method names, keyword names and call order of
FastDeploy's ``RoutingReplayManager`` (``register_request``, ``clear_request``,
``get_token_positions``, ``compute_slot_mapping``, ``update_host_cache``,
``put_finished_batch``, ``get_routing_table``, ``clear_all_request``), so FastDeploy's runner and
post-processing drive it unchanged.  What differs is inside:

* **A token-major step buffer, not a table.**  ``get_routing_table()`` returns the step buffer
  ``[max_num_batched_tokens, L, K]`` (:class:`~fd_routing_replay.capture.device.StepBuffer`):
  each MoE layer writes its rows with one bound call, token ``t`` of the step in row ``t``.
* **Per-step bookkeeping compiled** (:class:`StepLedger`, custom_ops/step_ledger.cc): one
  asynchronous device-to-host copy of the step's rows and counters, then one bound call per
  FastDeploy method -- no loop over sequences, no allocation.  A finished request's rows are
  gathered from the host slot cache straight into the writer's ring
  (:mod:`fd_routing_replay.capture.handoff`).
* **Token coverage.**  A record holds one row per position that went through the forward
  pass: every prompt token and every generated token that was fed back, *including the last
  forwarded one* (the reference takes the length before the inputs update and drops it).
  With speculative decoding only accepted positions count.
* **Finish detection.**  Besides FastDeploy's ``finished_batch_ids`` a request also finishes
  when its ``stop_flags`` entry is set, so no record is silently lost and no slot is found
  still occupied.
* **Errors never stop the step**: counted; a request whose routing was lost is logged with its
  rollout id and not written wrong.  **TP > 1**: only rank 0 offloads and writes.

:class:`NoopRoutingReplayManager` is its do-nothing twin for when routing replay is off;
:func:`create_manager` picks one from a config.
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
from fd_routing_replay.capture.device import StepBuffer, TableBinding, bind_table, unbind_table
from fd_routing_replay.capture.handoff import Handoff, records_pad_to
from fd_routing_replay.capture.slots import (
    CaptureGeometry,
    HostSlotCache,
    as_numpy,
    host_block_table,
)
from fd_routing_replay.errors import InvalidRolloutId
from fd_routing_replay.keys import parse_request_id

__all__ = ["HostInts", "NoopRoutingReplayManager", "PlannedStep", "RoutingReplayManager",
           "SlotPartials", "StepLedger", "create_manager"]

logger = logging.getLogger(__name__)

SUSPEND_ENV_VAR = "FD_SUSPEND_ROUTING_REPLAY"


def create_manager(
    config: Any,
    geometry: CaptureGeometry,
    *,
    block_table: Any,
    tp_rank: int = 0,
    share_inputs: Mapping[str, Any] | None = None,
    writer: Any = None,
    place: Any = None,
    metadata: dict[str, Any] | None = None,
    identity: Any = None,
    layer_rows: tuple[int, ...] | None = None,
    num_decoder_layers: int | None = None,
) -> Any:
    """A :class:`RoutingReplayManager` for ``config``, or the no-op twin when
    ``config.enabled`` is false -- what FastDeploy's runner installs, and what the harness
    builds its engines with.

    Only TP rank 0 writes: it gets ``writer``, or (None) a
    :class:`~fd_routing_replay.writer.RoutingWriter` from the config, which it then owns;
    ``identity`` (a :class:`~fd_routing_replay.core.paths.RankIdentity`) gives that writer its
    rank's journal and dead-letter directories.  The writer serves the manager's metrics.
    """
    if not config.enabled:
        return NoopRoutingReplayManager()
    owns_writer = False
    if tp_rank != 0:
        writer = None
    elif writer is None:
        from fd_routing_replay.writer import RoutingWriter

        writer, owns_writer = RoutingWriter.from_config(config, identity=identity), True
    capture = config.capture
    try:
        manager = RoutingReplayManager(
            geometry, block_table=block_table, writer=writer, owns_writer=owns_writer, tp_rank=tp_rank,
            fused=capture.fused, pad_to=records_pad_to(config, geometry.max_model_len),
            record_format=capture.record_format, share_inputs=share_inputs, place=place,
            metadata=metadata, layer_rows=layer_rows, num_decoder_layers=num_decoder_layers,
            weights_version=capture.weights_version or None,
            partial_every_tokens=capture.partial_every_tokens)
    except BaseException:
        if owns_writer:
            writer.close()
        raise
    if writer is not None:
        from fd_routing_replay.capture import render_capture

        writer.export_metrics(manager.stats, render_capture)
    return manager


class NoopRoutingReplayManager:
    """The manager to install when routing replay is off: same interface, does nothing.

    FastDeploy's MoE layers bind the capture hook only when ``get_routing_table()`` returns a
    table, so returning ``None`` removes every per-layer cost; the runner calls the other
    methods unconditionally and they return at once (no ``if enabled`` on the hot path)."""

    enabled = False
    fdrr_manager = True
    pending_update_positions: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.routing_batch_to_request: dict[int, str] = {}

    def get_routing_table(self) -> None:
        return None

    def register_request(self, batch_id: int, request_id: str) -> None:
        return None

    def clear_request(self, batch_id: int) -> None:
        return None

    def get_token_positions(self, seq_lens_decoder: Any, seq_lens_this_time: Any) -> None:
        return None

    def compute_slot_mapping(self, positions: Any) -> np.ndarray:
        return np.zeros(0, dtype=np.int64)

    def update_host_cache(self, positions: Any, slot_mapping: Any) -> None:
        return None

    def put_finished_batch(self, finished_batch_ids: Any, seq_lens_decoder: Any = None) -> None:
        return None

    def clear_all_request(self) -> None:
        return None

    def update_suspend_routing_replay(self) -> None:
        return None

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self, timeout: float | None = None) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {"enabled": False}


_ITEMSIZE = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8}
_ITEMSIZE_BY_DTYPE: dict[Any, int | None] = {}      # Paddle dtype object -> item size (None: not an int)


def _itemsize(dtype: Any) -> int | None:
    """Item size of a Paddle integer/bool dtype (None for any other), looked up once per dtype."""
    try:
        return _ITEMSIZE_BY_DTYPE[dtype]
    except KeyError:
        size = _ITEMSIZE_BY_DTYPE[dtype] = _ITEMSIZE.get(str(dtype).rsplit(".", 1)[-1])
        return size


class HostInts:
    """``(address, itemsize, length)`` of per-step integer inputs, read in place.

    A CPU Paddle tensor is described once per object (dtype, place) and then only asked
    for its data pointer (and its length again when the pointer moved); a NumPy array by
    its buffer; anything else (a device tensor, a list) is copied to a host array that
    this object keeps alive until the next call for the same input name.
    """

    def __init__(self) -> None:
        self._described: dict[str, tuple[Any, int, int, int]] = {}   # name -> (obj, itemsize, ptr, length)
        self._copies: dict[str, np.ndarray] = {}

    def __call__(self, name: str, value: Any) -> tuple[int, int, int]:
        if value is None:
            return 0, 0, 0
        known = self._described.get(name)
        if known is not None and known[0] is value:
            pointer = value.data_ptr()
            if pointer == known[2]:
                return pointer, known[1], known[3]
        if isinstance(value, np.ndarray):
            if value.flags.c_contiguous and value.dtype.kind in "biu" and value.itemsize in (1, 2, 4, 8):
                return value.ctypes.data, value.itemsize, value.size
            return self._copy(name, value)
        place = getattr(value, "place", None)
        if place is not None and hasattr(value, "data_ptr") and place.is_cpu_place():
            itemsize = _itemsize(value.dtype)
            if itemsize is not None:
                pointer = value.data_ptr()
                length = 1
                for dim in value.shape:
                    length *= int(dim)
                self._described[name] = (value, itemsize, pointer, length)
                return pointer, itemsize, length
        return self._copy(name, value)

    def _copy(self, name: str, value: Any) -> tuple[int, int, int]:
        array = np.ascontiguousarray(as_numpy(value))
        if array.dtype.kind not in "biu" or array.itemsize not in (1, 2, 4, 8):
            array = array.astype(np.int64)
        self._copies[name] = array
        return array.ctypes.data, array.itemsize, array.size


class PlannedStep:
    """A step the ledger planned: where its tracked tokens sit (slot, position, step-buffer
    row, KV slot) and which slots forwarded, as views of the ledger's scratch made only when
    read (the ledger itself reads the scratch).  Valid until the ledger plans the next step."""

    __slots__ = ("ledger", "num_tokens", "num_active", "num_step_tokens", "_has_encoder", "_slots")

    def __init__(self, ledger: StepLedger, num_tokens: int, num_active: int, num_step_tokens: int,
                 has_encoder: bool) -> None:
        self.ledger = ledger
        self.num_tokens = num_tokens
        self.num_active = num_active
        self.num_step_tokens = int(num_step_tokens)
        self._has_encoder = has_encoder
        self._slots: np.ndarray | None = None

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def batch_ids(self) -> np.ndarray:
        return self.ledger.tokens[0, :self.num_tokens]

    @property
    def positions(self) -> np.ndarray:
        return self.ledger.tokens[1, :self.num_tokens]

    @property
    def rows(self) -> np.ndarray:
        return self.ledger.tokens[2, :self.num_tokens]

    @property
    def slots(self) -> np.ndarray:
        """KV slot per token (-1: none); one object per step (``compute_slot_mapping``
        returns it and ``update_host_cache`` recognises it)."""
        if self._slots is None:
            self._slots = self.ledger.tokens[3, :self.num_tokens]
        return self._slots

    @property
    def active(self) -> np.ndarray:
        return self.ledger.slots[0, :self.num_active]

    @property
    def starts(self) -> np.ndarray:
        return self.ledger.slots[1, :self.num_active]

    @property
    def counts(self) -> np.ndarray:
        return self.ledger.slots[2, :self.num_active]

    @property
    def is_prefill(self) -> np.ndarray | None:
        return self.ledger.slots[3, :self.num_active].astype(bool) if self._has_encoder else None

    @property
    def kept(self) -> np.ndarray:
        """Tokens of each active slot that count (after the commit: speculative decoding
        keeps a decode step's accepted ones)."""
        return self.ledger.slots[4, :self.num_active]

    @property
    def relative(self) -> np.ndarray:
        """Index of each token within its sequence's part of this step (0..count-1)."""
        return self.positions - np.repeat(self.starts, self.counts)


class StepLedger:
    """The bound ledger with its scratch and state arrays (see the module docstring).

    ``registered``, ``forwarded`` and ``damaged`` are the manager's own per-slot arrays: the
    ledger reads and updates them in place.  Scratch: ``tokens`` int64 ``[4, T]`` (slot,
    position, step-buffer row, KV slot of each tracked token), ``slots`` int64 ``[5, S]``
    (active slot, start, count, prefill, kept), ``finished`` int64 ``[2, S]`` (finished slot,
    its length).  The token scratch grows when a step tracks more tokens than it holds.
    """

    def __init__(self, arrays: dict[str, Any], max_tokens: int) -> None:
        num_seqs = int(arrays["registered"].shape[0])
        self._arrays = arrays
        self.slots = np.zeros((5, num_seqs), dtype=np.int64)
        self.finished_scratch = np.zeros((2, num_seqs), dtype=np.int64)
        self.inputs = HostInts()
        self.current: PlannedStep | None = None      # the last plan: its views are current
        self._bind(max(int(max_tokens), 1))

    def _bind(self, capacity: int) -> None:
        self.tokens = np.zeros((4, capacity), dtype=np.int64)
        self.capacity = capacity
        self.bound = ops.bind_step_ledger(tokens=self.tokens, slots=self.slots,
                                          finished=self.finished_scratch, **self._arrays)

    def plan(self, seq_lens_decoder: Any, seq_lens_this_time: Any, seq_lens_encoder: Any = None) -> PlannedStep:
        """This step's tracked tokens (the token scratch grows to hold them)."""
        decoder = self.inputs("seq_lens_decoder", seq_lens_decoder)
        this_time = self.inputs("seq_lens_this_time", seq_lens_this_time)
        encoder = self.inputs("seq_lens_encoder", seq_lens_encoder)
        while True:
            count, active, step_tokens = self.bound.plan(decoder[0], decoder[1], decoder[2], this_time[0],
                                                         this_time[1], this_time[2], *encoder)
            if count >= 0:
                break
            self._bind(2 * self.capacity)             # rare: more tracked tokens than ever before
        self.current = PlannedStep(self, count, active, step_tokens, seq_lens_encoder is not None)
        return self.current

    def planned(self, positions: Any) -> bool:
        """Whether ``positions`` is this ledger's current plan (its scratch views are valid)."""
        return positions is not None and positions is self.current

    def commit(self, positions: PlannedStep, staged_rows: int | None,
               accept_num: Any = None) -> tuple[int, int, int, int]:
        """``(written, unmapped, missing_layers, bad_ids)`` of the planned step; ``staged_rows``
        None on a rank that does not offload; ``accept_num``: speculative decoding's."""
        return self.bound.commit(positions.num_tokens, positions.num_active,
                                 -1 if staged_rows is None else int(staged_rows),
                                 *self.inputs("accept_num", accept_num))

    def finished(self, positions: PlannedStep, finished_batch_ids: Any, stop_flags: Any, prompt_lens: Any,
                 **speculative: Any) -> tuple[np.ndarray, np.ndarray]:
        """The planned step's slots that finished and their lengths (views, valid until the
        next call).  ``speculative``: ``step_idx``, ``max_dec_len``, ``accept_tokens``,
        ``eos_token_id`` (speculative decoding only)."""
        names = ("step_idx", "max_dec_len", "accept_tokens", "eos_token_id")
        count = self.bound.finished(positions.num_active, *self.inputs("finished", finished_batch_ids),
                                    *self.inputs("stop_flags", stop_flags),
                                    *self.inputs("prompt_lens", prompt_lens),
                                    *(value for name in names for value in self.inputs(name, speculative.get(name))))
        return self.finished_scratch[0, :count], self.finished_scratch[1, :count]


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
        writer: Any = None,
        owns_writer: bool = False,
        tp_rank: int = 0,
        fused: bool = True,
        pad_to: int = 0,
        record_format: str = "rr-v1",
        share_inputs: Mapping[str, Any] | None = None,
        place: Any = None,
        metadata: dict[str, Any] | None = None,
        layer_rows: tuple[int, ...] | None = None,
        num_decoder_layers: int | None = None,
        weights_version: str | None = None,
        partial_every_tokens: int = 0,
    ) -> None:
        self.geometry = geometry
        self.block_table = block_table
        # The ledger reads the block table on the host: a CPU table in place, a device table
        # through a mirror refreshed once per step (one device-to-host copy).
        self._block_host = host_block_table(block_table)
        self._block_mirror = self._block_host is None
        if self._block_mirror:
            shape = tuple(int(d) for d in block_table.shape)
            self._block_host = np.full(shape, -1, dtype=np.int64)
        self.block_size = geometry.block_size
        self.max_num_seqs = geometry.max_num_seqs
        self.num_moe_layers = geometry.num_moe_layers
        self.moe_top_k = geometry.top_k
        self.tp_rank = tp_rank
        self.writer = writer if tp_rank == 0 else None
        self._owns_writer = owns_writer and self.writer is not None
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
        self.counters: dict[str, Any] = {
            "registered": 0, "re_registered": 0, "slot_conflicts": 0, "invalid_request_ids": 0,
            "cleared": 0, "tokens_offloaded": 0, "offload_seconds": 0.0, "steps": 0, "errors": 0,
            "unmapped_positions": 0, "suspended_skips": 0, "capture_seconds": 0.0,
            "missing_layer_steps": 0,
        }
        self.host_cache: HostSlotCache | None = None
        self.handoff: Handoff | None = None
        if self.tp_rank == 0:
            self.host_cache = HostSlotCache(geometry.total_block_num * geometry.block_size,
                                            geometry.num_moe_layers, geometry.top_k,
                                            self.routing_dtype, self.fill_value)
            if self.writer is not None:
                self.handoff = Handoff(
                    self.host_cache, self.writer, num_experts=geometry.num_experts,
                    layer_map=geometry.layers, record_format=record_format, fused=fused, pad_to=pad_to,
                    metadata=metadata, num_decoder_layers=num_decoder_layers,
                    weights_version=weights_version, partial_every_tokens=partial_every_tokens,
                    counters=self.counters)
        n = geometry.max_num_seqs
        self.routing_batch_to_request: dict[int, str] = {}
        self._rollout_ids: list[str | None] = [None] * n
        self._registered = np.zeros(n, dtype=bool)
        self._forwarded = np.zeros(n, dtype=np.int64)
        self._damaged = np.zeros(n, dtype=bool)
        self.pending_update_positions: PlannedStep | None = None
        # the per-step bookkeeping: three bound calls of the compiled ledger
        offload = dict(cache=None, staging=None, host_counters=None, seen=None, delta=None)
        if self.host_cache is not None:
            offload = dict(cache=self.host_cache.array, staging=self.step.host_rows,
                           host_counters=self.step.host_counters, seen=self.step.seen_counters,
                           delta=self.step.counter_delta)
        self.ledger = StepLedger(dict(
            registered=self._registered, forwarded=self._forwarded, damaged=self._damaged,
            block_table=self._block_host, block_size=int(geometry.block_size),
            max_model_len=int(geometry.max_model_len), **offload),
            max_tokens=geometry.max_num_seqs * (1 + geometry.num_speculative_tokens))
        # capture.partial_every_tokens: a partial record of a slot every N positions
        self.partials = SlotPartials(self.handoff, self._forwarded, self._registered, self._damaged,
                                     self._rollout_ids, self._block_row, geometry.block_size) \
            if self.handoff is not None and self.handoff.partial_every else None
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
        if self.partials is not None:
            self.partials.registered_request(batch_id, request_id)

    @_guarded()
    def clear_request(self, batch_id: int) -> None:
        """Preempt/abort: forget the slot's request (nothing on the device to clear)."""
        if self.routing_batch_to_request.pop(batch_id, None) is not None:
            self.counters["cleared"] += 1
        self._deregister(np.array([batch_id], dtype=np.int64))

    @_guarded(damages_step=True)
    def get_token_positions(self, seq_lens_decoder: Any, seq_lens_this_time: Any) -> PlannedStep:
        """Positions this step forwards and their KV slots, planned in one bound call (also
        kept as ``pending_update_positions``)."""
        if self._block_mirror:                 # a device block table: this step's copy
            np.copyto(self._block_host, as_numpy(self.block_table, np.int64).reshape(self._block_host.shape))
        planned = self.ledger.plan(seq_lens_decoder, seq_lens_this_time, self._bound("seq_lens_encoder"))
        self.pending_update_positions = planned
        return planned

    @_guarded(damages_step=True)
    def compute_slot_mapping(self, positions: PlannedStep) -> np.ndarray:
        """KV slot of every forwarded token (-1 where its block is unassigned).

        Also queues the step's one asynchronous device→host copy (rank 0), which
        ``update_host_cache`` waits for: the forward is already enqueued by now.
        """
        if not self.ledger.planned(positions):
            return np.zeros(0, dtype=np.int64)
        if self.host_cache is not None:
            self.step.start_offload(positions.num_step_tokens)
        return positions.slots

    @_guarded(damages_step=True)
    def update_host_cache(self, positions: PlannedStep, slot_mapping: np.ndarray) -> None:
        """This step's rows into the host slot cache: one D2H copy, one bound commit (the
        tokens without a KV slot, the forwarded lengths, the device counters, the scatter)."""
        if not self.ledger.planned(positions):
            return
        started = time.perf_counter()
        self.counters["steps"] += 1
        staged = None
        if self.host_cache is not None:
            if not self.step.pending:
                self.step.start_offload(positions.num_step_tokens)
            staged = self.step.wait_offload()
        accept = self._bound("accept_num") if self.geometry.num_speculative_tokens else None
        written, unmapped, missing, _ = self.ledger.commit(positions, None if staged is None else staged[0],
                                                           accept)
        if unmapped:
            self.counters["unmapped_positions"] += unmapped
        if missing and len(positions):
            self.counters["missing_layer_steps"] += 1
            logger.error("routing replay: MoE layers %s recorded nothing this step; their rows of "
                         "this step's tokens are marked unknown (the other layers' rows are kept)",
                         np.flatnonzero(self.step.counter_delta[1:] == 0).tolist())
        self.counters["tokens_offloaded"] += written
        self.counters["offload_seconds"] += time.perf_counter() - started

    @_guarded()
    def put_finished_batch(self, finished_batch_ids: Any, seq_lens_decoder: Any = None) -> None:
        """Hand the records of requests that finished this step to the writer.

        ``seq_lens_decoder`` is accepted for FastDeploy compatibility and ignored: the
        length is what the manager saw forwarded (the reference's value misses the last
        forwarded token of a request finishing in decode).
        """
        positions = self.pending_update_positions
        if not self.ledger.planned(positions) or positions.num_active == 0:
            return
        speculative = {}
        if self.geometry.num_speculative_tokens:
            speculative = {name: self._bound(name) for name in
                           ("step_idx", "max_dec_len", "accept_tokens", "eos_token_id")}
        finished, lengths = self.ledger.finished(positions, finished_batch_ids, self._bound("stop_flags"),
                                                 self._bound("prompt_lens"), **speculative)
        finished = finished.copy()
        for batch_id, length in zip(finished.tolist(), lengths.tolist(), strict=True):
            self._put_one(batch_id, length)
            self.routing_batch_to_request.pop(batch_id, None)
        self._deregister(finished)
        if self.partials is not None:
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
        if self.partials is not None:
            self.partials.clear()

    def split_request_id(self, request_id: str) -> str:
        """``chatcmpl-{user}-{uuid}`` → rollout id (strict; raises InvalidRolloutId)."""
        return parse_request_id(request_id).text

    # ------------------------------------------------------------------ lifecycle
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every record handed to the writer is durable (True) or ``timeout`` passes."""
        return True if self.writer is None else bool(self.writer.flush(timeout))

    def close(self, timeout: float | None = None) -> None:
        """Unbind the table from the hook; flush and close the writer when this manager owns it."""
        unbind_table(self.routing_replay_table)
        writer, self.writer = self.writer, None
        if writer is not None and self._owns_writer:
            writer.close(timeout)

    def stats(self) -> dict[str, Any]:
        """Counters of this manager, the hook and the writer."""
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
        if self.writer is not None:
            out["writer"] = self.writer.stats()
        return out

    # ------------------------------------------------------------------ internals
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

    def _put_one(self, batch_id: int, length: int) -> None:
        """Hand one finished request's rows to the writer (:mod:`fd_routing_replay.capture.handoff`)."""
        rollout_id = self._rollout_ids[batch_id]
        request_id = self.routing_batch_to_request.get(batch_id)
        if self.handoff is None or rollout_id is None:
            return
        if self.suspend_routing_replay:
            self.counters["suspended_skips"] += 1
            return
        if self._damaged[batch_id]:
            self.counters["records_failed"] += 1
            logger.error("routing replay: routing of rollout %s (request %s) was lost during "
                         "capture; no record written", rollout_id, request_id)
            return
        self.handoff.finish(rollout_id, request_id, self._block_row(batch_id), length, self.block_size)

    def _block_row(self, batch_id: int) -> np.ndarray:
        """One slot's block-table row on the host."""
        if self._block_host is not None:
            return self._block_host[batch_id]
        return as_numpy(self.block_table[batch_id], np.int64)

    def _on_hook_error(self, layer_idx: int, exc: BaseException) -> None:
        self._on_step_error()

    def _on_step_error(self) -> None:
        """Routing of the step's requests may be incomplete: mark them, never guess."""
        positions = self.pending_update_positions
        if positions is not None and len(positions.active):
            self._damaged[positions.active] = True


class SlotPartials:
    """The table API's partial records (``capture.partial_every_tokens``): one vectorised
    check of the manager's slots per step, each due slot's routing so far handed over
    (:meth:`Handoff.partial <fd_routing_replay.capture.handoff.Handoff.partial>`).

    ``forwarded``, ``registered`` and ``damaged`` are the manager's per-slot arrays (read,
    never written), ``rollout_ids`` its per-slot rollout ids, ``block_row(slot)`` a slot's
    block-table row on the host.
    """

    def __init__(self, handoff: Handoff, forwarded: np.ndarray, registered: np.ndarray,
                 damaged: np.ndarray, rollout_ids: list[str | None], block_row: Any,
                 block_size: int) -> None:
        self.handoff = handoff
        self.block_size = int(block_size)
        self.forwarded, self.registered, self.damaged = forwarded, registered, damaged
        self.rollout_ids = rollout_ids
        self.block_row = block_row
        self.last = np.zeros(forwarded.shape[0], dtype=np.int64)   # tokens of each slot's last partial
        self.request_ids: list[str | None] = [None] * forwarded.shape[0]

    def registered_request(self, slot: int, request_id: str) -> None:
        """Slot ``slot`` now holds ``request_id`` (new, or back after a preemption)."""
        self.request_ids[slot] = request_id
        self.last[slot] = self.handoff.last_partial(request_id)

    def after_step(self, active: np.ndarray, finished: np.ndarray, suspended: bool = False) -> None:
        """After a step's finish handling: forget the finished requests, hand over a partial
        record of each active slot that forwarded ``every`` positions since its last one
        (none while ``suspended``: ``FD_SUSPEND_ROUTING_REPLAY=1`` writes nothing)."""
        for slot in finished.tolist():
            self.handoff.forget(self.request_ids[slot])
            self.request_ids[slot] = None
        forwarded = self.forwarded[active]
        due = forwarded - self.last[active] >= self.handoff.partial_every
        if suspended or not due.any():        # the common step
            return
        due &= self.registered[active] & ~self.damaged[active]
        for slot, num_tokens in zip(active[due].tolist(), forwarded[due].tolist(), strict=True):
            self.last[slot] = num_tokens
            request_id = self.request_ids[slot]
            if request_id is not None:
                self.handoff.partial(self.rollout_ids[slot], request_id, self.block_row(slot),
                                     num_tokens, self.block_size)

    def clear(self) -> None:
        """RL weight update: every slot is free, every request dropped."""
        self.last[:] = 0
        self.request_ids = [None] * len(self.request_ids)
        self.handoff.clear()
