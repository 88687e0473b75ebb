"""Every ```python example of docs/*.md runs, each in a fresh interpreter.

docs/trainer.md's examples run as one script in tests/trainers/test_trainer_doc.py and the
README's in tests/test_readme.py; this file runs every other one it finds, as written.  An
example that needs what its page leaves to the reader gets it from a :class:`Runner`
here, outside the block:

- a prelude for names the surrounding text says come from elsewhere (FastDeploy's
  response, the engine's block table, the bytes of a record);
- a throwaway server on loopback where the example names 10.0.0.5 (P2PStore over TCP:
  no RDMA NIC here);
- environment variables for the configuration an example leaves to its reader.

A new example runs as written; one that cannot fails until it gets a Runner.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_ELSEWHERE = {"docs/trainer.md": "tests/trainers/test_trainer_doc.py",
                 "README.md": "tests/test_readme.py"}
REMOTE_REDIS = "redis://10.0.0.5:6379/0"

RECORD_BYTES = """\
import numpy as np
from fd_routing_replay.codec import RoutingRecord, encode_record
record_bytes = encode_record(RoutingRecord(
    "exp_a_7:0:0", np.zeros((2, 5, 2), dtype=np.uint8) + np.array([0, 1], dtype=np.uint8), 8))
"""

FASTDEPLOY_RESPONSE = """\
# FastDeploy 2.6's response in "response" mode: routed_experts is the base64 of a record.
import base64, types
import numpy as np
from fd_routing_replay.codec import RoutingRecord, encode_record
response = types.SimpleNamespace(routed_experts=base64.b64encode(encode_record(RoutingRecord(
    "exp_a_7:0:0", np.ones((2, 6, 2), dtype=np.uint8) * np.array([2, 5], dtype=np.uint8), 8,
    layers=(1, 3)))).decode("ascii"))
"""

FASTDEPLOY_STREAM = """\
# FastDeploy's OpenAI server with response.stream on, as the openai client streams it: the
# last chunk (finish_reason set) carries the record in its top-level metrics
# (ChatCompletionStreamResponse.metrics, FastDeploy 2.6 protocol.py:347-358).
import base64, types
import numpy as np
from fd_routing_replay.codec import RoutingRecord, encode_record
_routes = base64.b64encode(encode_record(RoutingRecord(
    "exp_4:2:0", np.tile(np.array([1, 3], dtype=np.uint8), (4, 24, 1)), 8))).decode("ascii")

class _Chunk:
    def __init__(self, finish_reason, metrics):
        self.choices = [types.SimpleNamespace(finish_reason=finish_reason)]
        self._data = {"id": "chatcmpl-exp_4:2:0", "object": "chat.completion.chunk",
                      "model": "tiny-moe", "metrics": metrics,
                      "choices": [{"index": 0, "delta": {"content": "x"},
                                   "finish_reason": finish_reason}]}

    def model_dump(self):
        return self._data

class _Completions:
    def create(self, *, model, messages, user, stream, extra_body):
        assert stream and extra_body == {"collect_metrics": True} and user == "exp_4:2:0"
        yield _Chunk(None, {"first_token_time": 0.1})
        yield _Chunk("stop", {"first_token_time": 0.1, "routed_experts": _routes})

client = types.SimpleNamespace(chat=types.SimpleNamespace(completions=_Completions()))
model, messages, rollout_id = "tiny-moe", [{"role": "user", "content": "hi"}], "exp_4:2:0"
"""

STORED_REFERENCE = """\
# The engine's writer stored the record in its Redis, and the response carries a reference.
import base64
import numpy as np
from fd_routing_replay.codec import RoutingRecord, encode_record, read_header
from fd_routing_replay.codec.reference import reference_for_header
from fd_routing_replay.store import open_store
_data = encode_record(RoutingRecord(
    "exp_4:2:0", np.tile(np.array([1, 3], dtype=np.uint16), (4, 24, 1)), 8))
_engine_store = open_store("{redis}")
_engine_store.put("exp_4:2:0", _data)
reference_dict_or_json = reference_for_header(read_header(_data),
                                              namespace=_engine_store.namespace).to_dict()
response = {"routed_experts": base64.b64encode(
    reference_for_header(read_header(_data), namespace=_engine_store.namespace)
    .to_json().encode()).decode("ascii")}
