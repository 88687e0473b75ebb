"""Routes by reference: the response carries a small reference, the record goes to the store.

``routing_store_type: response`` with ``response.routes: reference`` (and ``response.stream``),
the local store, overlap scheduling off.  The client resolves each reference through a reader
of the engine's store (``routes_from_response(..., reader)``), which checks the stored record
against the reference's checksum, size and shape; the record is then checked against the
recompute.
"""

from __future__ import annotations

import uuid

import pytest

from fd_routing_replay import routes_from_response
from fd_routing_replay.errors import RecordError

from .client import chat, complete
from .rig import ServerOptions
from .test_response import check

OPTIONS = ServerOptions(overlap=False, routing={"enable_routing_replay": True, "routing_store_type": "response"},
                        rr_env={"FD_RR_RESPONSE__ROUTES": "reference", "FD_RR_RESPONSE__STREAM": "true",
                                "FD_RR_WRITER__CAPACITY_BYTES": "32MiB"})


def scenario_reference(ctx, stream: bool, timeout: float = 20.0) -> None:
    t = uuid.uuid4().hex[:8]
    client = ctx.server.client()
    extra = {"collect_metrics": True} if stream else {}
    if stream:
        [choice] = chat(client, [{"role": "user", "content": f"Refer to {t}."}], f"ref_{t}:0:0", stream=True,
                        max_tokens=20, temperature=0, extra_body=extra)
    else:
        [choice] = complete(client, f"Refer to {t}.", f"ref_{t}:0:0", max_tokens=20, temperature=0)
    source = choice.last_chunk if stream else choice.response
    try:
        record = routes_from_response(source.model_dump(), ctx.reader, timeout=timeout)
    except RecordError as exc:
        raise AssertionError(f"{choice.rollout_id}: {exc}") from None
    check(ctx, choice, record)
    assert ctx.reader.get(choice.rollout_id) is not None     # the record itself is in the store


@pytest.mark.parametrize("stream", [False, True])
def test_a_reference_resolves_to_the_exact_stored_record(ctx, stream):
    scenario_reference(ctx, stream)


def test_a_tampered_reference_is_refused(ctx):
    ctx.server.plant("reference_tampered")
    try:
        with pytest.raises(AssertionError, match="checksum"):
            scenario_reference(ctx, stream=False, timeout=3)   # the record is stored within a few steps
    finally:
        ctx.server.plant(None)
