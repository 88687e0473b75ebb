"""PD disaggregation: a prefill engine hands requests to a decode engine, routes included.

FastDeploy 2.6 with ``splitwise_role`` prefill / decode, at toy scale:

1. D reserves a slot and blocks for the prompt (``preallocate_resource_in_d``,
   engine/sched/resource_manager_v1.py:1521-1552); here at hand-over time, retried while D
   is full.
2. P prefills and samples the first token; P's request ends there (``max_tokens`` 1 on P).
   Its token processor calls ``_finalize_routing(is_prefill=True)`` before recycling the
   blocks (output/token_processor.py:340): the prompt's ``prompt_token_ids_len`` rows are
   gathered by P's block table (:177-202, :608-614) and ride with the first token.  P
   writes no record.
3. The prompt's KV goes from P's blocks to D's (the cache messager,
   cache_manager/cache_messager.py:699 ``prefill_layerwise_send_cache_thread``).
4. D's ``add_prefilled_request`` (resource_manager_v1.py:1565-1604) appends the first
   token and scatters P's rows into D's host buffer by D's block table (:1608-1624), then
   D decodes; D's record (prompt + generated − 1 rows) is assembled from its own slot cache.

``hand_over_routing=False`` drops step 2's rows: the negative case the fidelity check must
catch.  Both engines share one model (same weights); each has its own runner, block
manager, capturer and slot cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from fdrr_dev.harness.engine import Engine, EngineConfig, GenerationRequest, RequestState
from fdrr_dev.harness.model import TinyMoEModel
from fdrr_dev.harness.wiring import build_engine, capture_config

__all__ = ["DisaggregatedEngine", "HandOver"]


@dataclass
class HandOver:
    """What P sends D for one request: the first token, the prompt's KV and routing rows."""

    request: GenerationRequest            # D's request (the client's, max_tokens intact)
    first_token: int
    kv: list[tuple[np.ndarray, np.ndarray]]
    routing_rows: np.ndarray | None       # [prompt_len, L, K], None when not handed over


class _PrefillRouting:
    """P's engine-side routing: a finished (prefilled) request is handed over, not stored."""

    def __init__(self, pair: DisaggregatedEngine, inner: Any) -> None:
        self.pair = pair
        self.inner = inner
        self.host = inner.host
        self.counters = inner.counters

    def finish(self, engine: Engine, request: GenerationRequest) -> None:
        prompt_len = len(request.prompt)
        rows = self.inner.gather_prompt(request.blocks, prompt_len) if self.pair.hand_over_routing else None
        kv = engine.runner.copy_kv(self.inner.slots(request.blocks, prompt_len))
        client = self.pair.clients.pop(request.request_id)
        client.chunks, client.cached_tokens = request.chunks, request.cached_tokens
        client.preemptions += request.preemptions
        self.pair.pending.append(HandOver(client, request.outputs[0], kv, rows))

    def progress(self, engine: Engine, request: GenerationRequest, new_tokens: Any) -> None:
        """A prefill instance writes no partial record either (it writes no record)."""

    def reset(self) -> None:
        self.inner.reset()


class DisaggregatedEngine:
    """Engine-shaped pair (``add_request``, ``step``, ``has_work``, ``by_id``) of a prefill
    and a decode :class:`Engine`; finished requests come from D."""

    def __init__(self, prefill: Engine, decode: Engine, *, hand_over_routing: bool = True) -> None:
        if prefill.routing is None or decode.routing is None:
            raise ValueError("PD disaggregation in the harness needs the step generation with capture on")
        self.prefill, self.decode = prefill, decode
        self.hand_over_routing = hand_over_routing
        self.prefill.routing = _PrefillRouting(self, prefill.routing)
        self.clients: dict[str, GenerationRequest] = {}
        self.pending: deque[HandOver] = deque()
        self.handed_over = 0
        self.deferred = 0                   # hand-overs that waited for room on D

    @classmethod
    def build(cls, model: TinyMoEModel, engine_config: EngineConfig, *, writer: Any = None,
              config: Any = None, managers_out: list[Any] | None = None, hand_over_routing: bool = True,
              capture: bool = True) -> DisaggregatedEngine:
        """P with the configured prefix cache and no writer (a prefill instance writes no
        record); D with the writer and no prefix cache (a decode instance does not cache
        prefixes: resource_manager_v1.py:1626-1628)."""
        if engine_config.generation != "step":
            raise ValueError("PD disaggregation is FastDeploy 2.6's: use generation='step'")
        config = config or capture_config()
        prefill_config = replace(config, capture=replace(config.capture, prefix_omission=False,
                                                         partial_every_tokens=0))
        prefill = build_engine(model, engine_config, writer=None, config=prefill_config, capture=capture)
        decode = build_engine(model, replace(engine_config, enable_prefix_caching=False), writer=writer,
                              config=config, managers_out=managers_out, capture=capture)
        return cls(prefill, decode, hand_over_routing=hand_over_routing)

    # ------------------------------------------------------------------ engine-shaped API
    @property
    def model(self) -> TinyMoEModel:
        return self.decode.model

    @property
    def routing(self) -> Any:
        return self.decode.routing

    @property
    def by_id(self) -> dict[str, GenerationRequest]:
        return {**self.prefill.by_id, **self.decode.by_id, **self.clients}

    @property
    def has_work(self) -> bool:
        return bool(self.pending or self.prefill.has_work or self.decode.has_work)

    def flush(self, timeout: float | None = 60.0) -> bool:
        """Both engines' :meth:`Engine.flush`."""
        return self.prefill.flush(timeout) and self.decode.flush(timeout)

    def abort(self, request_id: str) -> None:
        raise NotImplementedError("aborts are not modelled across a PD pair in the harness")

    def add_request(self, request: GenerationRequest) -> None:
        """The client's request goes to P as a one-token request; D continues it."""
        self.decode.add_request(request)                 # validates; then taken back out
        self.decode.waiting.remove(request)
        self.clients[request.request_id] = request
        self.prefill.add_request(replace(request, max_tokens=1, outputs=[], blocks=[]))

    def step(self) -> list[GenerationRequest]:
        """One P step, hand-overs, one D step; returns D's finished requests."""
        self.prefill.step()
        self._hand_over()
        return self.decode.step()

    # ------------------------------------------------------------------ hand-over
    def _hand_over(self) -> None:
        eos = self.decode.model.config.eos_token_id
        while self.pending:
            handover = self.pending[0]
            request = handover.request
            request.outputs = [handover.first_token]
            if not self.decode.admit_prefilled(request):
                request.outputs = []
                self.deferred += 1
                return                                   # D is full: retry after its next step
            self.pending.popleft()
            self.handed_over += 1
            prompt_slots = self.decode.routing.slots(request.blocks, len(request.prompt))
            self.decode.runner.write_kv(prompt_slots, handover.kv)
            if handover.routing_rows is not None:
                self.decode.routing.scatter_prompt(request.blocks, handover.routing_rows)
            if handover.first_token == eos or request.max_tokens <= 1:
                self.decode.complete(request, "eos" if handover.first_token == eos else "length")
            elif request.state is not RequestState.RUNNING:
                raise RuntimeError(f"{request.request_id} not running after the hand-over")
