"""FastDeploy 2.6's step-buffer generation: the worker's capturer and the engine's side.

FastDeploy 2.6 splits routing replay across processes (its ``RoutedExpertsCapturer`` in the
worker, its ``RoutingCacheManager`` in the engine).  Ours keeps both interfaces; inside:

* **Worker** (:class:`StepRoutingCapturer`, driven by ``gpu_model_runner.py`` and
  ``pre_and_post_process.py``; the members it uses are listed by
  :func:`fd_routing_replay.integrations.fastdeploy.api.manager_members_used`):
  ``get_device_routing_buffer()`` is our step buffer in the real unsigned dtype
  (FastDeploy allocates with the dtype *string* ``"uint16"``, which Paddle treats as
  bfloat16); ``prepare_pending_save(num_tokens, slot_mapping, position_ids)`` (TP rank 0)
  queues ONE asynchronous copy of the step's rows, the device counters and the slot mapping
  into page-locked staging; ``flush_pending_save()`` waits for it and scatters by KV slot
  into the engine's shared slot cache with one bound call.  Invalid KV slots are counted and
  skipped, a layer that recorded nothing marks the step lost; ``token_num_overlap``
  (overlap scheduling), ``clear()`` (RL round cleanup).
* **Engine** (:class:`EngineRouting`, wrapped for FastDeploy by
  :class:`~fd_routing_replay.integrations.fastdeploy.engine.EngineRoutingManager`): owns the
  shared slot cache; a finished request's rows go through its block table straight into the
  writer's ring (:mod:`fd_routing_replay.capture.handoff`), or, in ``response`` mode, become
  what the response carries (:class:`ResponseRoutes`: the encoded record, or a reference to
  it after handing it to the writer).  A prefill instance of a PD pair writes no record.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import paddle

from fd_routing_replay import ops
from fd_routing_replay.capture.device import StepBuffer, TableBinding, bind_table, unbind_table
from fd_routing_replay.capture.handoff import Handoff, records_pad_to
from fd_routing_replay.capture.slots import HostSlotCache
from fd_routing_replay.codec.reference import reference_for_header
from fd_routing_replay.codec.rr_v1 import decode_record, read_header
from fd_routing_replay.core.redact import redact_url
from fd_routing_replay.errors import ConfigError, InvalidRolloutId
from fd_routing_replay.keys import parse_request_id

__all__ = ["PAYLOAD", "REFERENCE", "EngineRouting", "ResponseRoutes", "StepRoutingCapturer", "as_bytes",
           "store_text"]


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
        # [tokens, layers, top_k]: row t is the step's token t (FastDeploy 2.6's layout).
        self.step = StepBuffer(max_tokens=self.max_batched_tokens, num_layers=self.num_moe_layers,
                               top_k=self.moe_top_k, num_experts=int(num_experts),
                               table_experts=int(num_experts) + int(num_shared_experts),
                               layer_rows=layer_rows, place=place, extra_itemsize=8)
        self.device_routing_buffer = self.step.buffer
        self.binding = TableBinding(num_experts=int(num_experts), step=self.step,
                                    on_error=self._on_hook_error, layer_rows=layer_rows)
        bind_table(self.device_routing_buffer, self.binding)
        self._attach_host = attach_host
        self.host_cache: HostSlotCache | None = None
        self._host_missing_logged = False
        self._publish_failed = False
        self._pending: tuple[int, bool] | None = None
        self._flush_args: tuple[Any, HostSlotCache] | None = None   # (the bound flush, its cache)
        self._mapping: tuple[Any, int, np.dtype] | None = None        # the slot mapping buffer, checked
        self._step_damaged = False
        self.counters: dict[str, float] = {
            "steps": 0, "tokens_offloaded": 0, "invalid_slots": 0, "damaged_steps": 0,
            "host_missing_steps": 0, "errors": 0, "offload_seconds": 0.0, "missing_layer_steps": 0,
        }

    # ------------------------------------------------------------------ FastDeploy API
    def get_device_routing_buffer(self) -> Any:
        """The step buffer the MoE layers write (``ForwardMeta.device_routing_buffer``)."""
        return self.device_routing_buffer

    def prepare_pending_save(self, num_tokens: int, slot_mapping_gpu: Any, position_ids_gpu: Any = None) -> None:
        """Queue this step's rows, counters and KV slots for the host: one asynchronous copy."""
        try:
            if self._pending is not None:      # the previous step was never flushed: do it now
                self.flush_pending_save()
            if self.overlap_schedule:
                num_tokens = self.token_num_overlap
            num_tokens = int(num_tokens)
            damaged, self._step_damaged = self._step_damaged, False
            if num_tokens <= 0:
                return
            if num_tokens > self.max_batched_tokens:
                raise ValueError(f"{num_tokens} tokens exceed the step buffer's {self.max_batched_tokens} rows")
            mapping = self._mapping
            if mapping is None or mapping[0] is not slot_mapping_gpu:
                # FastDeploy passes one persistent buffer: its dtype and length are checked once
                if slot_mapping_gpu.dtype not in (paddle.int64, paddle.int32):
                    raise ValueError(f"slot mapping must be int32 or int64, got {slot_mapping_gpu.dtype}")
                mapping = self._mapping = (slot_mapping_gpu, int(slot_mapping_gpu.shape[0]),
                                           np.dtype(np.int64 if slot_mapping_gpu.dtype == paddle.int64 else np.int32))
            if mapping[1] < num_tokens:
                raise ValueError(f"slot mapping has {mapping[1]} entries for {num_tokens} tokens")
            self.step.start_offload(num_tokens, slot_mapping_gpu, extra_dtype=mapping[2])
            self._pending = (num_tokens, damaged)
        except Exception as exc:  # never stop the engine step
            self._pending = None
            self.counters["errors"] += 1
            self.counters["damaged_steps"] += 1
            logger.error("routing replay: prepare_pending_save failed, this step's routing is lost "
                         "(counted): %r", exc)

    def flush_pending_save(self) -> None:
        """Wait for the queued copy and scatter the rows into the host slot cache by KV slot:
        one bound call (the library's ``StepFlush``)."""
        pending, self._pending = self._pending, None
        if pending is None:
            if self.tp_rank != 0 and self._host() is not None:
                # FastDeploy queues a save on TP rank 0 only (pre_and_post_process.py:342);
                # the other TP ranks still publish their hook counters to the engine.
                self._publish()
            return
        started = time.perf_counter()
        try:
            num_tokens, damaged = pending
            staged = self.step.wait_offload()
            host = self._host()
            if host is None:
                self.counters["host_missing_steps"] += 1
                return
            if staged is None:
                return
            written, invalid, missing, _ = self._flush_for(host).flush(num_tokens, staged[1].itemsize, damaged)
            counters = self.counters
            if missing:
                counters["missing_layer_steps"] += 1
                logger.error("routing replay: MoE layers %s recorded nothing this step; their rows of "
                             "this step's tokens are marked unknown (the other layers' rows are kept)",
                             np.flatnonzero(self.step.counter_delta[1:] == 0).tolist())
            if damaged or missing:
                counters["damaged_steps"] += 1
            if invalid:
                counters["invalid_slots"] += invalid
                logger.warning("routing replay: %d of %d tokens this step have no valid KV slot "
                               "(range [0, %d)); their routing is skipped", invalid, num_tokens, host.num_slots)
            if not (damaged or missing):
                counters["steps"] += 1
                counters["tokens_offloaded"] += written
        except Exception as exc:  # never stop the engine step
            self.counters["errors"] += 1
            logger.error("routing replay: flush_pending_save failed, this step's routing is lost "
                         "(counted): %r", exc)
        finally:
            self.counters["offload_seconds"] += time.perf_counter() - started
            self._publish()

    def _publish(self) -> None:
        """This worker's counters into its row of the shared segment, for the engine's
        metrics (the worker runs no writer and serves no metrics of its own)."""
        host = self.host_cache
        publish = getattr(host, "publish_values", None)
        if publish is None:
            return
        try:
            publish(self.tp_rank, self.stat_values())
        except Exception as exc:  # noqa: BLE001 - metrics must never cost a step
            if not self._publish_failed:
                self._publish_failed = True
                logger.warning("routing replay: TP rank %s cannot publish its capture counters "
                               "to the engine (%r); they stay in this worker's stats()",
                               self.tp_rank, exc)

    def clear(self) -> None:
        """RL round cleanup: forget the step buffer and anything queued."""
        if self._pending is not None:
            self.step.wait_offload()           # let the queued copy land before refilling
        self._pending = None
        self._step_damaged = False
        self.step.fill()

    # ------------------------------------------------------------------ lifecycle
    def flush(self, timeout: float | None = None) -> bool:
        """Nothing is written from the worker in this generation (the engine writes)."""
        return True

    def close(self, timeout: float | None = None) -> None:
        unbind_table(self.device_routing_buffer)
        host, self.host_cache = self.host_cache, None
        if host is not None and hasattr(host, "close"):
            host.close()

    def stat_values(self) -> tuple[float, ...]:
        """The :data:`~fd_routing_replay.capture.slots.STAT_FIELDS` of :meth:`stats`,
        in that order, read cheaply enough for every step: on the rank that offloads, the
        device counters as the last offload staged them (no device read)."""
        c, binding = self.counters, self.binding
        if self._flush_args is not None:
            seen = self.step.seen_counters
            calls, bad_ids = int(seen[1:].sum()), int(seen[0])
        else:
            calls, bad_ids = binding.calls, binding.bad_ids
        return (c["steps"], c["tokens_offloaded"], c["invalid_slots"], c["damaged_steps"],
                c["host_missing_steps"], c["errors"], c["offload_seconds"], calls, binding.seconds,
                binding.errors, binding.mismatches, bad_ids, c["missing_layer_steps"])

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters)
        out.update(hook_calls=self.binding.calls, hook_seconds=self.binding.seconds,
                   hook_errors=self.binding.errors, hook_mismatches=self.binding.mismatches,
                   bad_expert_ids=self.binding.bad_ids, dtype=self.routing_dtype.name,
                   capture_device_bytes=self.step.device_bytes, step_buffer_rows=self.step.max_tokens)
        return out

    # ------------------------------------------------------------------ internals
    def _flush_for(self, host: HostSlotCache) -> Any:
        """The library's flush bound to ``host`` (bound once per host cache)."""
        if self._flush_args is None or self._flush_args[1] is not host:
            step = self.step
            flush = ops.bind_step_flush(cache=host.array, staging=step.host_rows, extra=step.host_extra,
                                        host_counters=step.host_counters, seen=step.seen_counters,
                                        delta=step.counter_delta, columns=host.layer_columns)
            self._flush_args = (flush, host)
        return self._flush_args[0]

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


