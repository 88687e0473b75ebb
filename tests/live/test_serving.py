"""The plugin in FastDeploy 2.6's real server, store mode: every record against the recompute.

One server (local store, ``only_last_turn``, partial records every 16 positions, overlap
scheduling and prefix caching on, a 64-token step budget so long prompts are chunked).  Each
scenario is a function the clean test runs and the planted test runs again with a bug
switched on (tests/live/plants.py), expecting its check to fail.
"""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest

from .client import chat, complete
from .rig import ServerOptions

OPTIONS = ServerOptions(
    max_num_batched_tokens=64, routing={"enable_routing_replay": True, "only_last_turn": True},
    rr_env={"FD_RR_WRITER__CAPACITY_BYTES": "32MiB", "FD_RR_CAPTURE__PARTIAL_EVERY_TOKENS": "16"})


def tag() -> str:
    return uuid.uuid4().hex[:8]


# ------------------------------------------------------------------ scenarios
def scenario_completion(ctx, stream: bool) -> None:
    t = tag()
    [choice] = complete(ctx.server.client(), f"Tell me about item {t}.", f"cmp_{t}:0:0", stream=stream,
                        max_tokens=24, temperature=0)
    assert choice.completion_ids, "the completion generated nothing"
    ctx.assert_exact(choice)


def scenario_chat(ctx, stream: bool) -> None:
    t = tag()
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": f"Describe {t}."}]
    [choice] = chat(ctx.server.client(), messages, f"chat_{t}:0:0", stream=stream, max_tokens=24, temperature=0)
    ctx.assert_exact(choice)


def scenario_n_choices(ctx) -> None:
    t = tag()
    choices = complete(ctx.server.client(), f"Two different answers about {t}", f"n_{t}:0:0", n=2,
                       max_tokens=20, temperature=1.0, top_p=0.9)
    assert [c.rollout_id for c in choices] == [f"n_{t}:0:0", f"n_{t}_n1:0:0"]
    assert choices[0].completion_ids != choices[1].completion_ids, "the two choices sampled the same tokens"
    for choice in choices:
        ctx.assert_exact(choice)


def scenario_chunked_prefill(ctx) -> None:
    t = tag()
    prompt = f"[{t}] " + "A prompt much longer than the step budget of sixty-four tokens. " * 4
    [choice] = complete(ctx.server.client(), prompt, f"long_{t}:0:0", max_tokens=12, temperature=0)
    assert len(choice.prompt_ids) > 3 * OPTIONS.max_num_batched_tokens, len(choice.prompt_ids)
    ctx.assert_exact(choice)


def scenario_prefix_cache(ctx) -> None:
    t = tag()
    system = f"[{t}] A system prompt every conversation of this test shares, long enough for whole blocks. " * 2
    client = ctx.server.client()
    choices = []
    for i in range(3):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}]
        choices.append(chat(client, messages, f"pc_{t}_{i}:0:0", max_tokens=10, temperature=0)[0])
    cached = [ctx.server.cached_tokens(c.rollout_id) for c in choices]
    assert cached[0] == 0 and all(n and n >= 3 * OPTIONS.block_size for n in cached[1:]), \
        f"prefix-cache hits (tokens) per request: {cached}"
    for choice in choices:
        ctx.assert_exact(choice)


def scenario_multi_turn(ctx) -> None:
    t = tag()
    client = ctx.server.client()
    history = [{"role": "user", "content": f"Start the conversation {t}."}]
    [turn0] = chat(client, history, f"mt_{t}:0:0", max_tokens=12, temperature=0)
    ctx.assert_exact(turn0)
    history += [{"role": "assistant", "content": turn0.text}, {"role": "user", "content": "And then?"}]
    [turn1] = chat(client, history, f"mt_{t}:1:0", max_tokens=12, temperature=0)
    ctx.assert_exact(turn1)
    # the writer deletes turn 0 once turn 1 is durable; a later request's record is the barrier
    [probe] = complete(client, f"probe after turn one {t}", f"mtprobe_{t}:0:0", max_tokens=4, temperature=0)
    assert ctx.wait_record(probe.rollout_id) is not None
    assert ctx.wait_gone(turn0.rollout_id, timeout=10), "only_last_turn kept turn 0 after turn 1 was stored"


def scenario_abort(ctx) -> None:
    """A running request aborted through FastDeploy's API, then retried under the same
    rollout id: no final record for the aborted run, its partial record exact, the retry's
    final record exact and its partial gone."""
    t = tag()
    rollout = f"ab_{t}:0:0"
    client = ctx.server.client()
    result: list = []
    worker = threading.Thread(target=lambda: result.append(complete(
        client, f"A long story about {t}", rollout, max_tokens=300, temperature=0,
        extra_body={"min_tokens": 290})))
    worker.start()
    partial = None
    while partial is None and worker.is_alive():          # running: its first partial record is stored
        partial = ctx.reader.get_partial(rollout)
        ctx.server.check_alive()
        time.sleep(0.02)
    httpx.post(f"{ctx.server.base_url}/v1/abort_requests", json={"abort_all": True}, timeout=30).raise_for_status()
    worker.join(120)
    [[aborted]] = result
    assert aborted.finish_reason == "abort", aborted.finish_reason
    [probe] = complete(client, f"probe after the abort {t}", f"probe_{t}:0:0", max_tokens=8, temperature=0)
    ctx.assert_no_record(rollout, barrier=probe)
    partial = ctx.reader.get_partial(rollout)
    assert partial is not None, "the aborted request's partial record is gone"
    ctx.assert_rows_exact(partial.ids, aborted.token_ids, f"{rollout} partial")
    [retry] = complete(client, f"A long story about {t}", rollout, max_tokens=20, temperature=0)
    ctx.assert_exact(retry)
    deadline = time.monotonic() + 60
    while ctx.reader.get_partial(rollout) is not None:    # the final supersedes the partial
        assert time.monotonic() < deadline, f"{rollout}: the partial record outlived the final"
        time.sleep(0.05)
    ctx.assert_exact(probe)


