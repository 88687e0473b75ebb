"""An OpenAI-compatible chat endpoint in front of a harness engine, on a free loopback port.

What ``fd-rr selftest`` drives in this project's tests in place of FastDeploy's API server
(which needs a GPU): real HTTP (``http.server``), FastDeploy 2.6's request and response
shapes for what the selftest uses, and FastDeploy's request ids, so records are keyed
as a FastDeploy deployment keys them:

* ``POST /v1/chat/completions`` with ``messages``, ``user``, ``n``, ``max_tokens`` /
  ``max_completion_tokens``, ``request_id`` and ``return_token_ids``; the engine requests
  are ``chatcmpl-{user}-{uuid4}_{i}`` for choice ``i`` (entrypoints/openai/serving_chat.py:134-141,
  engine_client.py:417-431); ``usage`` as FastDeploy sums it over the choices
  (serving_chat.py:695-709, ``cached_tokens`` the prefix-cache hits), ``finish_reason``
  ``stop`` / ``length``; ``stream`` is refused (400);
* ``GET /v1/models`` (the one model) and ``GET /health``.

A toy chat template stands in for the tokenizer: a role token per message, then one token
per character.  One thread runs the engine loop (continuous batching over every request in
flight); the HTTP threads only queue requests and wait for them.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from fd_routing_replay.errors import InvalidRolloutId
from fd_routing_replay.keys import parse_request_id

__all__ = ["ChatTemplate", "HarnessOpenAIServer", "harness_server"]

logger = logging.getLogger(__name__)

MAX_CHOICES = 16
REQUEST_TIMEOUT_S = 600.0


class ChatTemplate:
    """Messages to token ids and back: ``<role>`` then one token per character, then
    ``<assistant>``; ids 1-3 are the roles, the rest characters (never EOS)."""

    ROLES = {"system": 1, "user": 2, "assistant": 3, "tool": 2}

    def __init__(self, vocab_size: int, eos_token_id: int) -> None:
        self.first = 4
        self.size = vocab_size - self.first
        if self.size < 2 or eos_token_id >= self.first:
            raise ValueError(f"the chat template needs vocab_size > 5 and EOS below 4, got "
                             f"{vocab_size}, {eos_token_id}")

    def encode(self, messages: list[dict[str, Any]]) -> list[int]:
        tokens: list[int] = []
        for message in messages:
            tokens.append(self.ROLES.get(str(message.get("role")), 2))
            tokens.extend(self.first + (ord(ch) - 32) % self.size for ch in str(message.get("content") or ""))
        tokens.append(self.ROLES["assistant"])
        return tokens

    def decode(self, tokens: list[int]) -> str:
        return "".join(chr(32 + token - self.first) for token in tokens if token >= self.first)


class BadRequest(ValueError):
    """A request the front answers with 400 (the message says why)."""


@dataclass
class _Pending:
    requests: list[Any]
    done: threading.Event = field(default_factory=threading.Event)
    left: int = 0
    error: str | None = None


class HarnessOpenAIServer:
    """Serve ``engine`` (a harness :class:`Engine` or PD pair) over HTTP on 127.0.0.1.

    ``close`` callables run at :meth:`stop` after the engine loop ended (e.g. the sink's).
    """

    def __init__(self, engine: Any, *, model_name: str = "fdrr-harness", default_max_tokens: int = 16,
                 seed: int = 0, close: tuple[Any, ...] = ()) -> None:
        self.engine = engine
        self.model_name = model_name
        self.default_max_tokens = int(default_max_tokens)
        cfg = engine.model.config
        self.template = ChatTemplate(cfg.vocab_size, cfg.eos_token_id)
        self._rng = random.Random(seed)
        self._close = close
        self._lock = threading.Condition()
        self._inbox: list[tuple[_Pending, Any]] = []
        self._pending: dict[str, _Pending] = {}
        self._stopping = False
        self._failure: str | None = None
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._http.daemon_threads = True
        self._threads = [threading.Thread(target=self._http.serve_forever, name="fdrr-openai-http", daemon=True),
                         threading.Thread(target=self._engine_loop, name="fdrr-openai-engine", daemon=True)]

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HarnessOpenAIServer:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, end the engine loop (requests in flight fail), run ``close``."""
        self._http.shutdown()
        self._http.server_close()
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self._threads[1].join(60)
        for close in self._close:
            close()

    def __enter__(self) -> HarnessOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ the engine loop
    def _engine_loop(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._lock:
                    while not self._inbox and not engine.has_work and not self._stopping:
                        self._lock.wait(0.5)
                    if self._stopping:
                        break
                    inbox, self._inbox = self._inbox, []
                for pending, request in inbox:
                    try:
                        engine.add_request(request)
                    except ValueError as exc:
                        self._finish(pending, request, error=str(exc))
                if engine.has_work:
                    for request in engine.step():
                        self._finish(self._pending.get(request.request_id), request)
        except Exception as exc:  # noqa: BLE001 - every waiter hears of it
            logger.exception("harness OpenAI front: the engine loop failed")
            self._failure = f"the engine failed: {exc!r}"
        with self._lock:
            failure = self._failure or "the server is stopping"
            for pending in set(self._pending.values()):
                pending.error = pending.error or failure
                pending.done.set()
            self._pending.clear()

    def _finish(self, pending: _Pending | None, request: Any, error: str | None = None) -> None:
        if pending is None:
            return
        with self._lock:
            self._pending.pop(request.request_id, None)
            pending.error = pending.error or error
            pending.left -= 1
            if pending.left <= 0 or error is not None:
                pending.done.set()

    # ------------------------------------------------------------------ one chat completion
    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """The response to one ``/v1/chat/completions`` body (BadRequest for a bad one)."""
        from fdrr_dev.harness.engine import GenerationRequest

        if body.get("stream"):
            raise BadRequest("stream is not supported by the harness front; send stream: false")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("messages must be a non-empty list of {role, content} objects")
        n = body.get("n") if body.get("n") is not None else 1
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
            raise BadRequest(f"n must be an int in [1, {MAX_CHOICES}], got {n!r}")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or self.default_max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise BadRequest(f"max_tokens must be a positive int, got {max_tokens!r}")
        base = self._request_id(body)
        prompt = self.template.encode(messages)
        self._check_fits(len(prompt), max_tokens)
        requests = []
        with self._lock:
            seeds = [self._rng.randrange(2**31) for _ in range(n)]
        for choice in range(n):
            request_id = f"{base}_{choice}"
            try:
                rollout_id = parse_request_id(request_id).text
            except InvalidRolloutId:
                rollout_id = request_id             # not recorded (no user), as in FastDeploy
            requests.append(GenerationRequest(request_id=request_id, rollout_id=rollout_id, prompt=list(prompt),
                                              max_tokens=max_tokens, seed=seeds[choice]))
        pending = _Pending(requests, left=n)
        with self._lock:
            if self._stopping or self._failure:
                raise RuntimeError(self._failure or "the server is stopping")
            for request in requests:
                self._pending[request.request_id] = pending
                self._inbox.append((pending, request))
            self._lock.notify_all()
        if not pending.done.wait(REQUEST_TIMEOUT_S):
            raise RuntimeError(f"request {base} did not finish in {REQUEST_TIMEOUT_S:g} s")
        if pending.error is not None:
            raise RuntimeError(pending.error)
        return self._response(base, body, prompt, requests)

    def _check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """BadRequest for a request no engine of the server could ever hold (FastDeploy
        rejects those too, instead of waiting for KV blocks forever)."""
        from fdrr_dev.harness.verification import engines_of

        for instance in engines_of(self.engine):
            limit = instance.model.config.max_model_len
            if prompt_len + max_tokens > limit:
                raise BadRequest(f"prompt {prompt_len} + max_tokens {max_tokens} tokens exceed "
                                 f"max_model_len {limit}")
            blocks = instance.config.num_blocks
            if instance.blocks.blocks_needed(prompt_len + max_tokens) > blocks:
                raise BadRequest(f"prompt {prompt_len} + max_tokens {max_tokens} tokens need more "
                                 f"than the engine's {blocks} KV blocks")

    def _request_id(self, body: dict[str, Any]) -> str:
        """FastDeploy's (serving_chat.py:134-141)."""
        given, user = body.get("request_id"), body.get("user")
        if given is not None:
            given = str(given)
            return given if given.startswith("chatcmpl-") else f"chatcmpl-{given}"
        if user is not None:
            return f"chatcmpl-{user}-{uuid.uuid4()}"
        return f"chatcmpl-{uuid.uuid4()}"

    def _response(self, base: str, body: dict[str, Any], prompt: list[int], requests: list[Any]) -> dict[str, Any]:
        eos = self.engine.model.config.eos_token_id
        token_ids = bool(body.get("return_token_ids"))
        choices = []
        for index, request in enumerate(requests):
            message: dict[str, Any] = {"role": "assistant",
                                       "content": self.template.decode([t for t in request.outputs if t != eos])}
            if token_ids:
                message["prompt_token_ids"] = list(prompt)
                message["completion_token_ids"] = list(request.outputs)
            reason = {"eos": "stop", "length": "length"}.get(request.finish_reason or "", "abort")
            choices.append({"index": index, "message": message, "finish_reason": reason})
        completion = sum(len(request.outputs) for request in requests)
        return {"id": base, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion,
                          "total_tokens": len(prompt) + completion,
                          "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in requests)}}}

    # ------------------------------------------------------------------ HTTP
    def _handler_class(self) -> type:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:   # noqa: A002 - the base's name
                logger.debug("harness OpenAI front: " + format, *args)

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _error(self, status: int, message: str) -> None:
                self._send(status, {"error": {"message": message, "type": "invalid_request_error"
                                              if status == 400 else "server_error", "code": status}})

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [
                        {"id": server.model_name, "object": "model", "owned_by": "fd-routing-replay"}]})
                elif self.path.rstrip("/") == "/health":
                    self._send(200, {"status": "ok"})
                else:
                    self._error(404, f"no route {self.path}")

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                if self.path.rstrip("/") != "/v1/chat/completions":
                    self._error(404, f"no route {self.path}")
                    return
                try:
                    body = json.loads(raw or b"null")
                    if not isinstance(body, dict):
                        raise BadRequest("the body must be a JSON object")
                    self._send(200, server.complete(body))
                except (BadRequest, json.JSONDecodeError) as exc:
                    self._error(400, str(exc))
                except Exception as exc:  # noqa: BLE001 - answered as a server error
                    self._error(500, str(exc))

        return Handler


def harness_server(config: Any, *, engine_config: Any = None, model_config: Any = None,
                   disaggregated: bool | dict[str, Any] = False, **server_options: Any) -> HarnessOpenAIServer:
    """A (not yet started) front for a harness engine wired from ``config`` as the FastDeploy
    plugin wires a server: records go to ``config``'s store through its writer, and
    ``capture.verify`` puts the engine in verification mode.  ``engine_config`` picks the
    generation and the scenario (TP/EP, prefix cache, CPU cache, overlap ...);
    ``disaggregated`` serves a PD pair (a dict passes options to it)."""
    from fd_routing_replay.writer import RoutingWriter
    from fdrr_dev.harness.disaggregation import DisaggregatedEngine
    from fdrr_dev.harness.engine import EngineConfig
    from fdrr_dev.harness.model import TinyMoEConfig, TinyMoEModel
    from fdrr_dev.harness.verification import verify_engine
    from fdrr_dev.harness.wiring import build_engine

    engine_config = engine_config or EngineConfig(generation="step")
    model = TinyMoEModel(model_config or TinyMoEConfig())
    writer = RoutingWriter.from_config(config)
    try:
        options = dict(writer=writer, config=config)
        if disaggregated:
            extra = disaggregated if isinstance(disaggregated, dict) else {}
            engine: Any = DisaggregatedEngine.build(model, engine_config, **options, **extra)
        else:
            engine = build_engine(model, engine_config, **options)
        if config.capture.verify:
            verify_engine(engine)
    except BaseException:
        writer.close()
        raise
    return HarnessOpenAIServer(engine, close=(writer.close,), **server_options)
