"""The prefix index over buckets on a 3-node Redis Cluster (and one node), at growing N.

Starts its own servers on free loopback ports (a 3-master cluster, and one single node),
stops them at the end.  Index entries only (the index is what a prefix delete walks; the
payloads' cost is one UNLINK per matched key in any layout).  Keys are
``exp_epoch_{step}:{data}:{gen}:{turn}:{seg}``: 10 training steps, rollouts
``exp_epoch_{step}:{data}:{gen}`` of 4 keys (2 turns x 2 segments).  Per N and layout:

* one-rollout prefix delete (median over 20 rollouts, ms);
* one training step's prefix delete (N/10 keys; ms, and µs per matched key);
* the slowest single Redis command during those deletes (``SLOWLOG`` at threshold 0 on
  every node: server execution time);
* index memory per node after loading (``used_memory`` delta) and max / mean over nodes.

    python benchmarks/bench_index_buckets.py            # N = 10k, 100k, 1M
    python benchmarks/bench_index_buckets.py --quick    # N = 10k, 100k
    python benchmarks/bench_index_buckets.py --sizes 10000000   # the issue's 10M (slow)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import markdown_table  # noqa: E402
from fd_routing_replay.store.index import PrefixIndex  # noqa: E402
from tests.servers import RedisCluster, RedisServer, redis_cli_binary  # noqa: E402

STEPS, GENS, TURNS, SEGS = 10, 5, 2, 2
ROLLOUT_SAMPLES = 20
LOAD_PAGE = 5000


def keys_of_step(step: int, per_step: int) -> list[str]:
    datas = max(1, per_step // (GENS * TURNS * SEGS))
    return [f"exp_epoch_{step}:{d}:{g}:{t}:{s}" for d in range(datas) for g in range(GENS)
            for t in range(TURNS) for s in range(SEGS)]


def used_memory(nodes: list[RedisServer]) -> list[int]:
    return [int(node.info("memory")["used_memory"]) for node in nodes]


def slowest_us(nodes: list[RedisServer]) -> tuple[int, str, float, int, int]:
    """From every node's SLOWLOG: the longest command (µs) and its name, the p99 (µs), how
    many commands took over 5 ms, and how many were logged."""
    worst, name, times = 0, "", []
    for node in nodes:
        for entry in node.command("SLOWLOG", "GET", "1000000"):
            micros, args = int(entry[2]), entry[3]
            times.append(micros)
            if micros > worst:
                worst, name = micros, args[0].decode(errors="replace")
    times.sort()
    p99 = times[int(0.99 * (len(times) - 1))] if times else 0
    return worst, name, p99, sum(t > 5000 for t in times), len(times)


def reset_slowlog(nodes: list[RedisServer]) -> None:
    for node in nodes:
        node.command("CONFIG", "SET", "slowlog-log-slower-than", "0")
        node.command("CONFIG", "SET", "slowlog-max-len", "1000000")
        node.command("SLOWLOG", "RESET")


def run(client, nodes: list[RedisServer], n: int, buckets: int, namespace: str) -> dict:
    per_step = n // STEPS
    index = PrefixIndex(client, namespace, buckets=buckets)
    before = used_memory(nodes)
    started = time.perf_counter()
    for step in range(STEPS):
        keys = keys_of_step(step, per_step)
        for start in range(0, len(keys), LOAD_PAGE):
            index.add(keys[start:start + LOAD_PAGE])
    load_s = time.perf_counter() - started
    total = len(index)
    memory = [after - base for after, base in zip(used_memory(nodes), before, strict=True)]
    reset_slowlog(nodes)
    # one rollout at a time, from the last step (kept for the step delete below: step 0)
    rollout_times = []
    for number in range(ROLLOUT_SAMPLES):
        prefix = f"exp_epoch_{STEPS - 1}:{number}:{number % GENS}"
        started = time.perf_counter()
        removed = index.delete_prefix(prefix)
        rollout_times.append(time.perf_counter() - started)
        if removed != TURNS * SEGS:
            raise RuntimeError(f"{prefix}: removed {removed}, expected {TURNS * SEGS}")
    started = time.perf_counter()
    step_removed = index.delete_prefix("exp_epoch_0")
    step_s = time.perf_counter() - started
    worst, worst_name, p99, over_5ms, logged = slowest_us(nodes)
    for node in nodes:
        node.command("CONFIG", "SET", "slowlog-log-slower-than", "10000")
    for node in nodes:  # faster than index.clear() at 10M; this index is all they hold
        node.command("FLUSHALL", "ASYNC", timeout=60.0)
    mean = statistics.mean(memory) if memory else 0
    return {"n": total, "buckets": buckets, "load_rate": total / load_s,
            "rollout_ms": statistics.median(rollout_times) * 1e3,
            "step_keys": step_removed, "step_ms": step_s * 1e3,
            "step_us_per_key": step_s * 1e6 / max(1, step_removed),
            "worst_us": worst, "worst_cmd": worst_name, "p99_us": p99, "over_5ms": over_5ms,
            "logged": logged, "memory": memory,
            "imbalance": (max(memory) / mean) if mean > 0 else float("nan")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 10k, 100k")
    parser.add_argument("--sizes", type=int, nargs="*", help="explicit N values")
    parser.add_argument("--buckets", type=int, default=16, help="buckets (default 16)")
    parser.add_argument("--layouts", nargs="*", default=["buckets", "one-set", "single"],
                        choices=["buckets", "one-set", "single"],
                        help="cluster with buckets, cluster with one set, one node")
    args = parser.parse_args()
    if redis_cli_binary() is None:
        print("skipped: redis-cli / redis-server not found (Debian redis-server, redis-tools)")
        return 0
    import redis

    sizes = args.sizes or ([10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000])
    rows = []
    with RedisCluster(3) as cluster, RedisServer() as single:
        cluster_client = redis.RedisCluster(host=cluster.nodes[0].host,
                                            port=cluster.nodes[0].port, protocol=2)
        single_client = redis.Redis(host=single.host, port=single.port, protocol=2)
        for n in sizes:
            layouts = {"buckets": ("cluster, 3 nodes", cluster_client, cluster.nodes,
                                   args.buckets),
                       "one-set": ("cluster, 3 nodes", cluster_client, cluster.nodes, 1),
                       "single": ("single node", single_client, [single], 1)}
            for label, client, nodes, buckets in (layouts[name] for name in args.layouts):
                result = run(client, nodes, n, buckets, f"bench{n}b{buckets}")
                rows.append([f"{result['n']:,}", label, buckets, f"{result['rollout_ms']:.2f}",
                             f"{result['step_ms']:,.0f} ({result['step_keys']:,} keys)",
                             f"{result['step_us_per_key']:.2f}",
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
    print(f"Index entries only; one-rollout delete = median of {ROLLOUT_SAMPLES} (4 keys "
          "each); a training step = N/10 keys; slowest = longest single command on any node "
          "during those deletes (SLOWLOG, server time); memory = used_memory delta per node "
          "after loading (MiB); imbalance = max / mean over the nodes.\n")
    print(markdown_table(
        ["N keys", "Redis", "buckets", "1 rollout, ms", "1 training step, ms",
         "µs per matched key", "slowest command, ms (p99; > 5 ms)", "index MiB per node",
         "max/mean", "load, keys/s"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
