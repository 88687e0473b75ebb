"""The engine process's side of FastDeploy 2.6's routing replay, in the harness.

In FastDeploy 2.6 the worker's capturer scatters each step's rows into a host buffer by
KV slot (:class:`~fd_routing_replay.capture.fd26.StepRoutingCapturer`, driven by
:class:`~fdrr_dev.harness.runner.HarnessRunner` with ``generation="step"``); the engine
process reads that buffer through a request's block table.  :class:`SlotRouting` plays the
plugin's token processor around the production
:class:`~fd_routing_replay.capture.fd26.EngineRouting`:

* a finished request: the token processor's ``_finalize_routing`` runs before
  ``_recycle_resources`` frees the blocks (output/token_processor.py:340, :1158; the method
  at :592-632); the plugin's hands the request to ``EngineRouting.finish`` with the length
  and token ids it computes (``integrations.fastdeploy.engine.forwarded_tokens``: prompt +
  generated − 1, and ``task_token_ids`` for provenance and prefix omission);
* PD disaggregation: the prefill instance gathers the prompt's rows by its block table
  (``_finalize_routing(is_prefill=True)``, token_processor.py:608-614 with the gather at
  :177-202) and the decode instance scatters them into its own buffer by *its* block table
  (engine/sched/resource_manager_v1.py:1594-1604, the scatter at :1608-1624) —
  :meth:`SlotRouting.gather_prompt` / :meth:`SlotRouting.scatter_prompt`;
* an RL weight update forgets every row (``EngineRoutingManager.reset``);
* partial records: each output of a running request reaches the token processor's
  ``_record_metrics``, where the plugin reports the request's progress
  (``integrations.fastdeploy.engine.report_progress``) — :meth:`SlotRouting.progress`.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from fd_routing_replay.capture.fd26 import EngineRouting
from fd_routing_replay.capture.slots import request_slots
from fd_routing_replay.integrations.fastdeploy.engine import (
    forwarded_tokens,
    report_progress,
    task_token_ids,
)
from fd_routing_replay.keys import parse_rollout_id

__all__ = ["SlotRouting"]


class SlotRouting:
    """One engine's production :class:`EngineRouting`, and the row moves FastDeploy makes.

    ``wait_durable``: with prefix omission, turn t waits until turn t−1's record is durable
    before handing over (the harness's stand-in for the tool call between turns).
    """

    def __init__(self, routing: EngineRouting, *, wait_durable: bool = True) -> None:
        self.routing = routing
        self.host = routing.cache
        self.block_size = routing.block_size
        self.wait_durable = wait_durable
        self.counters = routing.counters

    # ------------------------------------------------------------------ finished requests
    def finish(self, engine: Any, request: Any) -> None:
        """``_finalize_routing`` of a finished request (blocks still held)."""
        if self.routing.handoff.prefix_omission and self.wait_durable \
                and parse_rollout_id(request.rollout_id).turn > 0:
            # turn t−1's record is durable before turn t hands over (writer.durable_prefix
            # semantics), so which turns omit their prefix does not depend on the writer's timing
            self.routing.flush(60.0)
        # the length and token ids the plugin's token processor takes from FastDeploy's
        # Request (prompt_token_ids, prompt_token_ids_len, output_token_ids)
        task = SimpleNamespace(prompt_token_ids=request.prompt, prompt_token_ids_len=len(request.prompt),
                               output_token_ids=request.outputs)
        self.routing.finish(request.request_id, request.blocks, forwarded_tokens(task),
                            token_ids=task_token_ids(task))

    def progress(self, engine: Any, request: Any, new_tokens: Any) -> None:
        """``_record_metrics`` of a running request's output: ``request`` before its
        ``new_tokens`` are appended (the rows they were sampled from are in the cache)."""
        if not self.routing.handoff.partial_every:
            return
        task = SimpleNamespace(request_id=request.request_id, prompt_token_ids=request.prompt,
                               prompt_token_ids_len=len(request.prompt), output_token_ids=request.outputs,
                               block_tables=request.blocks)
        if self.routing.handoff.due(request.request_id, forwarded_tokens(task) + len(new_tokens)) \
                and engine.config.overlap_schedule:
            engine.runner.sync_routing()      # FastDeploy hands over outputs after the flush
        report_progress(self.routing, task, new_tokens)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every record handed over is durable."""
        return self.routing.flush(timeout)

    def reset(self) -> None:
        """RL weight update: every cached row is stale."""
        self.routing.reset()

    # ------------------------------------------------------------------ PD disaggregation
    def slots(self, block_table: Any, num_tokens: int) -> np.ndarray:
        """KV slot of positions ``0 .. num_tokens-1`` through ``block_table``."""
        return request_slots(np.asarray(block_table, dtype=np.int64), num_tokens, self.block_size)

    def gather_prompt(self, block_table: Any, prompt_len: int) -> np.ndarray:
        """P side: the prompt's rows ``[prompt_len, L, K]`` by P's block table
        (token_processor.py:177-202, called with ``prompt_token_ids_len`` at :608-614)."""
        return self.host.read(self.slots(block_table, prompt_len))

    def scatter_prompt(self, block_table: Any, rows: np.ndarray) -> None:
        """D side: P's rows into this buffer by D's block table (resource_manager_v1.py:1608-1624)."""
        self.host.write(self.slots(block_table, int(rows.shape[0])), rows)