logger = logging.getLogger(__name__)


PAYLOAD = "payload"


REFERENCE = "reference"


def as_bytes(encoded: Any) -> bytes:
    """``encoded`` (an encoded record as bytes, or a uint8 array over them) as ``bytes``,
    without a copy when the array is a view of a whole ``bytes`` object.

    ``bytes`` is what survives every FastDeploy transport from the engine to the API
    server unchanged: msgpack packs it as binary, while an array becomes a list of ints
    (inter_communicator/zmq_server.py:34-47) that the OpenAI layer turns into int64
    (serving_chat.py:730-733), eight bytes for each byte of the record.
    """
    if isinstance(encoded, bytes):
        return encoded
    base = getattr(encoded, "base", None)
    if isinstance(base, bytes) and len(base) == getattr(encoded, "nbytes", -1):
        return base
    return np.ascontiguousarray(encoded, dtype=np.uint8).tobytes()


def store_text(store: Any) -> str:
    """Which store a config names, without secrets: its URL, else its type."""
    return redact_url(store.url) if getattr(store, "url", None) else str(store.type)


class ResponseRoutes:
    """Encoded records -> what the response carries (see the module docstring).

    ``config`` is the :class:`~fd_routing_replay.config.RoutingReplayConfig`; ``writer`` (a
    :class:`~fd_routing_replay.writer.RoutingWriter`) is where records go in reference
    mode.  :meth:`deliver` never raises.
    """

    def __init__(self, config: Any, writer: Any = None) -> None:
        self.mode = config.response.routes
        self.stream = bool(config.response.stream)
        if self.mode not in (PAYLOAD, REFERENCE):
            raise ValueError(f"response.routes must be {PAYLOAD!r} or {REFERENCE!r}, got {self.mode!r}")
        if self.mode == REFERENCE and writer is None:
            raise ValueError("response.routes 'reference' needs a writer to store the records with")
        self.writer = writer if self.mode == REFERENCE else None
        self.namespace = config.store.namespace
        self.store = store_text(config.store)
        self._lock = threading.Lock()
        self.counters = {"references_returned": 0, "references_failed": 0}

    def deliver(self, encoded: Any) -> bytes | None:
        """The bytes the response carries for this encoded record (None for None).

        In reference mode the record is handed to the writer first; when that fails (or the
        writer drops it: ``submit_put`` returns False) the failure is counted and logged with the
        rollout id, and None is returned: the response then carries no routes rather than a
        reference to nothing.
        """
        if encoded is None:
            return None
        data = as_bytes(encoded)
        if self.mode == PAYLOAD:
            return data
        rollout_id = "?"
        try:
            header = read_header(data)
            rollout_id = header.rollout_id
            reference = reference_for_header(header, namespace=self.namespace, store=self.store)
            if not self.writer.submit_put(header.rollout_id, decode_record(data, verify=False)):
                raise RuntimeError("the background writer dropped it (writer.full_policy)")
        except Exception as exc:
            self._count("references_failed")
            logger.error("routing replay: the record of rollout %s could not be handed to the store, "
                         "its response carries no routes: %r", rollout_id, exc)
            return None
        self._count("references_returned")
        return reference.to_json().encode("ascii")

    @staticmethod
    def stream_text(data: bytes) -> str:
        """``data`` as the base64 text a stream chunk carries (what ``routed_experts`` is)."""
        return base64.b64encode(data).decode("ascii")

    def _count(self, name: str) -> None:
        with self._lock:
            self.counters[name] += 1


