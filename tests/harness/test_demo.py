"""``fd-rr demo`` on a small workload: exit status, summary, heatmap, progress output."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from fdrr_dev.harness import demo

ROOT = Path(__file__).resolve().parents[2]


def run_demo(tmp_path: Path, *extra: str) -> tuple[int, dict]:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--output", str(tmp_path / "out"), "--rollouts", "8", "--turns", "2",
                              "--writer-mode", "thread", *extra])
    code = demo.run(args)
    return code, json.loads((tmp_path / "out" / "summary.json").read_text())


def test_demo_passes_and_writes_its_outputs(tmp_path, capsys):
    code, summary = run_demo(tmp_path)
    out = capsys.readouterr()
    assert code == 0, out.out
    assert summary["passed"] and summary["requests"] == 16 and summary["records_kept"] == 8
    assert summary["agreement"] > 0.99 and summary["decisive_disagreements"] == 0
    assert (tmp_path / "out" / "expert_load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "fidelity agreement" in out.out and "PASS" in out.out
    assert "rollouts (capture on+off)" in out.err                   # progress lines
    # the overhead figure is the paired one, and says so (not raw wall clock)
    assert "paired steps" in out.out and "lockstep" in out.out and "wall" not in out.out
    assert isinstance(summary["capture_overhead"], float) and "capture_overhead_total" in summary
    # a rerun into the same directory starts from a clean namespace
    code, again = run_demo(tmp_path, "--no-plot")
    assert code == 0 and again["records_kept"] == 8 and again["heatmap"] is None


def test_demo_rejects_bad_arguments(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert demo.run(parser.parse_args(["--rollouts", "0", "--output", str(tmp_path)])) == demo.EXIT_USAGE
    assert "--rollouts" in capsys.readouterr().err


def test_demo_module_is_runnable():
    result = subprocess.run([sys.executable, "-m", "fdrr_dev.harness.demo", "--help"],
                            cwd=ROOT, capture_output=True, text=True, check=True)
    assert "--output" in result.stdout
