"""A continuous-batching engine loop around the tiny MoE model.

It schedules the way FastDeploy's V1 KV-cache scheduler does, at toy scale: running
requests first (decode, or the next chunk of a chunked prefill), then waiting ones
while slots, blocks and the token budget allow; new requests reuse cached prefix blocks;
when blocks run out the most recently admitted running request is preempted (its blocks
freed) and later recomputed from ``prompt + outputs``; aborts and RL weight updates clear
slots.  Each step becomes ``insert_tasks_v1`` + ``execute_model`` on the
:class:`~fdrr_dev.harness.runner.HarnessRunner`, which drives the routing
replay manager in FastDeploy's order.

The engine keeps its own bookkeeping (tokens, positions, blocks) independent of the
manager's, so the fidelity check can hold the records up against it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from fdrr_dev.harness.cpu_cache import CacheTransfer
from fdrr_dev.harness.kv import BlockManager
from fdrr_dev.harness.model import TinyMoEModel
from fdrr_dev.harness.runner import HarnessRunner, SlotStep, Task, TaskKind


class RequestState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class GenerationRequest:
    """One chat completion as the engine sees it."""

    request_id: str
    rollout_id: str
    prompt: list[int]
    max_tokens: int
    seed: int
    outputs: list[int] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    idx: int | None = None
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    prefill_done: bool = False
    finish_reason: str | None = None
    preemptions: int = 0
    cached_tokens: int = 0
    chunks: int = 0
    abort_requested: bool = False
    weights_version: int = 0
    sent_blocks: int = 0
    tag: Any = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs

    @property
    def forwarded_tokens(self) -> list[int]:
        """Every position that went through the forward pass: all but the last output."""
        return self.tokens[:-1]


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler limits; the defaults make chunking, sharing and preemption all happen."""

    max_num_seqs: int = 16
    block_size: int = 8
    num_blocks: int = 96
    max_num_batched_tokens: int = 48
    enable_prefix_caching: bool = True
    num_speculative_tokens: int = 0
    temperature: float = 0.7
    eos_bias: float = 1.0
    tp_size: int = 1
    ep_size: int = 1
    generation: str = "table"         # "step": FastDeploy 2.6's capturer + engine-side finish
    num_cpu_blocks: int = 0           # CPU tier of the prefix cache (evicted blocks swap there)
    cpu_swap_routing: bool = True     # False: a swap moves the KV only (negative tests)
    overlap_schedule: bool = False    # step generation: FastDeploy 2.6's execute_model_overlap


def propose_drafts(tokens: Sequence[int], count: int, ngram: int = 2) -> list[int]:
    """N-gram (prompt-lookup) drafts: continue the latest earlier match of the last n tokens."""
    tail = list(tokens[-ngram:])
    for start in range(len(tokens) - ngram - 1, -1, -1):
        if list(tokens[start:start + ngram]) == tail:
            follow = list(tokens[start + ngram:start + ngram + count])
            return (follow + [tokens[-1]] * count)[:count]
    return [tokens[-1]] * count


