"""Response mode: the record comes back in the response, whole or (streaming) in the last chunk.

``routing_store_type: response`` with ``response.stream`` on; FastDeploy's ZMQ output path
(``FD_USE_GET_SAVE_OUTPUT_V1=1``, the token processor's ``_process_batch_output_use_zmq``)
so both of FastDeploy's output paths carry the plugin.  Every record the client decodes is
checked against the recompute of the request's tokens.
"""

from __future__ import annotations

import uuid

import pytest

from fd_routing_replay import routes_from_response
from fd_routing_replay.errors import RecordError

from .client import chat, complete
from .rig import ServerOptions

OPTIONS = ServerOptions(zmq_output=True, routing={"enable_routing_replay": True, "routing_store_type": "response"},
                        rr_env={"FD_RR_RESPONSE__STREAM": "true"})


def routes_of(source, what: str):
    """The record a response (or the last stream chunk) carries; AssertionError without one."""
    try:
        return routes_from_response(source.model_dump() if hasattr(source, "model_dump") else source)
    except RecordError as exc:
        raise AssertionError(f"{what}: {exc}") from None


def check(ctx, choice, record) -> None:
    assert record.rollout_id == choice.rollout_id, (record.rollout_id, choice.rollout_id)
    assert record.ids.shape[1] == choice.forwarded, (record.ids.shape, choice.forwarded)
    ctx.assert_rows_exact(record.ids, choice.token_ids, choice.rollout_id)


def scenario_response(ctx, api: str, stream: bool) -> None:
    t = uuid.uuid4().hex[:8]
    client = ctx.server.client()
    extra = {"collect_metrics": True} if stream else {}
    if api == "chat":
        [choice] = chat(client, [{"role": "user", "content": f"Respond about {t}."}], f"resp_{t}:0:0",
                        stream=stream, max_tokens=20, temperature=0, extra_body=extra)
    else:
        [choice] = complete(client, f"Respond about {t}.", f"resp_{t}:0:0", stream=stream, max_tokens=20,
                            temperature=0, extra_body=extra)
    source = choice.last_chunk if stream else choice.response
    assert source is not None, "no final chunk / response"
    check(ctx, choice, routes_of(source, f"{api} {'stream' if stream else 'response'}"))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["chat", "completion"])
def test_the_response_carries_the_exact_record(ctx, api, stream):
    scenario_response(ctx, api, stream)


@pytest.mark.parametrize(("stream", "plant"), [(True, "stream_routes_dropped"), (False, "hook_skips_layer"),
                                               (True, "slot_off_by_one")])
def test_a_planted_bug_fails_the_response_check(ctx, stream, plant):
    ctx.server.plant(plant)
    try:
        with pytest.raises(AssertionError):
            scenario_response(ctx, "chat", stream)
    finally:
        ctx.server.plant(None)
