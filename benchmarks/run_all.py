"""Run every ``benchmarks/bench_*.py`` in turn and collect their markdown tables.

Usage: python benchmarks/run_all.py [--quick] [--only NAME ...]
The combined report goes to stdout and to ``bench_output/report.md``; the numbers in
docs/benchmarks.md were produced this way.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="pass --quick to every script")
    parser.add_argument("--only", nargs="*", default=None, help="script names, e.g. bench_codec")
    args = parser.parse_args()
    scripts = sorted(HERE.glob("bench_*.py"))
    if args.only:
        scripts = [s for s in scripts if s.stem in args.only]
    report = [f"# Benchmark report ({time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, "
              f"{platform.processor() or platform.machine()}, Python {platform.python_version()})\n"]
    failed = []
    for script in scripts:
        command = [sys.executable, str(script)] + (["--quick"] if args.quick else [])
        print(f"## {script.name}\n", flush=True)
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        elapsed = time.perf_counter() - started
        body = done.stdout.strip()
        if done.returncode != 0:
            failed.append(script.name)
            body += f"\n\n**failed (exit {done.returncode})**\n```\n{done.stderr[-3000:]}\n```"
        section = f"## {script.name}\n\n`{' '.join(['python', *command[1:]])}` ({elapsed:.0f} s)\n\n{body}\n"
        print(section, flush=True)
        report.append(section)
    out = Path("bench_output")
    out.mkdir(exist_ok=True)
    (out / "report.md").write_text("\n".join(report))
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
