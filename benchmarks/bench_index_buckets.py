"""The prefix index over buckets on a 3-node Redis Cluster (and one node), at growing N.

Starts its own servers on free loopback ports (a 3-master cluster, and one single node),
stops them at the end.  Index entries only (the index is what a prefix delete walks; the
payloads' cost is one UNLINK per matched key in any layout).  Keys are
``exp_epoch_{step}:{data}:{gen}:{turn}:{seg}``: 10 training steps, rollouts
``exp_epoch_{step}:{data}:{gen}`` of 4 keys (2 turns x 2 segments).  Per N and layout,
for each write batch (members per ``ZREM``; ``PrefixIndex(write_batch=…)``), side by side
on the same loaded index:

* one-rollout prefix delete (median over 20 rollouts per write batch, interleaved, ms);
* one training step's prefix delete (N/10 keys; two steps per write batch in the order
  A B … B A, so each sees the index as full on average; median ms, µs per matched key,
  keys deleted per second);
* the slowest single Redis command during those deletes (``SLOWLOG`` at threshold 0 on
  every node: server execution time), its p99, and how many took over 5 ms;
* index memory per node after loading (``used_memory`` delta) and max / mean over nodes.

    python benchmarks/bench_index_buckets.py            # N = 10k, 100k, 1M
    python benchmarks/bench_index_buckets.py --quick    # N = 10k, 100k
    python benchmarks/bench_index_buckets.py --sizes 10000000   # the issue's 10M (slow)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import markdown_table  # noqa: E402
from fd_routing_replay.store.index import (  # noqa: E402
    DEFAULT_BATCH,
    DEFAULT_WRITE_BATCH,
    PrefixIndex,
)
from fdrr_dev.testing.redis import (  # noqa: E402
    RedisCluster,
    RedisServer,
    redis_cli_binary,
)

STEPS, GENS, TURNS, SEGS = 10, 5, 2, 2
ROLLOUT_SAMPLES = 20
LOAD_PAGE = 5000
SLOW_US = 5000


def keys_of_step(step: int, per_step: int) -> list[str]:
    datas = max(1, per_step // (GENS * TURNS * SEGS))
    return [f"exp_epoch_{step}:{d}:{g}:{t}:{s}" for d in range(datas) for g in range(GENS)
            for t in range(TURNS) for s in range(SEGS)]


def used_memory(nodes: list[RedisServer]) -> list[int]:
    return [int(node.info("memory")["used_memory"]) for node in nodes]


def slowlog(nodes: list[RedisServer]) -> list[tuple[int, str]]:
    """Every node's SLOWLOG entries since the last reset: (µs, command name)."""
    entries = []
    for node in nodes:
        for entry in node.command("SLOWLOG", "GET", "1000000"):
            micros, args = int(entry[2]), entry[3]
            name = args[0].decode(errors="replace").upper()
            if name != "SLOWLOG":
                entries.append((micros, name))
    return entries


def summary(entries: list[tuple[int, str]]) -> tuple[int, str, float, int, int]:
    """The longest command (µs) and its name, the p99 (µs), how many commands took over
    5 ms, and how many were logged."""
    worst, name = max(entries, default=(0, "-"))
    times = sorted(micros for micros, _ in entries)
    p99 = times[int(0.99 * (len(times) - 1))] if times else 0
    return worst, name, p99, sum(t > SLOW_US for t in times), len(times)


def reset_slowlog(nodes: list[RedisServer]) -> None:
    for node in nodes:
        node.command("SLOWLOG", "RESET")