def scenario_disconnect(ctx) -> None:
    """A client that drops a stream: FastDeploy aborts the request; no final record, and the
    next requests (which reuse its batch slot and KV blocks) are exact."""
    t = tag()
    rollout = f"dc_{t}:0:0"
    client = ctx.server.client()
    stream = client.completions.create(model="default", prompt=f"Stream for {t}", user=rollout, stream=True,
                                       max_tokens=300, temperature=0,
                                       extra_body={"min_tokens": 290, "return_token_ids": True})
    streamed = []
    for chunk in stream:
        streamed += list(chunk.choices[0].completion_token_ids or []) if chunk.choices else []
        if len(streamed) >= 4:
            break
    stream.response.close()
    afterwards = [complete(client, f"After the disconnect {t} #{i}", f"after_{t}_{i}:0:0", max_tokens=16,
                           temperature=0)[0] for i in range(2)]
    ctx.assert_no_record(rollout, barrier=afterwards[-1])
    for choice in afterwards:
        ctx.assert_exact(choice)


SCENARIOS = {
    "completion": lambda ctx: scenario_completion(ctx, stream=False),
    "completion_stream": lambda ctx: scenario_completion(ctx, stream=True),
    "chat": lambda ctx: scenario_chat(ctx, stream=False),
    "chat_stream": lambda ctx: scenario_chat(ctx, stream=True),
    "n_choices": scenario_n_choices,
    "chunked_prefill": scenario_chunked_prefill,
    "prefix_cache": scenario_prefix_cache,
    "multi_turn": scenario_multi_turn,
    "abort": scenario_abort,
    "disconnect": scenario_disconnect,
}


# ------------------------------------------------------------------ tests
def test_the_plugins_start_up_lines_reach_fastdeploys_logs(ctx):
    scenario_completion(ctx, stream=False)                  # a first request: every process is up
    engine = (ctx.server.log_dir / "fastdeploy.log").read_text(errors="replace")
    worker = (ctx.server.log_dir / "gpu_worker.log").read_text(errors="replace")
    assert "fd-routing-replay: engine-side routing assembly ready" in engine
    assert "fd-routing-replay: installed StepRoutingCapturer" in worker


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(ctx, name):
    SCENARIOS[name](ctx)


PLANTED = [
    ("completion", "hook_skips_layer"),
    ("chat_stream", "slot_off_by_one"),
    ("n_choices", "choices_share_key"),
    ("chunked_prefill", "slot_off_by_one"),
    ("prefix_cache", "prefix_rows_wiped"),
    ("multi_turn", "keep_previous_turn"),
    ("abort", "abort_writes_final"),
    ("disconnect", "hook_skips_layer"),
]


@pytest.mark.parametrize(("name", "plant"), PLANTED)
def test_a_planted_bug_fails_the_scenario(ctx, name, plant):
    ctx.server.plant(plant)
    try:
        with pytest.raises(AssertionError):
            SCENARIOS[name](ctx)
    finally:
        ctx.server.plant(None)
    SCENARIOS[name](ctx)             # and passes again once the bug is switched off


# ------------------------------------------------------------------ a FastDeploy 2.6 finding (docs/fastdeploy.md)
def _usage(client, api: str, text: str, user: str, stream: bool):
    kwargs = {"model": "default", "user": user, "max_tokens": 4, "temperature": 0, "stream": stream}
    if stream:
        kwargs["stream_options"] = {"include_usage": True}
    if api == "chat":
        response = client.chat.completions.create(messages=[{"role": "user", "content": text}], **kwargs)
    else:
        response = client.completions.create(prompt=text, **kwargs)
    if not stream:
        return response.usage
    usage = [chunk.usage for chunk in response if chunk.usage is not None]
    assert usage, "the stream carried no usage"
    return usage[-1]


@pytest.mark.parametrize("stream", [False, True])
def test_fastdeploy_26_reports_prefix_cache_hits_for_chat_but_not_for_completions(ctx, stream):
    """/v1/completions reads ``num_cache_tokens`` from the engine's output
    (serving_completion.py:555, :770), which the engine calls ``num_cached_tokens``
    (request.py:1004-1022): its usage says 0 while FastDeploy's own log counts the hits."""
    client = ctx.server.client()
    for api in ("chat", "completion"):
        t = tag()
        prefix = f"[{t}] A shared prefix long enough to fill several KV blocks of sixteen tokens each. " * 2
        seen = []
        for i in range(2):
            user = f"ct_{api}_{t}_{i}:0:0"
            usage = _usage(client, api, prefix + f"question {i}", user, stream)
            seen.append((usage.prompt_tokens_details.cached_tokens or 0, ctx.server.cached_tokens(user)))
        (first_usage, first_log), (usage_hits, log_hits) = seen
        assert first_usage == first_log == 0, (api, seen)
        assert log_hits and log_hits >= 3 * OPTIONS.block_size, (api, seen)     # the prefix cache hit
        assert usage_hits == (log_hits if api == "chat" else 0), (api, seen)