"""

ENGINE_INPUTS = """\
# What FastDeploy's model runner holds: its KV block count, TP rank and share_inputs.
import paddle
num_gpu_blocks = 64
tp_rank = 0
share_inputs = {"block_tables": paddle.full([256, 512], -1, dtype="int32")}
"""


@dataclass
class Runner:
    """How one example runs: a prelude, text replacements applied to the block, extra
    environment variables (``{tmp}`` is the test's temporary directory), and a check
    appended after it."""

    prelude: str = ""
    replace: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    check: str = ""
    server: str | None = None            # "redis" or "p2pstore": needs a throwaway Redis


# Keyed by (page, the block's first line).
RUNNERS: dict[tuple[str, str], Runner] = {
    ("docs/capture.md", "from fd_routing_replay.capture.fd25 import create_manager"):
        Runner(prelude=ENGINE_INPUTS,
               env={"FD_RR_ENABLED": "true", "FD_RR_STORE__LOCAL__ROOT": "{tmp}/records"},
               check="assert type(manager).__name__ == 'RoutingReplayManager'"),
    ("docs/config.md", "from fd_routing_replay.config import load_config"):
        Runner(check="assert cfg.store.namespace == 'exp_7'"),
    ("docs/config.md", "from fd_routing_replay.config import config_from_fastdeploy, load_config"):
        Runner(check="assert cfg.enabled"),
    ("docs/fastdeploy.md", "import base64"):
        Runner(prelude=FASTDEPLOY_RESPONSE,
               check="assert record.ids.shape == (2, 6, 2) and record.layers == (1, 3)"),
    ("docs/fastdeploy.md", "import json"):
        Runner(prelude=FASTDEPLOY_STREAM,
               check="assert record.rollout_id == 'exp_4:2:0' and record.ids.shape == (4, 24, 2)"),
    ("docs/fastdeploy.md", "from fd_routing_replay import RoutingReader, routes_from_response"):
        Runner(prelude=STORED_REFERENCE, server="redis",
               replace={"redis://alice:secret@10.0.0.5:6379/0": "{redis}"},
               check="assert record.rollout_id == 'exp_4:2:0' and record.ids.shape == (4, 24, 2)"),
    ("docs/record-format.md", "import numpy as np"): Runner(),
    ("docs/stores.md", "from fd_routing_replay.store import open_store"):
        Runner(prelude=RECORD_BYTES, server="redis", replace={REMOTE_REDIS: "{redis}"},
               check="assert store.list() == []"),
    ("docs/stores.md", "from fd_routing_replay.reader import RoutingReader"):
        Runner(server="p2pstore",
               replace={f'{{"metadata_server": "{REMOTE_REDIS}"}}':
                        '{"metadata_server": "{redis}", "protocol": "tcp", "log_dir": "{tmp}"}'},
               check="assert record is None"),
    ("docs/stores.md", "# my_package/nfs_store.py"):
        Runner(check="assert BACKEND.name == 'nfs' and NfsStoreConfig().retries == 3"),
}


def python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S)


def doc_pages() -> list[str]:
    return sorted(str(path.relative_to(ROOT)) for path in (ROOT / "docs").glob("*.md"))


def doc_examples() -> list[tuple[str, str]]:
    """(page, first line) of every example this file runs."""
    found = []
    for page in doc_pages():
        if page in RUN_ELSEWHERE:
            continue
        for block in python_blocks(page):
            key = (page, block.splitlines()[0])
            if key in found:
                raise AssertionError(f"two examples of {page} start with {key[1]!r}")
            found.append(key)
    return found


EXAMPLES = doc_examples()


def test_runners_match_the_docs():
    assert sorted(set(RUNNERS) - set(EXAMPLES)) == [], "runners for examples that are gone"
    assert len(EXAMPLES) >= 8
    for page, test in RUN_ELSEWHERE.items():
        assert python_blocks(page) and (ROOT / test).exists()


def run_example(key: tuple[str, str], tmp_path: Path, redis_url: str = "") -> None:
    page, first = key
    runner = RUNNERS.get(key, Runner())
    (block,) = [b for b in python_blocks(page) if b.splitlines()[0] == first]

    def fill(text: str) -> str:
        return text.replace("{tmp}", str(tmp_path)).replace("{redis}", redis_url)

    for old, new in runner.replace.items():
        assert old in block, f"{page}: the example no longer contains {old!r}"
        block = block.replace(old, fill(new))
    ast.parse(block)
    script = tmp_path / "example.py"
    script.write_text(f"{fill(runner.prelude)}\n{block}\n{runner.check}\n"
                      "print('example finished')\n")
    # The configuration is the example's (and its Runner's), not this shell's; the ops
    # settings (FD_RR_OPS, FD_RR_OPS_*) stay.
    env = {key: value for key, value in os.environ.items()
           if key != "FD_ROUTING_REPLAY_CONFIG"
           and not (key.startswith("FD_RR_") and not key.startswith("FD_RR_OPS"))}
    env.update({key: fill(value) for key, value in runner.env.items()})
    env["PYTHONPATH"] = str(tmp_path)            # the backend example's my_package, if any
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0, (
        f"{page}: the example starting {first!r} failed as run by tests/test_doc_examples.py "
        "(one that needs names or servers its page leaves to the reader gets a Runner there)"
        f"\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    assert done.stdout.strip().endswith("example finished")


@pytest.mark.parametrize("key", EXAMPLES, ids=[f"{page}:{first[:40]}" for page, first in EXAMPLES])
def test_doc_example_runs(key, tmp_path, request):
    runner = RUNNERS.get(key, Runner())
    if "paddle" in runner.prelude and importlib.util.find_spec("paddle") is None:
        pytest.skip("paddle not installed")
    if runner.server == "p2pstore":
        missing = [name for name in ("p2pstore", "mooncake")
                   if importlib.util.find_spec(name) is None]
        if missing:
            pytest.skip(f"not installed: {', '.join(missing)} "
                        "(pip install 'fd-routing-replay[p2pstore]')")
    redis_url = request.getfixturevalue("redis_server_clean").url if runner.server else ""
    run_example(key, tmp_path, redis_url)
