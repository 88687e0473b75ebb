"""Run the soak: every scenario of the chosen form, one report; exit status 1 when any
record was lost or corrupt, a drop went unnamed, or a deleted record came back.

    python -m benchmarks.soak.run --short        # CI (make soak-short): a few minutes
    python -m benchmarks.soak.run                # the long form (make soak)
    python -m benchmarks.soak.run --stores redis --scenarios steady,redis-pause

The report (markdown) goes to stdout and ``OUT/report.md``, every scenario's summary to
``OUT/summary.json``; each scenario's event files stay in ``OUT/<store>-<scenario>/``
with ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.soak.scenario import Scenario, ScenarioRun
from benchmarks.soak.stores import STORES, TmpfsUnavailable

__all__ = ["long_matrix", "main", "short_matrix"]

MiB = 2**20


def short_matrix() -> list[Scenario]:
    """CI's form: the faults that matter most, 2 producers (plain single-turn, and
    multi-turn with only_last_turn), 2 trainers, small rings, about 3 minutes here."""
    common = {"producers": 2, "trainers": 2, "kinds": ("a", "x"), "rate": 2.0,
              "step_s": 2.0, "grace_s": 60,
              "writer": {"capacity_bytes": 64 * MiB}}
    return [
        Scenario("worker-kill", "local", duration_s=16, fault="worker-kill", fault_at_s=6,
                 **common),
        Scenario("reader-kill", "local", duration_s=12, fault="reader-kill", fault_at_s=5,
                 **common),
        Scenario("disk-full", "local", duration_s=20, fault="disk-full", fault_at_s=5,
                 fault_args={"hold_s": 5}, tmpfs_bytes=256 * MiB, **common),
        Scenario("redis-pause", "redis", duration_s=26, fault="redis-pause", fault_at_s=4,
                 fault_args={"pause_s": 6.5, "gap_s": 2, "down_s": 1}, persist=True, **common),
        Scenario("master-restart", "mooncake", duration_s=18, fault="master-restart",
                 fault_at_s=6, fault_args={"down_s": 1}, **common),
    ]


def long_matrix(stores: list[str]) -> list[Scenario]:
    """The long form, per store: a steady run at an offered rate; a saturating run
    (``full_policy: block``, as fast as accepted) measured against the store's raw limit;
    an overload at 1.5× what the saturating run sustained, under the default ``spill``;
    the store's faults; and, on the local store and P2PStore, FastDeploy 2.6's own store
    path at the steady run's offered load."""
    common = {"producers": 4, "trainers": 2, "kinds": ("a", "m", "e", "x"),
              "step_s": 2.0, "grace_s": 120,
              "writer": {"capacity_bytes": 256 * MiB}}
    plain = {**common, "kinds": ("a", "m")}  # the raw limit writes plain ids: so do these
    faults = {
        "local": [("worker-kill", {}), ("reader-kill", {}), ("disk-full", {"hold_s": 8})],
        "redis": [("worker-kill", {}), ("reader-kill", {}),
                  ("redis-pause", {"pause_s": 8, "gap_s": 4, "down_s": 2})],
        "redis-cluster": [("redis-pause", {"pause_s": 8, "gap_s": 4, "down_s": 2})],
        "mooncake": [("worker-kill", {}), ("master-restart", {"down_s": 2})],
        "p2pstore": [("reader-kill", {}), ("provider-kill", {})],
    }
    out = []
    for store in stores:
        out.append(Scenario("steady", store, rate=3.0, duration_s=60, **common))
        out.append(Scenario("saturate", store, rate=0.0, duration_s=30, raw_s=12,
                            **{**plain, "writer": {**plain["writer"], "full_policy": "block",
                                                   "block_timeout_s": 60}}))
        out.append(Scenario("overload", store, rate=0.0, duration_s=30,
                            extra={"rate_from_saturate": 1.5}, **plain))
        for fault, args in faults[store]:
            out.append(Scenario(fault, store, rate=3.0, duration_s=45, fault=fault,
                                fault_at_s=15, fault_args=args,
                                persist=fault == "redis-pause",
                                tmpfs_bytes=512 * MiB if fault == "disk-full" else 0,
                                **common))
        if store in ("local", "p2pstore"):
            out.append(Scenario("fastdeploy", store, rate=3.0, duration_s=60, fastdeploy=True,
                                **common))
    return out


# -- the report ------------------------------------------------------------------------------

def _f(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}"


def _pair(values: list[float], digits: int = 1) -> str:
    return " / ".join(_f(v, digits) for v in values[:2]) if values else "–"


