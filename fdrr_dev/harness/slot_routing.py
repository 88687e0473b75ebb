"""The engine process's side of FastDeploy 2.6's routing replay, in the harness.

In FastDeploy 2.6 the worker's capturer scatters each step's rows into a host buffer by
KV slot (:class:`~fd_routing_replay.capture.step_capture.StepRoutingCapturer`, driven by
:class:`~fdrr_dev.harness.runner.HarnessRunner` with ``generation="step"``); the
engine process reads that buffer through a request's block table:

* a finished request: the token processor's ``_finalize_routing`` runs before
  ``_recycle_resources`` frees the blocks (output/token_processor.py:340, :1158; the
  method at :592-632); ours hands the request to
  :class:`~fd_routing_replay.capture.finisher.SlotRecordFinisher` with the length and
  token ids the plugin's token processor computes (``integrations.fd_engine.forwarded_tokens``:
  prompt + generated − 1, and ``task_token_ids`` for provenance and prefix omission);
* PD disaggregation: the prefill instance gathers the prompt's rows by its block table
  (``_finalize_routing(is_prefill=True)``, token_processor.py:608-614 with the gather at
  :177-202) and the decode instance scatters them into its own buffer by *its* block table
  (engine/sched/resource_manager_v1.py:1594-1604, the scatter at :1608-1624) —
  :meth:`SlotRouting.gather_prompt` / :meth:`SlotRouting.scatter_prompt`;
* an RL weight update forgets every row (``EngineRoutingAssembler.reset``);
* partial records (``partial_every_tokens``): each output of a running request reaches the
  token processor's ``_record_metrics``, where the plugin reports the request's progress
  (``integrations.fd_engine.report_progress``) — :meth:`SlotRouting.progress`.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from fd_routing_replay.capture.assembly import RecordAssembler
from fd_routing_replay.capture.finisher import SlotRecordFinisher
from fd_routing_replay.capture.host_cache import HostSlotCache
from fd_routing_replay.capture.positions import request_slots
from fd_routing_replay.codec.provenance import Provenance
from fd_routing_replay.integrations.fastdeploy.engine import (
    forwarded_tokens,
    report_progress,
    task_token_ids,
)
from fd_routing_replay.keys import parse_rollout_id

__all__ = ["SlotRouting"]


class SlotRouting:
    """One engine's host slot cache, its finisher, and the row moves FastDeploy makes."""

    def __init__(self, host: HostSlotCache, *, num_experts: int, block_size: int, sink: Any,
                 fused: bool = True, pad_to: int | None = None, prefix_omission: bool = False,
                 wait_durable: bool = True, num_decoder_layers: int | None = None,
                 layer_map: tuple[int, ...] | None = None, partial_every_tokens: int = 0) -> None:
        self.host = host
        self.block_size = int(block_size)
        self.sink = sink
        self.assembler = RecordAssembler(host, num_experts=num_experts, fused=fused, pad_to=pad_to,
                                         metadata={"engine": "harness"}, layer_map=layer_map)
        self.finisher = SlotRecordFinisher(
            self.assembler, sink, block_size=block_size,
            provenance=Provenance(num_decoder_layers=num_decoder_layers),
            prefix_omission=prefix_omission, partial_every_tokens=partial_every_tokens)
        self.wait_durable = wait_durable
        self.counters = self.finisher.counters

    # ------------------------------------------------------------------ finished requests
    def finish(self, engine: Any, request: Any) -> None:
        """``_finalize_routing`` of a finished request (blocks still held)."""
        if self.finisher.prefix_omission and self.wait_durable \
                and parse_rollout_id(request.rollout_id).turn > 0:
            # The harness's stand-in for the tool call between turns: turn t−1's record is
            # durable before turn t hands over (writer.durable_prefix semantics), so which
            # turns omit their prefix does not depend on the writer thread's timing.
            self.finisher.flush(60.0)
        # the length and token ids the plugin's token processor takes from FastDeploy's
        # Request (prompt_token_ids, prompt_token_ids_len, output_token_ids)
        task = SimpleNamespace(prompt_token_ids=request.prompt, prompt_token_ids_len=len(request.prompt),
                               output_token_ids=request.outputs)
        self.finisher.finish(request.request_id, request.blocks, forwarded_tokens(task),
                             token_ids=task_token_ids(task))

    def progress(self, engine: Any, request: Any, new_tokens: Any) -> None:
        """``_record_metrics`` of a running request's output: ``request`` before its
        ``new_tokens`` are appended (the rows they were sampled from are in the cache)."""
        if self.finisher.partials is None:
            return
        task = SimpleNamespace(request_id=request.request_id, prompt_token_ids=request.prompt,
                               prompt_token_ids_len=len(request.prompt), output_token_ids=request.outputs,
                               block_tables=request.blocks)
        if self.finisher.partials.due(request.request_id, forwarded_tokens(task) + len(new_tokens)) \
                and engine.config.overlap_schedule:
            engine.runner.sync_routing()      # FastDeploy hands over outputs after the flush
        report_progress(self.finisher, task, new_tokens)

    def wait_finished(self, timeout: float | None = None) -> bool:
        """Wait until every finished request's records reached the sink."""
        return self.finisher.wait_finished(timeout)

    def reset(self) -> None:
        """RL weight update: every cached row is stale."""
        self.host.clear()

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
