"""FastDeploy 2.6's engine side: finished requests become our records.

In FastDeploy 2.6 the worker only scatters each step's routing into a host buffer by KV
slot; the engine process assembles a finished request through its block table and
either stores it (``routing_store_type`` local / rdma, through FastDeploy's
``StoreWrapper``) or attaches it to the response (``response``).  The engine builds its
``RoutingCacheManager`` in ``EngineService._init_routing_cache_manager``
(engine/common_engine.py:2421-2434, importing the class at call time) and the token
processor calls ``_finalize_routing`` for every finished request before its blocks are
freed (output/token_processor.py:594-632).

We take over both, from the ``fastdeploy.token_processor_plugins`` entry point:

* :class:`EngineRoutingManager` replaces ``RoutingCacheManager``: it owns our shared
  slot cache (the worker's :class:`~fd_routing_replay.capture.fd26.StepRoutingCapturer`
  writes it) and hands each finished request's rows, gathered through its block table
  straight into our background writer's ring, to the writer
  (:class:`~fd_routing_replay.capture.fd26.EngineRouting`, where the logic lives).
  FastDeploy's ``StoreWrapper`` is never started, so FastDeploy's store-wide wipe at
  start-up (cache_manager/routing_store.py:234-235) never runs.
* the token processor subclass computes the record's length by our token convention
  (every forwarded position: prompt + generated − 1; FastDeploy keeps one unforwarded
  row when a request stops on length) and, in ``response`` mode, attaches as
  ``routing_data`` what :class:`~fd_routing_replay.capture.fd26.ResponseRoutes` makes of
  our encoded record: the record itself, or (``response.routes: reference``) a JSON
  reference to it after handing it to our background writer.  It is ``bytes``, which every
  FastDeploy transport to the API server keeps intact; FastDeploy's OpenAI layer sends it
  base64-encoded as ``routed_experts`` (entrypoints/openai/serving_chat.py:725-733), so a
  client gets a validated, self-describing ``rr-v1`` record or a reference it resolves
  (:func:`fd_routing_replay.reader.references.routes_from_response`).  With
  ``response.stream`` the same text also goes into the output's metrics, which reach the
  last chunk of a streaming response (:mod:`fd_routing_replay.integrations.fastdeploy.stream`).
  A prefill instance's finish (``is_prefill``) is FastDeploy's own: it gathers the prompt's
  rows for the decode instance (PD disaggregation), and no record is written there.

With ``capture.partial_every_tokens`` the token processor subclass also reports each
running request's progress: FastDeploy calls ``_record_metrics(task, current_time,
token_ids)`` for every output it processes, in both output paths, before it appends the
new tokens (token_processor.py:295 in ``_process_per_token``, :1044 in
``_process_batch_output``), with the task's block table current; the rows of every
position forwarded so far are in the slot cache by then (FastDeploy hands a step's outputs
to the engine after the worker's flush).  :func:`report_progress` stores a partial record
when one is due (:mod:`fd_routing_replay.capture.handoff`).  A prefill instance of a PD
pair writes none (it writes no record), and ``response`` mode refuses them.

The slot cache carries FastDeploy's own buffer name whenever FastDeploy's views read it as
we write it (:func:`_slots_layout`), so FastDeploy's own code moves routing rows with the KV
blocks: to the decode instance, to and from the CPU KV cache, to and from a KV storage tier.
"""

from __future__ import annotations

import logging
from typing import Any

from fd_routing_replay.capture.fd26 import PAYLOAD, EngineRouting
from fd_routing_replay.capture.slots import SharedSlotCache, shared_slots_name
from fd_routing_replay.integrations.fastdeploy import setup as fd_setup

__all__ = ["EngineRoutingManager", "attach_shared_slots", "forwarded_tokens", "install_engine_side",
           "report_progress"]

logger = logging.getLogger(__name__)


#: FastDeploy 2.6's name for its routing host buffer (routing_cache_manager.py:46), plus the port.
FASTDEPLOY_HOST_BUFFER = "routing_host_buffer."