def report(summaries: list[dict[str, Any]]) -> str:
    rows = ["| store | scenario | submitted | accepted | durable | read intact | retired | "
            "dropped: named + unnamed | dead letters | in journal at close | lost with store | "
            "lost | corrupt | resurrected | verdict |", "|" + "---|" * 15]
    for s in summaries:
        if "error" in s:
            rows.append(f"| {s['store']} | {s['scenario']} | {s['error']} |" + " |" * 12
                        + " **FAILED** |")
            continue
        rows.append(
            f"| {s['store']} | {s['scenario']} | {s['submitted']} | {s['accepted']} | "
            f"{s['durable']} | {s['read_intact']} | {s['retired']} | "
            f"{s['dropped']} + {s['dropped_unnamed']} | "
            f"{s['dead_lettered']} | {s['journaled']} | {s['lost_with_store']} | {s['lost']} | "
            f"{s['corrupt']} | "
            f"{len(s['leftovers'])} | {'ok' if s['ok'] else '**FAILED**'} |")
    perf = ["| store | scenario | offered rec/s | records/s | MB/s | raw MB/s alone / with the "
            "rig's work (ratios) | submit p50 / p99 / max ms | durable p50 / p99 ms | submit→read "
            "p50 / p99 ms | read get p50 / p99 ms | read slice p50 / p99 ms | delete p50 / p99 ms "
            "| Redis cmd p99 / max µs during deletes: all / without payload copies | spilled | restarts | retries | read errors |",
            "|" + "---|" * 17]
    for s in summaries:
        if "error" in s:
            continue
        raw = s.get("raw")
        raw_text = (f"{_f(raw['alone']['mb_per_s'], 0)} / {_f(raw['with_rig']['mb_per_s'], 0)} "
                    f"({s['raw_ratio']['alone']:.2f}× / {s['raw_ratio']['with_rig']:.2f}×)"
                    if raw else "–")
        cmd = s.get("redis_command_us") or []
        other = s.get("redis_other_command_us") or []
        cmd_text = (f"{_f(cmd[1], 0)} / {_f(cmd[2], 0)}; {_f(other[1], 0)} / {_f(other[2], 0)}"
                    if len(cmd) == 3 and len(other) == 3 else "–")
        offered = s.get("offered_records_per_s") or 0
        w = s["writer"]
        perf.append(
            f"| {s['store']} | {s['scenario']} | {_f(offered) if offered else 'max'} | "
            f"{_f(s['records_per_s'])} | {_f(s['mb_per_s'])} | {raw_text} | "
            f"{' / '.join(_f(v, 2) for v in s['submit_ms'])} | {_pair(s['durable_ms'])} | "
            f"{_pair(s['to_read_ms'])} | "
            f"{_pair(s['read_ms'].get('get', []))} | {_pair(s['read_ms'].get('slice', []))} | "
            f"{_pair(s['delete_ms'])} | {cmd_text} | {w['spilled']} | {w['restarts']} | "
            f"{w['retries']} | {s['read_errors']} |")
    memory = ["| store | scenario | peak RSS MB (growth: last third's peak − middle third's) | "
              "CPU s |", "|---|---|---|---|"]
    for s in summaries:
        if "error" in s:
            continue
        parts = [f"{role} {v['peak']:.0f} ({v['growth']:+.0f})"
                 for role, v in s["rss_mb"].items()]
        cpu = ", ".join(f"{role} {v:.0f}" for role, v in sorted(s.get("cpu_s", {}).items()))
        memory.append(f"| {s['store']} | {s['scenario']} | {', '.join(parts)} | {cpu} |")
    return "\n".join(["#### Records", "", *rows, "", "#### Throughput and latency", "",
                      *perf, "", "#### Memory", "", *memory, ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="the CI form")
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--scenarios", default="", help="comma-separated names (default all)")
    parser.add_argument("--out", default="", help="output directory (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the event files")
    args = parser.parse_args(argv)
    os.environ.setdefault("GLOG_minloglevel", "1")  # Mooncake's clients: warnings and up
    stores = [s for s in args.stores.split(",") if s]
    unknown = sorted(set(stores) - set(STORES))
    if unknown:
        parser.error(f"unknown store(s) {unknown}; known: {', '.join(STORES)}")
    matrix = short_matrix() if args.short else long_matrix(stores)
    matrix = [s for s in matrix if s.store in stores]
    if args.scenarios:
        names = set(args.scenarios.split(","))
        matrix = [s for s in matrix if s.name in names]
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fdrr-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    summaries: list[dict[str, Any]] = []
    began = time.monotonic()
    sustained: dict[str, float] = {}
    for number, scenario in enumerate(matrix):
        workdir = out / f"{scenario.store}-{scenario.name}"
        factor = scenario.extra.pop("rate_from_saturate", None)
        if factor is not None:  # an offered rate above what this store just sustained
            if scenario.store not in sustained:
                print(f"== {scenario.store} / {scenario.name}: skipped (no saturate run)")
                continue
            scenario.rate = factor * sustained[scenario.store] / scenario.producers
        tag = f"k{number}t{int(time.time()) % 100000}"
        print(f"== {scenario.store} / {scenario.name} ({scenario.duration_s:.0f} s)", flush=True)
        try:
            summary = ScenarioRun(scenario, workdir, tag).run()
        except TmpfsUnavailable as exc:
            summary = {"store": scenario.store, "scenario": scenario.name,
                       "error": f"skipped: {exc}", "ok": True, "skipped": True}
        except Exception as exc:  # noqa: BLE001 - reported, and the run fails
            traceback.print_exc()
            summary = {"store": scenario.store, "scenario": scenario.name,
                       "error": f"{type(exc).__name__}: {exc}", "ok": False}
        summaries.append(summary)
        if scenario.name == "saturate" and not math.isnan(summary.get("records_per_s", math.nan)):
            sustained[scenario.store] = summary["records_per_s"]
        print(json.dumps({k: v for k, v in summary.items() if k not in ("rss_mb", "faults")},
                         default=str), flush=True)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    text = (f"Soak run of {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()} "
            f"({'short' if args.short else 'long'} form, {time.monotonic() - began:.0f} s)\n\n"
            + report(summaries))
    (out / "report.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(summaries, indent=1, default=str))
    print(text)
    failed = [f"{s['store']}/{s['scenario']}" for s in summaries if not s.get("ok")]
    if failed:
        print(f"soak FAILED: {', '.join(failed)} (see {out})", file=sys.stderr)
        return 1
    print(f"soak passed: every record accounted for ({out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
