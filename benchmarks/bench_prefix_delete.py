"""Prefix delete: our Redis index vs P2PStore's ``delete_prefix_batch``, side by side.

One throwaway redis-server per N (free loopback port, started here).  The same N keys
``exp_epoch_3:{data}:{gen}:{turn}:{seg}`` are loaded twice into it: once in our Redis
store's layout (payload HASH + prefix index), once in P2PStore's metadata layout
(``p2p:files:{key}`` JSON string + the ``p2p:files:index`` set, what its ``put`` writes).
Each prefix ``exp_epoch_3:{data}:{gen}`` matches 4 keys (2 turns x 2 segments).

Measured per N: one prefix per call, and 64 prefixes per call; median wall time per call
over distinct prefixes; the slowest single Redis command seen during those calls
(SLOWLOG with threshold 0, server-side execution time); Redis memory per key from
``INFO memory`` deltas.  P2PStore's side runs its real client (TCP transport) when it can
start, otherwise its algorithm reproduced from its source (full index scan + startswith
filter + batched deletes), and the column says which.

    python benchmarks/bench_prefix_delete.py            # N = 10k, 100k, 1M
    python benchmarks/bench_prefix_delete.py --quick    # N = 10k, 100k
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import keys_for  # noqa: E402
from fd_routing_replay.store import open_store  # noqa: E402
from fd_routing_replay.store.redis import payload_key  # noqa: E402
from fdrr_dev.testing.process import free_port  # noqa: E402
from fdrr_dev.testing.redis import RedisServer  # noqa: E402

NAMESPACE = "bench"
P2P_FILE, P2P_INDEX = "p2p:files:", "p2p:files:index"


# -- loading --------------------------------------------------------------------------------

def load_ours(server: RedisServer, keys: list[str], workdir: Path) -> None:
    """Our store's layout, exactly what RedisStore.put writes for a 16-byte record."""
    index_key = f"rr:idx:{{{NAMESPACE}}}"
    value = b"\x00" * 16
    commands = [("HSET", payload_key(NAMESPACE, k), "0", value, "n", "1", "s", "16")
                for k in keys]
    for start in range(0, len(keys), 1000):
        args: list[str] = ["ZADD", index_key]
        for key in keys[start:start + 1000]:
            args += ["0", key]
        commands.append(args)
    server.load(commands, workdir)


def load_p2pstore(server: RedisServer, keys: list[str], workdir: Path, host: str) -> None:
    """P2PStore's metadata layout, as its register_file writes it (JSON + index set)."""
    commands = []
    for number, key in enumerate(keys):
        record = {"host": host, "metadata": {
            "object_type": "numpy", "data_size": 3932160, "tensor_shape": [60, 8192, 8],
            "tensor_dtype": "uint8", "buffer_ptr": None, "file_key": key,
            "client_id": "00000000", "put_id": 1796006480371079915 + number},
            "file_key": key}
        commands.append(("SET", P2P_FILE + key, json.dumps(record)))
    for start in range(0, len(keys), 1000):
        commands.append(("SADD", P2P_INDEX, *keys[start:start + 1000]))
    server.load(commands, workdir)


def used_memory(server: RedisServer) -> int:
    return int(server.info("memory")["used_memory"])


# -- P2PStore side ----------------------------------------------------------------------------

