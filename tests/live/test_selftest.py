"""``fd-rr selftest`` against FastDeploy's real server in verification mode (``capture.verify``).

The selftest sends its workload (shared prefixes, a long prompt that chunks, ``n > 1``, two
turns) through FastDeploy's OpenAI API and checks every stored row against the pattern the
hook records (docs/fastdeploy.md, Self-check); with a planted bug it must fail and name the
first misplaced row.
"""

from __future__ import annotations

import json
import subprocess
import sys

from .rig import ServerOptions

OPTIONS = ServerOptions(rr_env={"FD_RR_CAPTURE__VERIFY": "true", "FD_RR_WRITER__CAPACITY_BYTES": "32MiB"})


def selftest(server) -> tuple[int, dict, str]:
    command = [sys.executable, "-m", "fd_routing_replay.cli", "selftest", "--url", server.base_url,
               "--store", server.store_url, "--shared-prefix-words", "12", "--long-prompt-words", "40",
               "--max-tokens", "12", "--timeout", "30", "--request-timeout", "120", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        report = {}
    return done.returncode, report, done.stdout + done.stderr


def checks(report: dict) -> dict[str, str]:
    return {c["name"]: c["status"].upper() for c in report.get("checks", [])}


def test_selftest_passes_against_the_live_server(server):
    code, report, output = selftest(server)
    assert code == 0, output
    status = checks(report)
    for name in ("requests", "records", "token_counts", "complete_rows", "recorded_values", "positions",
                 "layer_rows", "prefix_cache", "chunked_prefill", "n_choices", "multi_turn"):
        assert status.get(name) == "PASS", f"{name}: {status.get(name)}\n{output}"
    assert status.get("tp_ep_gather") == "SKIP", output                  # one worker, TP 1


def test_selftest_fails_on_a_wrong_slot_and_names_the_row(server):
    server.plant("slot_off_by_one")
    try:
        code, report, output = selftest(server)
    finally:
        server.plant(None)
    assert code == 1, output
    assert checks(report).get("positions") == "FAIL", output
    assert "holds the row of position" in output, output      # the first misplaced row, named
