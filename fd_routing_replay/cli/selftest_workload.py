"""The workload ``fd-rr selftest`` sends, through a server's OpenAI API (stdlib ``urllib``).

Small and varied, so one run reaches every path a row can take to the store:

* ``shared0`` .. ``shared2``: one long system prompt, three user messages; ``shared0``
  finishes before the other two start, so they can hit its blocks in the prefix cache;
* ``long``: one prompt longer than a prefill chunk (``--long-prompt-words``);
* ``choices``: one request with ``n`` choices (engine requests ``_0`` .. ``_{n-1}``,
  recorded under ``{base}`` and ``{base}_n{i}``);
* ``chat``: two turns; turn 1 sends turn 0's messages, its answer and a new question.

Every request names its rollout in the OpenAI ``user`` field (``{run}_{name}:0:{turn}:0``)
and asks for ``return_token_ids`` (FastDeploy's per-choice completion token ids), so each
record's expected length is ``prompt_tokens + completion_tokens - 1``.
"""

from __future__ import annotations

import json
import random
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fd_routing_replay.keys import choice_rollout_id, parse_rollout_id

__all__ = ["Exchange", "Workload", "WorkloadSettings", "http_json", "run_id"]

WORDS = ("routing", "expert", "token", "layer", "replay", "rollout", "gradient", "policy", "reward",
         "sample", "batch", "cache", "block", "prefix", "decode", "prefill", "chunk", "tensor",
         "rank", "shard", "store", "record", "trainer", "engine", "model", "weight", "signal")


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 600.0) -> dict[str, Any]:
    """GET (``body`` None) or POST JSON; ConnectionError with the server's message when the
    server cannot be reached or answers with an HTTP error."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:   # noqa: S310 - the user's URL
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise ConnectionError(f"{url}: HTTP {exc.code}: {detail}") from None
    except urllib.error.URLError as exc:
        raise ConnectionError(f"{url}: cannot reach the server: {exc.reason}") from None


def run_id(prefix: str) -> str:
    """A fresh rollout-base prefix for one selftest run."""
    return f"{prefix}-{int(time.time())}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class WorkloadSettings:
    """The workload's sizes (words of text; a word is one or two tokens for most tokenizers)."""

    model: str
    max_tokens: int = 16
    choices: int = 2
    shared_prefix_words: int = 120
    long_prompt_words: int = 3000
    question_words: int = 12
    timeout_s: float = 600.0
    seed: int = 0


@dataclass
class Exchange:
    """One request and what came back: the records it should have produced."""

    name: str
    rollout_id: str
    body: dict[str, Any]
    response: dict[str, Any] | None = None
    error: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return int(((self.response or {}).get("usage") or {}).get("prompt_tokens") or 0)

    @property
    def cached_tokens(self) -> int:
        details = ((self.response or {}).get("usage") or {}).get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)

    def records(self) -> list[tuple[str, int | None]]:
        """(rollout id, expected positions or None when unknown) of each choice."""
        if self.response is None:
            return []
        rollout = parse_rollout_id(self.rollout_id)
        choices = sorted(self.response.get("choices") or [], key=lambda c: int(c.get("index", 0)))
        usage = self.response.get("usage") or {}
        out = []
        for choice in choices:
            tokens = (choice.get("message") or {}).get("completion_token_ids")
            if tokens is not None:
                completion: int | None = len(tokens)
            elif len(choices) == 1:
                completion = usage.get("completion_tokens")
            else:
                completion = None
            expected = None if completion is None else self.prompt_tokens + int(completion) - 1
            out.append((choice_rollout_id(rollout, int(choice.get("index", 0))).text, expected))
        return out


@dataclass
class Workload:
    """Sends the selftest's requests to ``url`` (the server's root, e.g. http://host:8180)."""

    url: str
    settings: WorkloadSettings
    run: str
    exchanges: list[Exchange] = field(default_factory=list)
    post: Callable[[str, dict[str, Any], float], dict[str, Any]] = http_json
    """How a request reaches the server: ``post(url, body, timeout)`` -> the response."""

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self._rng = random.Random(self.settings.seed)
        self.system = self._text(self.settings.shared_prefix_words)

    def _text(self, words: int) -> str:
        return " ".join(self._rng.choice(WORDS) for _ in range(max(int(words), 1)))

    def _body(self, name: str, messages: list[dict[str, str]], *, turn: int = 0, n: int = 1) -> Exchange:
        rollout_id = f"{self.run}_{name}:0:{turn}:0"
        body = {"model": self.settings.model, "messages": messages, "user": rollout_id, "n": n,
                "max_tokens": self.settings.max_tokens, "return_token_ids": True, "stream": False}
        return Exchange(name, rollout_id, body)

    def _send(self, exchanges: list[Exchange]) -> None:
        def one(exchange: Exchange) -> None:
            try:
                exchange.response = self.post(f"{self.url}/v1/chat/completions", exchange.body,
                                              self.settings.timeout_s)
            except (OSError, ValueError) as exc:
                exchange.error = str(exc)
        with ThreadPoolExecutor(max_workers=max(len(exchanges), 1)) as pool:
            list(pool.map(one, exchanges))
        self.exchanges.extend(exchanges)

    def first_phase(self) -> list[Exchange]:
        """shared0 (alone, so its prefix is cached), then long, choices and chat turn 0 together."""
        question = self._text(self.settings.question_words)
        self._send([self._body("shared0", [{"role": "system", "content": self.system},
                                           {"role": "user", "content": question}])])
        batch = [
            self._body("long", [{"role": "user", "content": self._text(self.settings.long_prompt_words)}]),
            self._body("choices", [{"role": "user", "content": self._text(self.settings.question_words)}],
                       n=self.settings.choices),
            self._body("chat", [{"role": "user", "content": self._text(self.settings.question_words)}]),
        ]
        self._send(batch)
        return self.exchanges[:]

    def second_phase(self) -> list[Exchange]:
        """shared1 and shared2 (prefix-cache hits on shared0) and chat turn 1, together."""
        turn0 = next(e for e in self.exchanges if e.name == "chat")
        history = list(turn0.body["messages"])
        if turn0.response is not None:
            answer = ((turn0.response.get("choices") or [{}])[0].get("message") or {}).get("content") or ""
            history += [{"role": "assistant", "content": answer}]
        history += [{"role": "user", "content": self._text(self.settings.question_words)}]
        batch = [self._body(f"shared{i}", [{"role": "system", "content": self.system},
                                           {"role": "user", "content": self._text(self.settings.question_words)}])
                 for i in (1, 2)]
        batch.append(self._body("chat", history, turn=1))
        start = len(self.exchanges)
        self._send(batch)
        return self.exchanges[start:]
