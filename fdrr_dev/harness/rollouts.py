"""Multi-turn chat rollouts, keyed the way an RL driver keys them.

Each rollout is ``exp_{data}:{gen}:{turn}:{segment}``: ``data`` indexes the prompt,
``gen`` the sample drawn for it, ``turn`` the chat turn.  Turn ``t+1``'s prompt is turn
``t``'s prompt and answer plus a new user message, so it hits turn ``t``'s blocks in the
prefix cache; every rollout also starts with the same system prompt, so different
rollouts share blocks too.  Agentic plans add a tool's output between turns
(``tool_tokens``) and may truncate the history every ``truncate_every`` turns (keep the
system prompt and the newer half): such a turn does not extend the previous one.  Requests reach the engine as FastDeploy request ids
``chatcmpl-{rollout_id}-{uuid}`` (the rollout id travels in the OpenAI ``user`` field).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fdrr_dev.harness.engine import Engine, GenerationRequest, RequestState


@dataclass(frozen=True)
class RolloutPlan:
    """Workload shape; everything derives from ``seed``."""

    num_rollouts: int = 64
    num_turns: int = 3
    samples_per_prompt: int = 2
    system_tokens: int = 16
    user_tokens: tuple[int, int] = (6, 24)
    max_tokens: tuple[int, int] = (8, 32)
    experiment: str = "exp"
    abort_fraction: float = 0.0
    seed: int = 7
    tool_tokens: tuple[int, int] = (0, 0)   # tool output appended before each later turn
    truncate_every: int = 0                 # every n-th turn drops the older half of the history


@dataclass
class TurnResult:
    """A finished (or aborted) turn: what the fidelity check and the summary need."""

    rollout_id: str
    request_id: str
    forwarded_tokens: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str
    weights_version: int
    preemptions: int
    cached_tokens: int
    chunks: int


def request_id_for(rollout_id: str, rng: np.random.Generator) -> str:
    """FastDeploy's chat request id for a rollout: ``chatcmpl-{user}-{uuid4}``."""
    return f"chatcmpl-{rollout_id}-{uuid.UUID(bytes=rng.bytes(16), version=4)}"


@dataclass
class RolloutDriver:
    """Feeds turns into an :class:`Engine` and starts turn t+1 when turn t finishes."""

    plan: RolloutPlan
    vocab_size: int
    eos_token_id: int
    results: list[TurnResult] = field(default_factory=list)
    on_result: Callable[[TurnResult], None] | None = None

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.plan.seed)
        self.system_prompt = self._tokens(self.plan.system_tokens)
        self.engine: Engine | None = None
        self._abort_at: dict[str, int] = {}
        self.submitted = 0

    def _tokens(self, count: int) -> list[int]:
        # never the EOS token inside a prompt
        return [int(t) for t in self.rng.integers(1, self.vocab_size, count)]

    def rollout_id(self, index: int, turn: int) -> str:
        data, gen = divmod(index, self.plan.samples_per_prompt)
        return f"{self.plan.experiment}_{data}:{gen}:{turn}:0"

    def _agent_history(self, turn: int, history: list[int]) -> list[int]:
        """Turn ``turn``'s history: the previous turn's tokens, a tool's output, and every
        ``truncate_every`` turns only the system prompt and the newer half."""
        plan = self.plan
        if plan.tool_tokens[1] > 0:
            history = history + self._tokens(int(self.rng.integers(*plan.tool_tokens, endpoint=True)))
        if plan.truncate_every and turn % plan.truncate_every == 0:
            system = len(self.system_prompt)
            rest = history[system:]
            history = history[:system] + rest[len(rest) // 2:]
        return history

    def truncated(self, turn: int) -> bool:
        """Whether turn ``turn`` truncates its history (does not extend the previous turn)."""
        return bool(turn and self.plan.truncate_every and turn % self.plan.truncate_every == 0)

    def _request(self, index: int, turn: int, history: list[int]) -> GenerationRequest:
        plan = self.plan
        if turn > 0:
            history = self._agent_history(turn, history)
        prompt = history + self._tokens(int(self.rng.integers(*plan.user_tokens, endpoint=True)))
        rollout_id = self.rollout_id(index, turn)
        request = GenerationRequest(
            request_id=request_id_for(rollout_id, self.rng), rollout_id=rollout_id,
            prompt=prompt, max_tokens=int(self.rng.integers(*plan.max_tokens, endpoint=True)),
            seed=int(self.rng.integers(2**31)), tag=(index, turn))
        if self.rng.random() < plan.abort_fraction:
            self._abort_at[request.request_id] = int(self.rng.integers(1, 6))
        return request

    def start(self, engine: Engine) -> None:
        """Submit turn 0 of every rollout (prompts share the system prompt)."""
        self.engine = engine
        for index in range(self.plan.num_rollouts):
            data_prompt = self.system_prompt
            engine.add_request(self._request(index, 0, list(data_prompt)))
            self.submitted += 1

    def tick(self) -> None:
        """Fire scheduled aborts (called once per engine step)."""
        assert self.engine is not None
        for request_id in list(self._abort_at):
            self._abort_at[request_id] -= 1
            if self._abort_at[request_id] <= 0:
                del self._abort_at[request_id]
                request = self.engine.by_id[request_id]
                if request.state in (RequestState.WAITING, RequestState.RUNNING):
                    self.engine.abort(request_id)

    def on_done(self, request: GenerationRequest) -> None:
        """Record a finished turn and submit the next one."""
        assert self.engine is not None
        self._abort_at.pop(request.request_id, None)
        result = TurnResult(
            rollout_id=request.rollout_id, request_id=request.request_id,
            forwarded_tokens=request.forwarded_tokens, num_prompt_tokens=len(request.prompt),
            num_output_tokens=len(request.outputs), finish_reason=request.finish_reason or "",
            weights_version=request.weights_version, preemptions=request.preemptions,
            cached_tokens=request.cached_tokens, chunks=request.chunks)
        self.results.append(result)
        if self.on_result is not None:
            self.on_result(result)
        index, turn = request.tag
        if request.state is RequestState.FINISHED and turn + 1 < self.plan.num_turns:
            self.engine.add_request(self._request(index, turn + 1, request.tokens))
            self.submitted += 1

    def run(self, engine: Engine, max_steps: int = 100_000,
            on_step: Callable[[Engine], None] | None = None) -> list[TurnResult]:
        """Drive everything to completion."""
        self.start(engine)
        for _ in range(max_steps):
            if not engine.has_work:
                engine.flush()
                return self.results
            self.tick()
            for request in engine.step():
                self.on_done(request)
            if on_step is not None:
                on_step(engine)
        raise RuntimeError(f"rollouts not done after {max_steps} steps")
