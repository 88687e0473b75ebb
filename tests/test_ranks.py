"""The multi-rank launcher (fdrr_dev.testing.ranks): real ranks, real collectives,
a failing rank fails with its log, a hanging one is killed, nothing is left running."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("paddle.distributed.launch", reason="Paddle's launcher is not installed")

from fdrr_dev.testing.ranks import RanksFailed, launch_ranks, processes_with_token  # noqa: E402

GATHER = """
import json, os, sys
import paddle, paddle.distributed as dist
dist.init_parallel_env()
rank = dist.get_rank()
group = dist.new_group(list(range(dist.get_world_size())))
rows = paddle.to_tensor([[rank * 10 + 1, rank * 10 + 2]], dtype="int64")
out = paddle.zeros([dist.get_world_size(), 2], dtype="int64")
dist.all_gather(out, rows, group)
open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w").write(json.dumps(out.numpy().tolist()))
"""

FAILS = """
import paddle.distributed as dist
dist.init_parallel_env()
if dist.get_rank() == 1:
    print("rank 1 gives up: marker-7f3a", flush=True)
    raise SystemExit(3)
"""

HANGS = """
import subprocess, sys, threading
import paddle.distributed as dist
dist.init_parallel_env()
# a grandchild that would outlive its rank, then a rank that never finishes
subprocess.Popen([sys.executable, "-c", "import threading; threading.Event().wait()"])
print("hanging: marker-51c2", flush=True)
threading.Event().wait()
"""


def script(tmp_path, text):
    path = tmp_path / "rank_script.py"
    path.write_text(textwrap.dedent(text))
    return path


def test_two_ranks_all_gather_over_loopback(tmp_path):
    run = launch_ranks(script(tmp_path, GATHER), 2, log_dir=tmp_path / "log", args=[str(tmp_path)],
                       python=sys.executable, timeout_s=120)
    import json

    for rank in range(2):
        got = np.array(json.loads((tmp_path / f"rank{rank}.json").read_text()))
        np.testing.assert_array_equal(got, [[1, 2], [11, 12]])
    assert run.returncode == 0
    assert processes_with_token(run.token) == []


def test_a_failing_rank_fails_the_run_with_its_log(tmp_path):
    with pytest.raises(RanksFailed) as failed:
        launch_ranks(script(tmp_path, FAILS), 2, log_dir=tmp_path / "log", python=sys.executable,
                     timeout_s=120)
    assert "marker-7f3a" in str(failed.value) and "--- rank 1 log tail ---" in str(failed.value)
    assert "--- rank 0" in str(failed.value)
    # The message leads with which rank failed, its exit code and its last log line.
    summary = str(failed.value).splitlines()[1:3]
    assert summary[1] == "rank 1 (failed, exit code 3): rank 1 gives up: marker-7f3a", summary
    assert summary[0].startswith("rank 0 ("), summary
    assert failed.value.run.failed_ranks().get(1) == 3
    assert processes_with_token(failed.value.run.token) == []


def test_a_hanging_run_is_killed_with_everything_it_started(tmp_path):
    with pytest.raises(RanksFailed, match="still running after 20 s") as failed:
        launch_ranks(script(tmp_path, HANGS), 2, log_dir=tmp_path / "log", python=sys.executable,
                     timeout_s=20)
    assert processes_with_token(failed.value.run.token) == []
