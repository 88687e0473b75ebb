"""Preemption: too few KV blocks for the batch, overlap scheduling off, records in Redis.

FastDeploy's V1 scheduler preempts a running request when a decoding one needs a block and
none is free (engine/sched/resource_manager_v1.py:374-430): the preempted request's blocks
are freed and it is prefilled again later, in other blocks.  32 blocks of 16 tokens hold
about two of the four concurrent requests (each needs ~13), so preemption must happen; the
test checks FastDeploy says it did, then every record against the recompute.
"""

from __future__ import annotations

import threading
import uuid

import pytest

from .client import complete
from .rig import ServerOptions
from .test_serving import scenario_chat, scenario_completion


def make_options(request) -> ServerOptions:
    return ServerOptions(
        overlap=False, num_gpu_blocks=32, max_model_len=384, max_num_seqs=4, max_num_batched_tokens=64,
        rr_env={"FD_RR_WRITER__CAPACITY_BYTES": "32MiB", "FD_RR_STORE__TYPE": "redis",
                "FD_RR_STORE__REDIS__URL": request.getfixturevalue("redis_url")})


def preempted_requests(server) -> list[str]:
    log = (server.log_dir / "fastdeploy.log").read_text(errors="replace")
    return [line.rsplit("Preempted request id: ", 1)[1].strip() for line in log.splitlines()
            if "Preemption is triggered! Preempted request id: " in line]


def scenario_preemption(ctx) -> None:
    t = uuid.uuid4().hex[:8]
    before = len(preempted_requests(ctx.server))
    client = ctx.server.client()
    results: dict[int, list] = {}

    def run(i: int) -> None:
        results[i] = complete(client, f"Request {i} of {t} wants a long answer about topic {i * 7}.",
                              f"pre_{t}_{i}:0:0", max_tokens=150, temperature=0, extra_body={"min_tokens": 140})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert sorted(results) == [0, 1, 2, 3], f"requests answered: {sorted(results)}"
    preempted = preempted_requests(ctx.server)[before:]
    assert any(f"pre_{t}_" in request_id for request_id in preempted), \
        f"FastDeploy preempted none of this run's requests (preempted: {preempted})"
    for i in range(4):
        ctx.assert_exact(results[i][0])


def test_preemption_keeps_every_record_exact(ctx):
    scenario_preemption(ctx)


@pytest.mark.parametrize("stream", [False, True])
def test_overlap_off_serves_exact_records(ctx, stream):
    scenario_completion(ctx, stream=stream)
    scenario_chat(ctx, stream=not stream)


def test_a_stale_block_table_fails_the_preemption_check(ctx):
    ctx.server.plant("stale_block_table")
    try:
        with pytest.raises(AssertionError):
            scenario_preemption(ctx)
    finally:
        ctx.server.plant(None)


def test_a_wrong_slot_fails_with_overlap_off(ctx):
    ctx.server.plant("slot_off_by_one")
    try:
        with pytest.raises(AssertionError):
            scenario_completion(ctx, stream=False)
    finally:
        ctx.server.plant(None)