class EngineRouting:
    """FastDeploy 2.6's engine side, free of FastDeploy (see the module docstring).

    ``cache`` is the slot cache the workers scatter into (the engine's
    :class:`~fd_routing_replay.capture.slots.SharedSlotCache`); ``writer`` the background
    :class:`~fd_routing_replay.writer.RoutingWriter` records go to (None only in ``response``
    mode with records in the body); ``owns_writer``: :meth:`close` closes it.  ``response``:
    FastDeploy's ``routing_store_type: response``.  ``writes_records`` False: a prefill
    instance of a PD pair (FastDeploy hands the prompt's rows to the decode instance, which
    writes the record).  ``metadata`` goes into every record.
    """

    def __init__(self, config: Any, geometry: Any, cache: HostSlotCache, *, writer: Any = None,
                 owns_writer: bool = False, response: bool = False, writes_records: bool = True,
                 metadata: dict[str, Any] | None = None, num_decoder_layers: int | None = None) -> None:
        capture = config.capture
        if response and capture.partial_every_tokens:
            raise ConfigError(f"capture.partial_every_tokens ({capture.partial_every_tokens}) stores partial "
                              "records through the writer; routing_store_type 'response' returns records in "
                              "the response: use routing_store_type local or rdma, or "
                              "capture.partial_every_tokens: 0")
        if writer is None and writes_records and not (response and config.response.routes == PAYLOAD):
            raise ConfigError("the engine side needs a writer to store records (only response mode with "
                              "response.routes: payload, and a PD prefill instance, store none)")
        self.cache = cache
        self.block_size = int(geometry.block_size)
        self.writer = writer
        self.writes_records = bool(writes_records)
        self._owns_writer = owns_writer
        self.counters: dict[str, Any] = {"invalid_request_ids": 0}
        # response mode: the hand-off builds the encoded record, ResponseRoutes decides what
        # the response carries (and, for a reference, hands the record to the writer)
        self.routes = ResponseRoutes(config, writer) if response else None
        self.handoff = Handoff(
            cache, None if response else writer, num_experts=geometry.num_experts,
            layer_map=geometry.layers, record_format=capture.record_format,
            fused=capture.fused or response,
            pad_to=0 if response else records_pad_to(config, geometry.max_model_len),
            metadata=metadata, num_decoder_layers=num_decoder_layers,
            weights_version=capture.weights_version or None, prefix_omission=capture.prefix_omission,
            partial_every_tokens=capture.partial_every_tokens if writes_records else 0,
            counters=self.counters)

    def finish(self, request_id: str, block_table: Any, num_tokens: int,
               token_ids: Any = None) -> bytes | None:
        """A finished request's ``num_tokens`` forwarded positions: handed to the writer, or
        (``response`` mode) what the response carries -- the encoded record or a reference to
        it.  ``token_ids`` (prompt + output) put the hash of the forwarded ones in the record's
        provenance.  Never raises: a request whose routing cannot be handed over is counted
        and logged."""
        if not self.writes_records:
            return None
        rollout_id = self._rollout_id(request_id)
        self.handoff.forget(request_id)
        if rollout_id is None:
            return None
        if self.routes is None:
            self.handoff.finish(rollout_id, request_id, block_table, num_tokens, self.block_size, token_ids)
            return None
        return self.routes.deliver(self.handoff.encoded(rollout_id, request_id, block_table, num_tokens,
                                                        self.block_size, token_ids))

    def progress(self, request_id: str, block_table: Any, num_tokens: int, token_ids: Any = None) -> bool:
        """A running request has forwarded ``num_tokens`` positions (their rows are in the slot
        cache): its partial record when one is due (``capture.partial_every_tokens``).  The
        length test costs O(1).  True when a partial was handed over; never raises."""
        if not self.handoff.due(request_id, num_tokens):
            return False
        return self.handoff.partial(self._rollout_id(request_id, count=False), request_id, block_table,
                                    num_tokens, self.block_size, token_ids)

    def reset(self) -> None:
        """RL round cleanup: forget every cached row and every running request."""
        self.cache.clear()
        self.handoff.clear()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every record handed over is durable; False on timeout."""
        return True if self.writer is None else bool(self.writer.flush(timeout))

    def close(self, timeout: float | None = None) -> None:
        """Flush and close the writer when this object owns it."""
        writer, self.writer = self.writer, None
        if writer is not None and self._owns_writer:
            writer.close(timeout)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters)
        if self.routes is not None:      # a reference the writer did not take was not returned
            failed = self.routes.counters["references_failed"]
            out.update(self.routes.counters)
            out["records_returned"] = out.get("records_returned", 0) - failed
            out["records_failed"] = out.get("records_failed", 0) + failed
        return out

    def _rollout_id(self, request_id: str, *, count: bool = True) -> str | None:
        try:
            return parse_request_id(request_id).text
        except InvalidRolloutId as exc:
            if count:
                self.counters["invalid_request_ids"] += 1
                logger.error("routing replay: request %r carries no valid rollout id, its routing will "
                             "not be stored: %s", request_id, exc)
            return None