def _slots_layout(fd_config: Any, geometry: Any) -> tuple[str, tuple[int, int, int], tuple[int, ...] | None]:
    """The engine's slot cache: (shared-memory name, array shape, row of each of our layers).

    FastDeploy's own ``routing_host_buffer.<port>`` in FastDeploy's layout whenever
    FastDeploy's views of that buffer can read it (``fd_setup.fastdeploy_view_columns``), so
    FastDeploy's own code moves routing rows with the KV blocks -- prompt rows from a
    prefill instance to a decode instance (token_processor.py:606-612,
    resource_manager_v1.py:1594-1624), blocks swapped to and from the CPU
    (cache_transfer_manager.py:404-430, :1679-1681, :1722-1724) and a KV storage tier
    (:436-512).  Otherwise a name of our own in our layout, which FastDeploy never attaches
    to (and the features that need it are refused by ``check_supported``).
    """
    # One engine (and its workers) per DP rank share FastDeploy's per-rank worker-queue port,
    # which FastDeploy also keys its own routing buffer by (token_processor.py:163).
    port = fd_config.parallel_config.local_engine_worker_queue_port
    private = shared_slots_name(port)          # validates the suffix
    slots = geometry.total_block_num * geometry.block_size
    view = fd_setup.fastdeploy_view_columns(fd_config)
    if view is None:
        return private, (slots, geometry.num_moe_layers, geometry.top_k), None
    rows, columns = view
    return FASTDEPLOY_HOST_BUFFER + str(port), (slots, rows, geometry.top_k), columns


def _stat_ranks(fd_config: Any) -> int:
    # one counters row per worker of this engine (its TP ranks)
    return max(int(getattr(fd_config.parallel_config, "tensor_parallel_size", 1) or 1), 1)


def attach_shared_slots(fd_config: Any, geometry: Any) -> SharedSlotCache:
    """The worker's view of the engine's shared slot cache (FileNotFoundError until it exists)."""
    from fd_routing_replay import ops

    name, shape, columns = _slots_layout(fd_config, geometry)
    return SharedSlotCache(name, *shape, geometry.dtype, ops.fill_value(geometry.dtype), create=False,
                           stat_ranks=_stat_ranks(fd_config), layer_columns=columns)


def task_token_ids(task: Any) -> list[int] | None:
    """Prompt + output token ids of a finished FastDeploy request (None when absent):
    ``Request.prompt_token_ids`` and ``output_token_ids`` (engine/request.py:137, 176 in 2.6)."""
    prompt = getattr(task, "prompt_token_ids", None)
    if prompt is None:
        return None
    return list(prompt) + list(getattr(task, "output_token_ids", None) or ())


def forwarded_tokens(task: Any) -> int:
    """Positions of a finished request that went through the forward pass.

    Every prompt token and every generated token but the last (the last sampled token,
    EOS or not, is never fed back).
    """
    prompt = int(getattr(task, "prompt_token_ids_len", 0) or 0)
    output = len(getattr(task, "output_token_ids", None) or ())
    return max(prompt + output - 1, 0)


def report_progress(routing: EngineRouting, task: Any, new_tokens: Any = ()) -> bool:
    """A running request's output reached the token processor: ``task`` is FastDeploy's
    ``Request`` before ``new_tokens`` are appended to its ``output_token_ids``.  Hands its
    partial record over when one is due (:meth:`EngineRouting.progress
    <fd_routing_replay.capture.fd26.EngineRouting.progress>`).  The length test costs O(1);
    the token ids are copied only for a partial that is written."""
    if any(int(token) < 0 for token in new_tokens):   # stop / preempt signals
        return False
    num_tokens = forwarded_tokens(task) + len(new_tokens)
    if not routing.handoff.due(task.request_id, num_tokens):
        return False
    tokens = task_token_ids(task)
    if tokens is not None:
        tokens += [int(token) for token in new_tokens]
    return routing.progress(task.request_id, task.block_tables, num_tokens, tokens)


