"""Routes in FastDeploy 2.6's streaming responses: the last chunk's ``metrics`` carry them.

FastDeploy's OpenAI layer puts ``routed_experts`` into non-streaming responses only
(entrypoints/openai/serving_chat.py:725-733, :765; serving_completion.py:789-806): its
stream chunks have no such field (protocol.py:347-358 ``ChatCompletionStreamResponse``,
:430-441 ``CompletionStreamResponse``) and the stream generators never read an output's
``routing_data``.  What a chunk does carry from the engine's output, unchanged, is the
output's metrics: ``RequestOutput.to_dict`` sends ``metrics.to_dict()`` (engine/request.py:1131-1155,
``RequestMetrics.to_dict``, :904-908, is ``asdict`` of every dataclass field) and the
generators put that dict into the chunk when the request sets ``collect_metrics``
(serving_chat.py:479-480, sent at :501-503; serving_completion.py:608-615, :654).  So the engine side gives a finished output's metrics one more field,
``routed_experts`` (the same base64 text as the non-streaming field), by making them a
:class:`RoutedRequestMetrics`, a dataclass subclass of FastDeploy's ``RequestMetrics``:
no FastDeploy code is patched.  A client reads ``chunk["metrics"]["routed_experts"]`` of
the chunk with a ``finish_reason`` (:func:`fd_routing_replay.reader.references.routes_from_response`).

A top-level ``routed_experts`` in stream chunks would need FastDeploy to add the field to
both stream response models and set it where the final chunk is built
(serving_chat.py:446-503, serving_completion.py:587-616).

``RoutedRequestMetrics`` is built on first use (this module imports FastDeploy only then)
and is reachable as this module's attribute, so pickle finds it by name (FastDeploy's
splitwise scheduler pickles outputs, scheduler/splitwise_scheduler.py:901).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

__all__ = ["ROUTED_EXPERTS", "routed_metrics_class", "with_routes"]

#: The metrics field (and the non-streaming response field) that carries the routes.
ROUTED_EXPERTS = "routed_experts"
_CLASS_NAME = "RoutedRequestMetrics"
_built: list[type] = []
_build_lock = threading.Lock()


def routed_metrics_class() -> type:
    """FastDeploy's ``RequestMetrics`` with one more field, ``routed_experts`` (built once)."""
    with _build_lock:
        if not _built:
            from fastdeploy.engine.request import RequestMetrics

            cls = dataclasses.make_dataclass(
                _CLASS_NAME, [(ROUTED_EXPERTS, "str | None", dataclasses.field(default=None))],
                bases=(RequestMetrics,), slots=True,
                namespace={"__module__": __name__,
                           "__doc__": "FastDeploy's request metrics plus the request's routes "
                                      "(base64), for the last chunk of a streaming response."})
            cls.__qualname__ = _CLASS_NAME
            _built.append(cls)
        return _built[0]


def with_routes(metrics: Any, text: str) -> Any:
    """A copy of FastDeploy request ``metrics`` (None: defaults) that also carries ``text``."""
    cls = routed_metrics_class()
    values = {} if metrics is None else {
        field.name: getattr(metrics, field.name) for field in dataclasses.fields(metrics)
        if field.init and field.name != ROUTED_EXPERTS}
    return cls(**values, routed_experts=text)


def __getattr__(name: str) -> Any:
    if name == _CLASS_NAME:
        return routed_metrics_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
