"""``python -m fdrr_dev demo``: the whole job on the embedded default, end to end, in well under a minute.

1. Run ~64 multi-turn rollouts (3 turns) through the harness engine — prefix caching,
   chunked prefill and preemptions included — once without capture (to time it) and
   once with capture → background writer → local store with ``only_last_turn``.
2. Trainer side: read every kept record back with ``RoutingReader`` and check it against
   a teacher-forced forward of the same model (see :mod:`.fidelity`).
3. Print a summary table, write ``summary.json`` and a PNG heatmap of expert load per
   layer computed from the stored records.

Exit status: 0 when the fidelity check passes, 1 when it fails, 2 on bad arguments.
Everything lands under ``--output`` (default ``./demo_output``); the demo clears its own
namespace there at start so reruns do not mix.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shlex
import sys
import time
import warnings
from pathlib import Path
from typing import Any, TextIO

import numpy as np

EXIT_OK, EXIT_FIDELITY, EXIT_USAGE = 0, 1, 2
NAMESPACE = "demo"


class Progress:
    """A one-line progress bar on a terminal; a few plain lines otherwise.  No dependencies."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None, width: int = 30) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_quarter = -1
        self.started = time.perf_counter()

    def update(self, done: int, note: str = "") -> None:
        done = min(done, self.total)
        if self.tty:
            filled = self.width * done // self.total
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r{self.label} [{bar}] {done}/{self.total} {note}  ")
            self.stream.flush()
            return
        quarter = 4 * done // self.total
        if quarter != self._last_quarter:
            self._last_quarter = quarter
            self.stream.write(f"{self.label}: {done}/{self.total} {note}\n")
            self.stream.flush()

    def finish(self, note: str = "") -> None:
        self.update(self.total, note)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m fdrr_dev demo``."""
    parser.add_argument("--output", default="./demo_output",
                        help="directory for the local store, summary.json and the heatmap "
                             "(default: ./demo_output)")
    parser.add_argument("--rollouts", type=int, default=64, help="multi-turn rollouts (default 64)")
    parser.add_argument("--turns", type=int, default=3, help="turns per rollout (default 3)")
    parser.add_argument("--seed", type=int, default=7, help="workload seed (default 7)")
    parser.add_argument("--writer-mode", choices=("process", "thread"), default="process",
                        help="background writer in a process (default) or a thread")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG heatmap")


def _config(output: Path, writer_mode: str) -> Any:
    from fd_routing_replay.config import load_config

    return load_config(env={}, overrides={
        "enabled": True,
        "store": {"type": "local", "namespace": NAMESPACE, "local": {"root": str(output / "store")}},
        "writer": {"mode": writer_mode, "journal_dir": str(output / "journal"),
                   "dead_letter_dir": str(output / "dead_letter")},
        "retention": {"only_last_turn": True},
    })


def _heatmap(records: list[Any], num_experts: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = records[0].num_layers
    load = np.zeros((layers, num_experts), dtype=np.float64)
    for record in records:
        ids = np.asarray(record.ids).reshape(layers, -1)
        for layer in range(layers):
            valid = ids[layer][ids[layer] < num_experts]
            load[layer] += np.bincount(valid, minlength=num_experts)
    share = load / np.maximum(load.sum(axis=1, keepdims=True), 1)
    fig, ax = plt.subplots(figsize=(1.0 + 0.45 * num_experts, 1.4 + 0.5 * layers), dpi=120)
    image = ax.imshow(share, aspect="auto", cmap="viridis")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_xticks(range(num_experts))
    ax.set_yticks(range(layers))
    ax.set_title("Expert load per layer (share of routed tokens, from stored records)")
    fig.colorbar(image, ax=ax, label="share")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(name) for name, _ in rows)
    line = "-" * (width + 3 + max(len(value) for _, value in rows))
    body = "\n".join(f"{name:<{width}} | {value}" for name, value in rows)
    return f"{line}\n{body}\n{line}"


def _ms(value: float) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.2f} ms"


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status."""
    if args.rollouts < 1 or args.turns < 1:
        print(f"error: --rollouts ({args.rollouts}) and --turns ({args.turns}) must be at least 1",
              file=sys.stderr)
        return EXIT_USAGE
    warnings.filterwarnings("ignore", message=".*ccache.*")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from fd_routing_replay.reader import RoutingReader
    from fd_routing_replay.store import open_store
    from fd_routing_replay.writer import RoutingWriter
    from fdrr_dev.harness.engine import EngineConfig
    from fdrr_dev.harness.fidelity import check_results
    from fdrr_dev.harness.lockstep import run_lockstep
    from fdrr_dev.harness.rollouts import RolloutPlan

    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    config = _config(output, args.writer_mode)
    with open_store(config.store) as store:
        store.clear()                                   # the demo's own namespace only
    plan = RolloutPlan(num_rollouts=args.rollouts, num_turns=args.turns, seed=args.seed)
    engine_config = EngineConfig()
    total_turns = args.rollouts * args.turns

    # 1. capture → writer → local store (only_last_turn), in lockstep with the same workload
    #    without capture: the overhead figure compares the two step by step
    writer = RoutingWriter.from_config(config)
    writer.ready(30)
    results: list[Any] = []
    progress = Progress(total_turns, "rollouts (capture on+off)")
    captured, timing = run_lockstep(plan, engine_config=engine_config, writer=writer,
                                    on_step=lambda e: progress.update(len(results), f"{e.steps} steps"),
                                    on_result=results.append)
    progress.finish(f"{captured.engine.steps} steps")
    flushed = writer.flush(60)
    writer_stats = writer.stats()
    manager_stats = captured.manager.stats()
    writer.close(30)

    # 2. trainer side
    finals: dict[str, str] = {}
    for result in captured.results:
        if result.finish_reason in ("eos", "length"):
            finals[result.rollout_id.rsplit(":", 2)[0]] = result.rollout_id
    keep = set(finals.values())
    with open_store(config.store) as store:
        reader = RoutingReader(store)
        progress = Progress(len(keep), "fidelity check         ")
        checked: list[str] = []

        def get_record(rollout_id: str) -> Any:
            checked.append(rollout_id)
            progress.update(len(checked))
            return reader.get(rollout_id)

        report = check_results(captured.results, get_record, captured.model_for_version,
                               expect_present=lambda r: r.rollout_id in keep)
        progress.finish()
        stored_keys = store.list()
        stale = [r.rollout_id for r in captured.results
                 if r.rollout_id not in keep and store.exists(r.rollout_id)]
        records = [reader.get(key) for key in stored_keys]
        stored_bytes = sum(len(store.get(key)) for key in stored_keys)

    model_config = captured.models[0].config
    heatmap = output / "expert_load.png"
    if not args.no_plot and records:
        _heatmap(records, model_config.num_experts, heatmap)
    passed = report.passed and not stale and sorted(stored_keys) == sorted(keep) and flushed

    # 3. summary
    engine = captured.engine
    tokens = sum(len(r.forwarded_tokens) for r in captured.results)
    dtype = manager_stats["dtype"]
    summary = {
        "passed": passed,
        "rollouts": args.rollouts, "turns": args.turns,
        "requests": len(captured.results),
        "tokens": tokens,
        "engine_steps": engine.steps,
        "preemptions": engine.preemptions,
        "prefix_cache_hit_tokens": engine.blocks.hit_tokens,
        "chunked_prefills": sum(1 for r in captured.results if r.chunks > 1),
        "records_written": int(writer_stats.get("written", 0)),
        "records_kept": len(stored_keys),
        # previous turns removed by only_last_turn (the writer's "deleted" counter counts only
        # deletes submitted explicitly, not the follow-ups it generates itself)
        "records_deleted": int(writer_stats.get("written", 0)) - len(stored_keys),
        "stale_records": stale,
        "stored_bytes": stored_bytes,
        "dtype": dtype,
        "agreement": report.agreement,
        "decisions": report.decisions,
        "near_ties": report.near_ties,
        "near_tie_flips": report.near_tie_disagreements,
        "decisive_disagreements": report.decisive_disagreements,
        "fidelity": report.summary(),
        "failures": report.failures,
        "capture_overhead": timing.paired_overhead,
        "capture_overhead_total": timing.total_overhead,
        "median_step_seconds_off": timing.median_off,
        "median_step_seconds_on": timing.median_on,
        "offload_seconds": manager_stats["offload_seconds"],
        "capture_share": manager_stats["capture_seconds"] / max(engine.step_seconds, 1e-9),
        "put_latency_p50_ms": writer_stats.get("put_latency_p50_ms"),
        "put_latency_p99_ms": writer_stats.get("put_latency_p99_ms"),
        "submit_latency_p50_ms": writer_stats.get("submit_latency_p50_ms"),
        "heatmap": str(heatmap) if heatmap.exists() and not args.no_plot else None,
        "store": str(output / "store"),
        "namespace": NAMESPACE,
    }
    store_url = f"local://{(output / 'store').absolute()}"
    (output / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    rows = [
        ("requests (turns)", f"{summary['requests']} ({args.rollouts} rollouts x {args.turns} turns)"),
        ("tokens forwarded", f"{tokens} in {engine.steps} steps"),
        ("prefix-cache hit tokens", str(summary["prefix_cache_hit_tokens"])),
        ("chunked prefills / preemptions", f"{summary['chunked_prefills']} / {engine.preemptions}"),
        ("records written / kept / deleted",
         f"{summary['records_written']} / {summary['records_kept']} / {summary['records_deleted']}"
         " (only_last_turn)"),
        ("bytes stored", f"{stored_bytes} ({dtype})"),
        ("fidelity agreement", f"{report.agreement:.4%} of {report.decisions} decisions"),
        ("near-ties (|k-th - k+1-th| <= 1e-3)",
         f"{report.near_ties} ({report.near_tie_disagreements} flipped)"),
        ("decisive disagreements", str(report.decisive_disagreements)),
        ("capture overhead, engine step time",
         f"{timing.paired_overhead:+.1%} median of {timing.steps} paired steps "
         f"(total {timing.total_overhead:+.1%}; {timing.median_off * 1e3:.1f} ms off, "
         f"{timing.median_on * 1e3:.1f} ms on; engines on/off in lockstep, same seeds)"),
        ("time inside capture calls",
         f"{summary['capture_share']:.1%} of engine step time "
         f"({manager_stats['capture_seconds'] * 1e3:.0f} ms; offload {manager_stats['offload_seconds'] * 1e3:.0f} ms)"),
        ("put latency p50 / p99",
         f"{_ms(summary['put_latency_p50_ms'])} / {_ms(summary['put_latency_p99_ms'])}"),
        ("heatmap", summary["heatmap"] or "skipped"),
        ("records stored in", f"{store_url} (namespace {NAMESPACE})"),
    ]
    print(_table(rows))
    print(("PASS: " if passed else "FAIL: ") + report.summary())
    print(f"wrote {len(stored_keys)} record(s) to {store_url}, namespace {NAMESPACE}; list them "
          f"with: fd-rr ls --store {shlex.quote(store_url)} --namespace {NAMESPACE}")
    if not passed:
        for line in report.failures:
            print(f"  {line}")
        if stale:
            print(f"  records of earlier turns still stored: {stale[:5]}")
        if not flushed:
            print("  the writer did not flush every record within 60 s")
        return EXIT_FIDELITY
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fdrr_dev.harness.demo",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