class EngineRoutingManager:
    """FastDeploy 2.6's ``RoutingCacheManager``, ours: same constructor and methods, over our
    shared slot cache, :class:`~fd_routing_replay.capture.fd26.EngineRouting` and its writer."""

    fdrr_manager = True

    def __init__(self, fd_config: Any, num_gpu_blocks: int) -> None:
        from fd_routing_replay import ops
        from fd_routing_replay.integrations.fastdeploy.api import STEP_BUFFER

        fd_setup.check_supported(fd_config, generation=STEP_BUFFER)
        self.config = config = fd_setup.config_from_fastdeploy_config(fd_config)
        self.geometry = geometry = fd_setup.geometry_from_fastdeploy_config(fd_config, num_gpu_blocks)
        self.return_mode = fd_setup.return_mode(fd_config)
        response = self.return_mode == fd_setup.RESPONSE_MODE
        name, shape, columns = _slots_layout(fd_config, geometry)
        self.host = SharedSlotCache(name, *shape, geometry.dtype, ops.fill_value(geometry.dtype), create=True,
                                    stat_ranks=_stat_ranks(fd_config), layer_columns=columns)
        self._dp_rank = fd_setup.engine_rank_identity(fd_config).dp_rank
        metadata: dict[str, Any] = {"engine": "fastdeploy", **fd_setup.record_metadata(fd_config)}
        verification = fd_setup.verification_code(fd_config, config)    # capture.verify
        if verification is not None:
            metadata["verification"] = verification.marker()
        writer = None
        try:
            if not response or config.response.routes != PAYLOAD:
                from fd_routing_replay.writer import RoutingWriter

                writer = RoutingWriter.from_config(config, identity=fd_setup.engine_rank_identity(fd_config))
            self.routing = EngineRouting(
                config, geometry, self.host, writer=writer, owns_writer=True, response=response,
                writes_records=getattr(fd_config.scheduler_config, "splitwise_role", "") != "prefill",
                metadata=metadata, num_decoder_layers=int(fd_config.model_config.num_hidden_layers))
        except BaseException:
            if writer is not None:
                writer.close()
            self.host.close()
            raise
        if writer is not None:
            from fd_routing_replay.capture import render_capture

            writer.export_metrics(self.stats, render_capture)
        routes = self.routing.routes
        mode = self.return_mode if routes is None else \
            f"{self.return_mode} mode, routes as {routes.mode}{', streamed too' if routes.stream else ''}"
        logger.info("fd-routing-replay: engine-side routing assembly ready (%s mode, slot cache %s, "
                    "%d slots x %d layers x top-%d %s)", mode, self.host.name,
                    *shape, geometry.dtype.name)

    # ---------------------------------------------------------------- FastDeploy's interface
    def on_request_finished(self, request_id: str, block_table: Any, seq_len: int) -> bytes | None:
        """FastDeploy's call (token_processor.py:627): assemble ``seq_len`` positions."""
        return self.routing.finish(request_id, block_table, seq_len)

    def reset(self) -> None:
        """RL round cleanup: forget every cached row."""
        self.routing.reset()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every finished request's record is durable in the store; False on timeout."""
        return self.routing.flush(timeout)

    def close(self) -> None:
        """Flush and close the writer, then release the shared slot cache."""
        self.routing.close()
        self.host.close()

    def stats(self) -> dict[str, Any]:
        """This engine's counters; ``ranks``: each worker's published capture counters
        (hook errors, bad expert ids, ...) by ``dp{N}-tp{M}``."""
        out = self.routing.stats()
        out["ranks"] = {f"dp{self._dp_rank}-tp{rank}": values
                        for rank, values in self.host.rank_stats().items()}
        return out


def install_engine_side(token_processor_cls: type) -> type:
    """Swap FastDeploy's ``RoutingCacheManager`` for ours; return the token processor subclass."""
    import fastdeploy.cache_manager.routing_cache_manager as routing_cache_manager

    routing_cache_manager.RoutingCacheManager = EngineRoutingManager

    class RoutingReplayTokenProcessor(token_processor_cls):  # type: ignore[misc, valid-type]
        """FastDeploy's token processor; finished requests' routing goes to fd-routing-replay."""

        def _finalize_routing(self, task_id: str, task: Any, result: Any, is_prefill: bool = False) -> None:
            manager = getattr(self, "routing_cache_manager", None)
            if (is_prefill or result is None or not getattr(result, "finished", False)
                    or not isinstance(manager, EngineRoutingManager)):
                return super()._finalize_routing(task_id, task, result, is_prefill)
            try:
                routing = manager.routing
                data = routing.finish(task_id, task.block_tables, forwarded_tokens(task),
                                      token_ids=task_token_ids(task))
                if data is not None:
                    result.routing_data = data
                    if routing.routes is not None and routing.routes.stream:
                        from fd_routing_replay.integrations.fastdeploy.stream import with_routes

                        result.metrics = with_routes(getattr(result, "metrics", None),
                                                     routing.routes.stream_text(data))
            except Exception as exc:  # never break the engine's output loop
                logger.error("routing replay: finalizing the routing of %s failed: %r", task_id, exc)
            return None

    if hasattr(token_processor_cls, "_record_metrics"):
        def _record_metrics(self: Any, task: Any, current_time: Any, token_ids: Any) -> None:
            """FastDeploy's per-output metrics, then our partial record when one is due."""
            super(RoutingReplayTokenProcessor, self)._record_metrics(task, current_time, token_ids)
            manager = getattr(self, "routing_cache_manager", None)
            if isinstance(manager, EngineRoutingManager) and manager.routing.handoff.partial_every:
                try:
                    report_progress(manager.routing, task, token_ids)
                except Exception as exc:  # never break the engine's output loop
                    logger.error("routing replay: the partial record of %s failed: %r",
                                 getattr(task, "request_id", "?"), exc)

        RoutingReplayTokenProcessor._record_metrics = _record_metrics

    RoutingReplayTokenProcessor.__qualname__ = f"RoutingReplay{token_processor_cls.__name__}"
    return RoutingReplayTokenProcessor
