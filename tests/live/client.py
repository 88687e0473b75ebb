"""Drive the live server with the ``openai`` client and check what it stored against the recompute.

Every request asks for its token ids (FastDeploy's ``return_token_ids``, entrypoints/openai/
protocol.py:549, :735), so a record can be checked against the tiny model's routes for
exactly the tokens the server saw; streaming responses carry them chunk by chunk.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fd_routing_replay.keys import choice_rollout_id, parse_rollout_id

__all__ = ["Choice", "chat", "complete", "wait_for_record"]


@dataclass
class Choice:
    """One choice of a response: the rollout id its record is stored under and its tokens."""

    rollout_id: str
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""
    cached_tokens: int = 0
    last_chunk: Any = None               # streaming: the chunk with the finish reason
    response: Any = None                 # non-streaming: the whole response

    @property
    def token_ids(self) -> list[int]:
        return list(self.prompt_ids) + list(self.completion_ids)

    @property
    def forwarded(self) -> int:
        """Positions the record covers: prompt + generated - 1."""
        return len(self.prompt_ids) + len(self.completion_ids) - 1


def _choice_id(user: str, index: int) -> str:
    return str(choice_rollout_id(parse_rollout_id(user), index))


def _cached(usage: Any) -> int:
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    return int(getattr(details, "cached_tokens", None) or 0)


def _collect(response: Any, user: str, stream: bool, chat_api: bool) -> list[Choice]:
    choices: dict[int, Choice] = {}
    if not stream:
        for c in response.choices:
            body = c.message if chat_api else c
            choices[c.index] = Choice(_choice_id(user, c.index), list(body.prompt_token_ids or []),
                                      list(body.completion_token_ids or []), c.finish_reason,
                                      (body.content if chat_api else body.text) or "", _cached(response.usage),
                                      response=response)
        return [choices[i] for i in sorted(choices)]
    usage = None
    for chunk in response:
        usage = chunk.usage or usage
        for c in chunk.choices:
            body = c.delta if chat_api else c
            entry = choices.setdefault(c.index, Choice(_choice_id(user, c.index), []))
            entry.prompt_ids += list(getattr(body, "prompt_token_ids", None) or [])
            entry.completion_ids += list(getattr(body, "completion_token_ids", None) or [])
            entry.text += (getattr(body, "content", None) if chat_api else getattr(body, "text", None)) or ""
            if c.finish_reason:
                entry.finish_reason = c.finish_reason
                entry.last_chunk = chunk
    for entry in choices.values():
        entry.cached_tokens = _cached(usage)
    return [choices[i] for i in sorted(choices)]


def complete(client: Any, prompt: str, user: str, *, stream: bool = False, **kwargs: Any) -> list[Choice]:
    """A text completion; returns its choices with their token ids."""
    extra = {"return_token_ids": True, **kwargs.pop("extra_body", {})}
    response = client.completions.create(model="default", prompt=prompt, user=user, stream=stream,
                                         extra_body=extra, **kwargs)
    return _collect(response, user, stream, chat_api=False)


def chat(client: Any, messages: list[dict], user: str, *, stream: bool = False, **kwargs: Any) -> list[Choice]:
    """A chat completion; returns its choices with their token ids."""
    extra = {"return_token_ids": True, **kwargs.pop("extra_body", {})}
    if stream:
        kwargs.setdefault("stream_options", {"include_usage": True})
    response = client.chat.completions.create(model="default", messages=messages, user=user, stream=stream,
                                              extra_body=extra, **kwargs)
    return _collect(response, user, stream, chat_api=True)


def wait_for_record(reader: Any, rollout_id: str, *, timeout: float = 30.0, server: Any = None) -> Any:
    """The record stored under ``rollout_id`` once the engine's background writer has put it
    (records are written after the response returns); None after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        record = reader.get(rollout_id)
        if record is not None or time.monotonic() > deadline:
            return record
        if server is not None:
            server.check_alive()
        time.sleep(0.1)