class P2PStoreSide:
    """P2PStore's ``delete_prefix_batch``: the real client, or its algorithm reproduced."""

    def __init__(self, server: RedisServer, log_dir: str) -> None:
        self.server = server
        self.client = None
        self.loop = asyncio.new_event_loop()
        self.label = "P2PStore delete_prefix_batch"
        self.host = f"127.0.0.1:{free_port()}"
        os.environ.setdefault("P2P_LOG_DIR", log_dir)
        try:
            # P2PStore prints its log locations on stdout; keep stdout for the tables.
            with contextlib.redirect_stdout(sys.stderr):
                from p2pstore import P2PClient, P2PConfig

                config = P2PConfig(metadata_server=f"redis://{server.address}/0",
                                   protocol="tcp", local_host=self.host)
                self.client = P2PClient(config)
        except Exception as exc:  # no mooncake / libibverbs: reproduce the algorithm
            print(f"# P2PStore client unavailable ({type(exc).__name__}: {exc}); "
                  "using its algorithm, reproduced", file=sys.stderr)
            import redis

            self.redis = redis.Redis(host=server.host, port=server.port, decode_responses=True)
            self.label = "P2PStore algorithm, reproduced"

    def delete_prefix_batch(self, prefixes: list[str]) -> int:
        if self.client is not None:
            result = self.loop.run_until_complete(self.client.delete_prefix_batch(prefixes))
            return len(result)
        return self._reproduced(prefixes)

    def _reproduced(self, prefixes: list[str]) -> int:
        # 1. list every key of the global index (SSCAN, count 1000); 2. startswith filter;
        # 3. delete the matches 1000 at a time (GET+DEL+SREM, its Lua script's work).
        all_keys: list[str] = []
        cursor = 0
        while True:
            cursor, members = self.redis.sscan(P2P_INDEX, cursor=cursor, count=1000)
            all_keys.extend(members)
            if cursor == 0:
                break
        doomed = [k for k in all_keys if any(k.startswith(p) for p in prefixes)]
        for start in range(0, len(doomed), 1000):
            batch = doomed[start:start + 1000]
            pipe = self.redis.pipeline(transaction=True)
            pipe.mget([P2P_FILE + k for k in batch])
            pipe.delete(*[P2P_FILE + k for k in batch])
            pipe.srem(P2P_INDEX, *batch)
            pipe.execute()
        return len(prefixes)

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # its close may complain about a flushed server
                pass
        self.loop.close()


# -- measuring ------------------------------------------------------------------------------

def slowest_command(server: RedisServer) -> tuple[float, str, float]:
    """(ms, command, p99 ms) of the SLOWLOG entries since the last reset."""
    entries = server.command("SLOWLOG", "GET", "-1") or []
    worst_us, worst = 0, "-"
    durations = []
    for entry in entries:
        duration, args = int(entry[2]), entry[3]
        if args and args[0].upper() == b"SLOWLOG":
            continue
        durations.append(duration)
        if duration > worst_us:
            worst_us = duration
            worst = " ".join(a.decode(errors="replace") for a in args[:2])
    durations.sort()
    p99 = durations[int(0.99 * (len(durations) - 1))] if durations else 0
    return worst_us / 1000.0, worst, p99 / 1000.0


def timed_calls(server: RedisServer, call, batches: list[list[str]]
                ) -> tuple[float, float, str, float]:
    """Median ms per call over ``batches``; slowest Redis command meanwhile (+ p99)."""
    server.command("SLOWLOG", "RESET")
    times = []
    for batch in batches:
        start = time.perf_counter()
        call(batch)
        times.append((time.perf_counter() - start) * 1000)
    worst_ms, worst, p99 = slowest_command(server)
    return statistics.median(times), worst_ms, worst, p99


