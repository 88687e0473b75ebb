"""End to end inside FastDeploy, in FastDeploy's CI style (runs only where FastDeploy is).

Starts FastDeploy's OpenAI API server with the plugin (``FD_PLUGINS=fd_routing_replay``)
and ``--routing-replay-config``, sends multi-turn chat requests whose ``user`` field is the
rollout id, and checks the stored records: one fused record per rollout, ``[layers,
tokens, top_k]`` with tokens = prompt + completion - 1 (every forwarded position), ids in
range, ``only_last_turn`` honoured, and — as FastDeploy's own R3 test does — top-k set
overlap ≥ 0.999 between two identical greedy requests.

Needs: FastDeploy (GPU build) importable, a GPU, and ``FD_RR_TEST_MODEL`` pointing at a
small MoE checkpoint FastDeploy serves (e.g. ERNIE-4.5-21B-A3B-Paddle or a Qwen3 MoE).
Skipped otherwise, with the reason.  This test has not run in this repository's CI.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest


def _fastdeploy_llm_available() -> bool:
    """FastDeploy's LLM server is findable (without importing it: it parses argv at import)."""
    try:
        return importlib.util.find_spec("fastdeploy.entrypoints.openai.api_server") is not None
    except (ImportError, ValueError):
        return False


MODEL = os.environ.get("FD_RR_TEST_MODEL")
pytestmark = [
    pytest.mark.fastdeploy,
    pytest.mark.gpu,
    pytest.mark.skipif(not _fastdeploy_llm_available(),
                       reason="FastDeploy (LLM GPU build) is not installed; the end-to-end test needs it"),
    pytest.mark.skipif(not MODEL, reason="set FD_RR_TEST_MODEL to a MoE model directory to run"),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fd_e2e")
    config = tmp / "rr.yaml"
    config.write_text(f"store:\n  type: local\n  namespace: e2e\n  local:\n    root: {tmp / 'store'}\n"
                      f"writer:\n  journal_dir: {tmp / 'journal'}\n  dead_letter_dir: {tmp / 'dead'}\n")
    port = free_port()
    env = dict(os.environ, FD_PLUGINS="fd_routing_replay", FD_ROUTING_REPLAY_CONFIG=str(config))
    command = [
        sys.executable, "-m", "fastdeploy.entrypoints.openai.api_server",
        "--model", MODEL, "--port", str(port),
        "--engine-worker-queue-port", str(free_port()), "--metrics-port", str(free_port()),
        "--max-model-len", "8192", "--max-num-seqs", "8", "--enable-prefix-caching",
        "--routing-replay-config", json.dumps({"enable_routing_replay": True,
                                               "only_last_turn": True, "use_fused_put": True}),
    ]
    log = open(tmp / "server.log", "wb")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"FastDeploy exited with {process.returncode}; see {tmp / 'server.log'}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                time.sleep(2)
        else:
            pytest.fail("FastDeploy did not become healthy in 900 s")
        yield base, config
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()


def chat(base: str, user: str, messages: list[dict]) -> dict:
    return post(f"{base}/v1/chat/completions", {
        "model": "default", "messages": messages, "user": user, "max_tokens": 48,
        "temperature": 0, "top_p": 0.0001})


def reader_for(config: Path):
    from fd_routing_replay.config import load_config
    from fd_routing_replay.reader import RoutingReader

    return RoutingReader(load_config(config, env={}).store)


def test_records_cover_every_forwarded_token_and_keep_only_last_turn(server):
    base, config = server
    messages = [{"role": "user", "content": "Name three prime numbers and explain why."}]
    first = chat(base, "e2e_0:0:0:0", messages)
    messages += [first["choices"][0]["message"],
                 {"role": "user", "content": "Now name three more."}]
    second = chat(base, "e2e_0:0:1:0", messages)
    with reader_for(config) as reader:
        record = reader.wait("e2e_0:0:1:0", timeout=120)
        usage = second["usage"]
        assert record.num_tokens == usage["prompt_tokens"] + usage["completion_tokens"] - 1
        assert int(record.ids.max()) < record.num_experts
        deadline = time.monotonic() + 60
        while reader.get("e2e_0:0:0:0") is not None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert reader.get("e2e_0:0:0:0") is None, "only_last_turn did not delete turn 0"


def test_identical_greedy_requests_route_identically(server):
    base, config = server
    messages = [{"role": "user", "content": "Write a haiku about mixture-of-experts routing."}]
    chat(base, "e2e_1:0:0:0", messages)
    chat(base, "e2e_1:1:0:0", messages)
    with reader_for(config) as reader:
        a = reader.wait("e2e_1:0:0:0", timeout=120).ids
        b = reader.wait("e2e_1:1:0:0", timeout=120).ids
    tokens = min(a.shape[1], b.shape[1])
    same = (np.sort(a[:, :tokens], -1) == np.sort(b[:, :tokens], -1)).all(-1)
    assert same.mean() >= 0.999, f"top-k set agreement {same.mean():.4f}"