class Engine:
    """Continuous batching over a :class:`HarnessRunner` (see module docstring)."""

    def __init__(self, model: TinyMoEModel, managers: Sequence[Any] | Callable[[dict[str, Any]], Sequence[Any]],
                 config: EngineConfig, *, routing: Any = None, process_rank: Any = None) -> None:
        """``routing``: the engine-side routing of the step generation
        (:class:`~fdrr_dev.harness.slot_routing.SlotRouting` or a wrapper): its
        ``finish(engine, request)`` runs for each finished request before its blocks are
        freed, ``reset()`` at an RL weight update.  ``process_rank``: this engine is one
        real TP rank (:class:`~fdrr_dev.harness.parallel.ProcessRank`)."""
        self.config = config
        self.model = model
        self.routing = routing
        self.blocks = BlockManager(config.num_blocks, config.block_size,
                                   enable_prefix_caching=config.enable_prefix_caching,
                                   num_cpu_blocks=config.num_cpu_blocks)
        self.runner = HarnessRunner(
            model, max_num_seqs=config.max_num_seqs, block_size=config.block_size,
            num_blocks=config.num_blocks, managers=managers, tp_size=config.tp_size,
            ep_size=config.ep_size, num_speculative_tokens=config.num_speculative_tokens,
            temperature=config.temperature, eos_bias=config.eos_bias,
            generation=config.generation, overlap_schedule=config.overlap_schedule,
            process_rank=process_rank)
        if config.num_cpu_blocks:
            self.blocks.swapper = CacheTransfer(
                self.runner, self._routing_host, num_cpu_blocks=config.num_cpu_blocks,
                block_size=config.block_size, swap_routing=config.cpu_swap_routing)
        self.waiting: deque[GenerationRequest] = deque()
        self.running: list[GenerationRequest] = []
        self.free_slots = list(range(config.max_num_seqs))
        self.by_id: dict[str, GenerationRequest] = {}
        self._admitted: list[Task] = []                 # prefilled elsewhere (PD decode)
        self._completed: list[GenerationRequest] = []
        self.steps = 0
        self.step_seconds = 0.0          # time inside insert_tasks_v1 + execute_model
        self.preemptions = 0
        self.forwarded = 0

    def _routing_host(self) -> Any:
        """The host slot cache routing rows live in: the engine's (step generation) or
        TP rank 0's manager's (table generation)."""
        if self.routing is not None:
            return self.routing.host
        return getattr(self.runner.managers[0], "host_cache", None)

    # ------------------------------------------------------------------ public API
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._completed)

    def flush(self, timeout: float | None = 60.0) -> bool:
        """Wait until the records of every request finished so far are durable in the store."""
        done = True
        for part in [*self.runner.managers, self.routing]:
            flush = getattr(part, "flush", None)
            if flush is not None:
                done = bool(flush(timeout)) and done
        return done

    def add_request(self, request: GenerationRequest) -> None:
        limit = self.model.config.max_model_len
        if len(request.prompt) + request.max_tokens > limit:
            raise ValueError(
                f"request {request.request_id}: prompt {len(request.prompt)} + max_tokens "
                f"{request.max_tokens} exceeds max_model_len {limit}")
        request.weights_version = self.model.weights_version
        self.by_id[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> None:
        """Ask for an abort; it takes effect at the next step (as an ABORT task)."""
        self.by_id[request_id].abort_requested = True

    def update_weights(self, model: TinyMoEModel) -> list[GenerationRequest]:
        """RL weight update: running requests are dropped, slots and prefix cache cleared."""
        dropped = list(self.running)
        for request in dropped:
            self._release(request, RequestState.ABORTED, "weight_update")
        self.runner.clear_requests()
        if self.routing is not None:
            self.routing.reset()
        self.blocks.reset_prefix_cache()
        self.runner.update_parameters(model)
        self.model = model
        for request in self.waiting:
            request.weights_version = model.weights_version
        return dropped

    def step(self) -> list[GenerationRequest]:
        """Schedule and run one step; returns requests that finished or were aborted."""
        done, self._completed = self._completed, []
        tasks, self._admitted = self._admitted, []
        steps: dict[int, SlotStep] = {}
        self._handle_aborts(tasks, done)
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(tasks, steps, budget)
        self._schedule_waiting(tasks, steps, budget)
        started = time.perf_counter()
        self.runner.insert_tasks_v1(tasks)
        if steps:
            self.runner.execute_model(steps)
            self.step_seconds += time.perf_counter() - started
            self.steps += 1
            self.forwarded += sum(len(step.tokens) for step in steps.values())
            self._apply(steps, done)
        return done

    def run(self, on_done: Callable[[GenerationRequest], None] | None = None,
            max_steps: int = 100_000) -> None:
        """Step until idle; ``on_done`` may add requests (next turns)."""
        for _ in range(max_steps):
            if not self.has_work:
                return
            for request in self.step():
                if on_done is not None:
                    on_done(request)
        raise RuntimeError(f"engine still busy after {max_steps} steps")

    def admit_prefilled(self, request: GenerationRequest) -> bool:
        """PD decode side: take a request whose prompt another engine prefilled (its first
        token in ``outputs``): a slot and blocks for ``prompt + 1`` positions now
        (``preallocate_resource_in_d``, engine/sched/resource_manager_v1.py:1521-1552), into
        the running batch at the next step (``add_prefilled_request``, :1565-1604).  False
        when no slot or blocks are free (nothing taken).  The caller writes the prompt's KV
        and routing into ``request.blocks``, then calls :meth:`complete` if the first token
        already finished the request."""
        if not self.free_slots:
            return False
        blocks = self.blocks.allocate(self.blocks.blocks_needed(len(request.tokens)))
        if blocks is None:
            return False
        request.blocks, request.sent_blocks = blocks, len(blocks)
        request.idx = self.free_slots.pop(0)
        request.state, request.prefill_done = RequestState.RUNNING, True
        request.num_computed = len(request.prompt)
        self.by_id[request.request_id] = request
        self.running.append(request)
        self._admitted.append(Task(
            TaskKind.PREFILL, request.idx, request.request_id, block_table=list(blocks),
            prefill_start=len(request.prompt), prefill_end=len(request.prompt),
            max_tokens=request.max_tokens, num_outputs=len(request.outputs),
            input_len=len(request.tokens)))
        return True

    def complete(self, request: GenerationRequest, reason: str) -> None:
        """Finish an admitted request that has nothing left to decode (reported by the next
        :meth:`step`)."""
        self._admitted = [task for task in self._admitted if task.request_id != request.request_id]
        if self.routing is not None:
            if self.config.overlap_schedule:
                self.runner.sync_routing()
            self.routing.finish(self, request)
        self._release(request, RequestState.FINISHED, reason)
        self._completed.append(request)

    # ------------------------------------------------------------------ scheduling
    def _handle_aborts(self, tasks: list[Task], done: list[GenerationRequest]) -> None:
        for request in [r for r in self.running if r.abort_requested]:
            tasks.append(Task(TaskKind.ABORT, request.idx, request.request_id))
            self._release(request, RequestState.ABORTED, "abort")
            done.append(request)
        for request in [r for r in self.waiting if r.abort_requested]:
            self.waiting.remove(request)
            request.state, request.finish_reason = RequestState.ABORTED, "abort"
            done.append(request)

    def _need(self, request: GenerationRequest) -> tuple[int, int, list[int]]:
        """(start, end, fed tokens) of a running request's next step."""
        tokens = request.tokens
        if not request.prefill_done:
            return request.num_computed, len(tokens), tokens
        start = request.num_computed
        drafts: list[int] = []
        if self.config.num_speculative_tokens:
            room = self.model.config.max_model_len - len(tokens)
            count = max(0, min(self.config.num_speculative_tokens, room))
            drafts = propose_drafts(tokens, count) if count else []
        return start, start + 1 + len(drafts), [tokens[-1], *drafts]

    def _ensure_blocks(self, request: GenerationRequest, end: int) -> bool:
        need = self.blocks.blocks_needed(end) - len(request.blocks)
        if need <= 0:
            return True
        new = self.blocks.allocate(need)
        if new is None:
            return False
        request.blocks.extend(new)
        return True

    def _schedule_running(self, tasks: list[Task], steps: dict[int, SlotStep], budget: int) -> int:
        position = 0
        while position < len(self.running) and budget > 0:
            request = self.running[position]
            start, end, fed = self._need(request)
            if not request.prefill_done:
                end = min(end, start + budget)
                fed = request.tokens[start:end]
            elif len(fed) > budget:
                position += 1
                continue
            while not self._ensure_blocks(request, end):
                victim = self.running[-1]
                self._preempt(victim, tasks)
                if victim is request:
                    break
            if request.state is not RequestState.RUNNING:
                break
            if not request.prefill_done:
                tasks.append(self._prefill_task(request, start, end))
            elif len(request.blocks) != request.sent_blocks:
                tasks.append(Task(TaskKind.DECODE, request.idx, request.request_id,
                                  block_table=list(request.blocks)))
            request.sent_blocks = len(request.blocks)
            steps[request.idx] = SlotStep(
                tokens=fed, start=start, seed=request.seed,
                sample=request.prefill_done or end == len(request.tokens))
            budget -= len(fed)
            position += 1
        return budget

    def _schedule_waiting(self, tasks: list[Task], steps: dict[int, SlotStep], budget: int) -> None:
        while self.waiting and budget > 0 and self.free_slots:
            request = self.waiting[0]
            tokens = request.tokens
            need = self.blocks.blocks_needed(len(tokens))
            if need > self.config.num_blocks:      # waiting at the head, it would stall all
                raise RuntimeError(
                    f"request {request.request_id} holds {len(tokens)} tokens: {need} KV blocks "
                    f"of {self.config.block_size}, more than the cache's {self.config.num_blocks} "
                    f"(EngineConfig.num_blocks); it can never run")
            if not request.blocks:
                request.blocks = self.blocks.match_prefix(tokens)
                request.num_computed = len(request.blocks) * self.config.block_size
                request.cached_tokens += request.num_computed
            start = request.num_computed
            end = min(len(tokens), start + budget)
            if not self._ensure_blocks(request, end):
                self.blocks.free(request.blocks)
                request.cached_tokens -= request.num_computed
                request.blocks, request.num_computed = [], 0
                return
            self.waiting.popleft()
            request.idx = self.free_slots.pop(0)
            request.state = RequestState.RUNNING
            request.prefill_done = False
            self.running.append(request)
            tasks.append(self._prefill_task(request, start, end))
            request.sent_blocks = len(request.blocks)
            steps[request.idx] = SlotStep(tokens=tokens[start:end], start=start,
                                          seed=request.seed, sample=end == len(tokens))
            budget -= end - start

    def _prefill_task(self, request: GenerationRequest, start: int, end: int) -> Task:
        request.chunks += 1
        return Task(TaskKind.PREFILL, request.idx, request.request_id,
                    block_table=list(request.blocks), prefill_start=start, prefill_end=end,
                    max_tokens=request.max_tokens, num_outputs=len(request.outputs),
                    input_len=len(request.tokens))

    def _preempt(self, request: GenerationRequest, tasks: list[Task]) -> None:
        tasks.append(Task(TaskKind.PREEMPTED, request.idx, request.request_id))
        self.running.remove(request)
        self.blocks.free(request.blocks)
        self.free_slots.append(request.idx)
        self.free_slots.sort()
        request.blocks, request.num_computed, request.idx = [], 0, None
        request.prefill_done, request.sent_blocks = False, 0
        request.state = RequestState.WAITING
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: GenerationRequest, state: RequestState, reason: str) -> None:
        if request in self.running:
            self.running.remove(request)
        self.blocks.free(request.blocks)
        if request.idx is not None:
            self.free_slots.append(request.idx)
            self.free_slots.sort()
        request.blocks, request.idx = [], None
        request.state, request.finish_reason = state, reason

    def _apply(self, steps: dict[int, SlotStep], done: list[GenerationRequest]) -> None:
        by_slot = {request.idx: request for request in self.running}
        eos = self.model.config.eos_token_id
        for idx, step in steps.items():
            request = by_slot[idx]
            if not request.prefill_done:
                request.num_computed = step.start + len(step.tokens)
                request.prefill_done = step.sample
            else:
                request.num_computed += len(step.outputs)
            if step.outputs and self.routing is not None:   # the token processor's _record_metrics
                self.routing.progress(self, request, step.outputs)
            request.outputs.extend(step.outputs)
            self.blocks.commit(request.blocks, request.tokens, request.num_computed)
            if step.stopped:
                reason = "eos" if request.outputs and request.outputs[-1] == eos else "length"
                if self.routing is not None:       # _finalize_routing before _recycle_resources
                    if self.config.overlap_schedule:  # outputs reach the engine after the flush
                        self.runner.sync_routing()
                    self.routing.finish(self, request)
                self._release(request, RequestState.FINISHED, reason)
                done.append(request)