def run_size(n: int, reps_ours: int, reps_p2p: int) -> dict:
    keys, prefixes = keys_for(n)
    n = len(keys)
    with tempfile.TemporaryDirectory(prefix="fdrr-bench-") as tmp, \
            RedisServer(config={"slowlog-max-len": "100000"}) as server:
        workdir = Path(tmp)
        p2p = P2PStoreSide(server, str(workdir / "p2plog"))
        base = used_memory(server)
        load_p2pstore(server, keys, workdir, p2p.host)
        after_p2p = used_memory(server)
        load_ours(server, keys, workdir)
        after_ours = used_memory(server)
        # index memory alone: a second namespace with only index entries
        index_only = f"rr:idx:{{{NAMESPACE}-memprobe}}"
        commands = []
        for start in range(0, len(keys), 1000):
            args: list[str] = ["ZADD", index_only]
            for key in keys[start:start + 1000]:
                args += ["0", key]
            commands.append(args)
        before_index = used_memory(server)
        server.load(commands, workdir)
        index_bytes = used_memory(server) - before_index
        server.command("UNLINK", index_only)

        store = open_store({"url": server.url, "namespace": NAMESPACE})
        store.delete_prefix(["warm_up"])  # open the connection before timing
        server.command("CONFIG", "SET", "slowlog-log-slower-than", "0")
        # Distinct prefixes per call so every call deletes 4 real keys on each side.
        cursor = 0

        def take(count: int) -> list[str]:
            nonlocal cursor
            chunk = prefixes[cursor:cursor + count]
            cursor += count
            if len(chunk) < count:
                raise RuntimeError(f"N={n} has too few prefixes for the repetitions")
            return chunk

        one_ours = [take(1) for _ in range(reps_ours)]
        many_ours = [take(64) for _ in range(max(3, reps_ours // 2))]
        one_p2p = [take(1) for _ in range(reps_p2p)]
        many_p2p = [take(64) for _ in range(reps_p2p)]

        def ours(batch: list[str]) -> None:
            counts = store.delete_prefix(batch)
            if sum(counts.values()) != 4 * len(batch):
                raise RuntimeError(f"our delete removed {counts}, expected 4 per prefix")

        def theirs(batch: list[str]) -> None:
            p2p.delete_prefix_batch([p + ":" for p in batch])  # ':' makes startswith exact

        row = {"n": n}
        row["ours_1"] = timed_calls(server, ours, one_ours)
        row["ours_64"] = timed_calls(server, ours, many_ours)
        before = int(server.command("SCARD", P2P_INDEX))
        row["p2p_1"] = timed_calls(server, theirs, one_p2p)
        row["p2p_64"] = timed_calls(server, theirs, many_p2p)
        removed = before - int(server.command("SCARD", P2P_INDEX))
        expected = 4 * (len(one_p2p) + 64 * len(many_p2p))
        if removed != expected:
            raise RuntimeError(f"P2PStore side removed {removed} keys, expected {expected}")
        row["label"] = p2p.label
        row["mem_index"] = index_bytes / n
        row["mem_ours"] = (after_ours - after_p2p) / n
        row["mem_p2p"] = (after_p2p - base) / n
        store.close()
        p2p.close()
    return row


def print_tables(rows: list[dict]) -> None:
    label = rows[0]["label"]
    print("\n### Prefix delete: fd-routing-replay Redis index vs P2PStore\n")
    print(f"Median ms per call (each prefix matches 4 keys); speedup = {label} / ours; "
          "slowest = the slowest single Redis command during those calls (SLOWLOG with "
          "threshold 0, server time; p99 over every command in brackets).\n")
    print(f"| N keys | ours, 1 prefix | {label}, 1 prefix | speedup | ours, 64 prefixes "
          f"| {label}, 64 prefixes | speedup | slowest Redis cmd, ours | slowest Redis cmd, "
          "P2PStore |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for row in rows:
        o1, o64, p1, p64 = row["ours_1"], row["ours_64"], row["p2p_1"], row["p2p_64"]
        worst_ours = max((o1[1], o1[2], max(o1[3], o64[3])), (o64[1], o64[2], max(o1[3], o64[3])))
        worst_p2p = max((p1[1], p1[2], max(p1[3], p64[3])), (p64[1], p64[2], max(p1[3], p64[3])))
        print(f"| {row['n']:,} | {o1[0]:.2f} | {p1[0]:.1f} | {p1[0] / o1[0]:,.0f}x "
              f"| {o64[0]:.2f} | {p64[0]:.1f} | {p64[0] / o64[0]:,.0f}x "
              f"| {worst_ours[0]:.3f} ms {worst_ours[1]} [p99 {worst_ours[2]:.3f}] "
              f"| {worst_p2p[0]:.3f} ms {worst_p2p[1]} [p99 {worst_p2p[2]:.3f}] |")
    first, last = rows[0], rows[-1]
    print(f"\nScaling, ours: 1 prefix {last['ours_1'][0] / first['ours_1'][0]:.2f}x and "
          f"64 prefixes {last['ours_64'][0] / first['ours_64'][0]:.2f}x from "
          f"N={first['n']:,} to N={last['n']:,} (target <= 2x).")
    print("\n### Redis memory per key (INFO used_memory deltas)\n")
    print("| N keys | our index (zset entry) | ours total (index + payload hash, 16 B record) "
          "| P2PStore metadata (JSON + index set) |")
    print("|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['n']:,} | {row['mem_index']:.0f} B | {row['mem_ours']:.0f} B "
              f"| {row['mem_p2p']:.0f} B |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 10k and 100k only")
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                        help="comma-separated N values (overrides --quick)")
    parser.add_argument("--reps", type=int, default=50, help="calls per measurement, ours")
    parser.add_argument("--reps-p2p", type=int, default=5, help="calls per measurement, P2PStore")
    args = parser.parse_args(argv)
    sizes = args.sizes or ([10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000])
    rows = []
    for n in sizes:
        start = time.perf_counter()
        reps_p2p = args.reps_p2p if n < 1_000_000 else max(3, args.reps_p2p // 2)
        rows.append(run_size(n, args.reps, reps_p2p))
        print(f"# N={n:,} done in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    print_tables(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