def realtime(nodes: list[RedisServer]) -> str:
    """Put our redis-server processes (by pid) on the real-time FIFO scheduler, so that on a
    busy machine SLOWLOG times the commands' own work, not their wait for a CPU (a
    production Redis has cores of its own).  Returns what was done, for the report."""
    chrt = shutil.which("chrt")
    if chrt is None:
        return "not set (no chrt)"
    for node in nodes:
        assert node.process is not None
        done = subprocess.run([chrt, "--fifo", "--pid", "10", str(node.process.pid)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            return f"not set ({done.stderr.strip() or done.returncode})"
    return "SCHED_FIFO 10"


def run(client, nodes: list[RedisServer], n: int, buckets: int, namespace: str,
        write_batches: list[int], batch: int) -> list[dict]:
    """Load N entries, then measure deletes with each write batch on the same index."""
    if len(write_batches) * 2 > STEPS - 1:
        raise ValueError(f"at most {(STEPS - 1) // 2} write batches per run")
    per_step = n // STEPS
    loader = PrefixIndex(client, namespace, buckets=buckets)
    before = used_memory(nodes)
    started = time.perf_counter()
    for step in range(STEPS):
        keys = keys_of_step(step, per_step)
        for start in range(0, len(keys), LOAD_PAGE):
            loader.add(keys[start:start + LOAD_PAGE])
    load_s = time.perf_counter() - started
    total = len(loader)
    memory = [after - base for after, base in zip(used_memory(nodes), before, strict=True)]
    indexes = [PrefixIndex(client, namespace, buckets=buckets, batch=batch, write_batch=size)
               for size in write_batches]
    for node in nodes:
        node.command("CONFIG", "SET", "slowlog-log-slower-than", "0")
        node.command("CONFIG", "SET", "slowlog-max-len", "1000000")
    rollout_times: list[list[float]] = [[] for _ in indexes]
    logged: list[list[tuple[int, str]]] = [[] for _ in indexes]
    # One rollout at a time from the last step, the write batches interleaved.
    for number in range(ROLLOUT_SAMPLES):
        for which, index in enumerate(indexes):
            sample = number * len(indexes) + which
            prefix = f"exp_epoch_{STEPS - 1}:{sample // GENS}:{sample % GENS}"
            reset_slowlog(nodes)
            started = time.perf_counter()
            removed = index.delete_prefix(prefix)
            rollout_times[which].append(time.perf_counter() - started)
            logged[which] += slowlog(nodes)
            if removed != TURNS * SEGS:
                raise RuntimeError(f"{prefix}: removed {removed}, expected {TURNS * SEGS}")
    # Whole training steps: A B ... B A, so every write batch sees a similar index size.
    order = list(range(len(indexes)))
    order += order[::-1]
    step_times: list[list[float]] = [[] for _ in indexes]
    step_keys: list[int] = [0] * len(indexes)
    for step, which in enumerate(order):
        reset_slowlog(nodes)
        started = time.perf_counter()
        removed = indexes[which].delete_prefix(f"exp_epoch_{step}")
        step_times[which].append(time.perf_counter() - started)
        logged[which] += slowlog(nodes)
        step_keys[which] = removed
    for node in nodes:
        node.command("CONFIG", "SET", "slowlog-log-slower-than", "10000")
    for node in nodes:  # faster than index.clear() at 10M; this index is all they hold
        node.command("FLUSHALL", "ASYNC", timeout=60.0)
    mean = statistics.mean(memory) if memory else 0
    results = []
    for which, size in enumerate(write_batches):
        worst, worst_name, p99, over, count = summary(logged[which])
        step_s = statistics.median(step_times[which])
        results.append({
            "n": total, "buckets": buckets, "write_batch": size, "load_rate": total / load_s,
            "rollout_ms": statistics.median(rollout_times[which]) * 1e3,
            "step_keys": step_keys[which], "step_ms": step_s * 1e3,
            "step_us_per_key": step_s * 1e6 / max(1, step_keys[which]),
            "keys_per_s": step_keys[which] / step_s,
            "worst_us": worst, "worst_cmd": worst_name, "p99_us": p99, "over_5ms": over,
            "logged": count, "memory": memory,
            "imbalance": (max(memory) / mean) if mean > 0 else float("nan")})
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 10k, 100k")
    parser.add_argument("--sizes", type=int, nargs="*", help="explicit N values")
    parser.add_argument("--buckets", type=int, default=16, help="buckets (default 16)")
    parser.add_argument("--layouts", nargs="*", default=["buckets", "one-set", "single"],
                        choices=["buckets", "one-set", "single"],
                        help="cluster with buckets, cluster with one set, one node")
    parser.add_argument("--write-batches", type=int, nargs="*",
                        default=sorted({DEFAULT_BATCH, DEFAULT_WRITE_BATCH}, reverse=True),
                        help="members per ZREM to compare, at most 4 (default: "
                             f"{DEFAULT_BATCH} (one command per page) and the default "
                             f"{DEFAULT_WRITE_BATCH})")
    parser.add_argument("--batch", type=int, default=DEFAULT_BATCH,
                        help=f"members per page read (ZRANGEBYLEX; default {DEFAULT_BATCH})")
    parser.add_argument("--realtime", action="store_true",
                        help="run the redis-server processes at real-time priority (chrt; "
                             "needs root): times their work, not their wait for a CPU")
    args = parser.parse_args()
    if redis_cli_binary() is None:
        print("skipped: redis-cli / redis-server not found (Debian redis-server, redis-tools)")
        return 0

    sizes = args.sizes or ([10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000])
    rows = []
    load_before = os.getloadavg()
    with RedisCluster(3) as cluster, RedisServer() as single:
        priority = realtime([*cluster.nodes, single]) if args.realtime else "normal"
        cluster_client = cluster.client(protocol=2)
        single_client = single.client(protocol=2)
        for n in sizes:
            layouts = {"buckets": ("cluster, 3 nodes", cluster_client, cluster.nodes,
                                   args.buckets),
                       "one-set": ("cluster, 3 nodes", cluster_client, cluster.nodes, 1),
                       "single": ("single node", single_client, [single], 1)}
            for label, client, nodes, buckets in (layouts[name] for name in args.layouts):
                for result in run(client, nodes, n, buckets, f"bench{n}b{buckets}",
                                  args.write_batches, args.batch):
                    rows.append([
                        f"{result['n']:,}", label, buckets, f"{result['write_batch']:,}",
                        f"{result['rollout_ms']:.2f}",
                        f"{result['step_ms']:,.0f} ({result['step_keys']:,} keys)",
                        f"{result['step_us_per_key']:.2f}", f"{result['keys_per_s']:,.0f}",
                        f"{result['worst_us'] / 1e3:.2f} ({result['worst_cmd']}); p99 "
                        f"{result['p99_us'] / 1e3:.2f}; {result['over_5ms']} of "
                        f"{result['logged']:,} over 5 ms",
                        " / ".join(f"{m / 2**20:.1f}" for m in result["memory"]),
                        f"{result['imbalance']:.2f}", f"{result['load_rate']:,.0f}"])
                    print(f"N={n:,} {label} B={buckets}: {' | '.join(map(str, rows[-1]))}",
                          file=sys.stderr, flush=True)
        cluster_client.close()
        single_client.close()
    print("### Prefix index over buckets: 3-node Redis Cluster vs one node\n")
    print(f"Index entries only; pages of {args.batch:,} members read per ZRANGEBYLEX; "
          "write batch = members per ZREM (each row pair: the same loaded index). "
          f"One-rollout delete = median of {ROLLOUT_SAMPLES} (4 keys each); a training "
          "step = N/10 keys, median of 2 per write batch (A B B A); slowest = longest "
          "single command on any node during those deletes (SLOWLOG, threshold 0, server "
          "time); memory = used_memory delta per node after loading (MiB); imbalance = "
          "max / mean over the nodes.  Load average (1, 5, 15 min) at the start "
          f"{' '.join(f'{v:.1f}' for v in load_before)}, at the end "
          f"{' '.join(f'{v:.1f}' for v in os.getloadavg())} on {os.cpu_count()} CPUs "
          "(a busy machine stretches the slowest commands: the server waits for a CPU); "
          f"redis-server scheduling: {priority}.\n")
    print(markdown_table(
        ["N keys", "Redis", "buckets", "write batch", "1 rollout, ms", "1 training step, ms",
         "µs per matched key", "deleted keys/s", "slowest command, ms (p99; > 5 ms)",
         "index MiB per node", "max/mean", "load, keys/s"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
