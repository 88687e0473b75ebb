"""Mooncake Store: prefix delete through our Redis index vs Mooncake's own removal.

A throwaway ``mooncake_master`` and ``redis-server`` on free loopback ports (started here,
stopped by pid), the store over Mooncake's TCP transport.  Per N, N keys
``exp_epoch_3:{data}:{gen}:{turn}:{seg}`` (64-byte values, hard-pinned) are loaded as the
``mooncake`` store writes them: objects ``bench/{key}`` plus the prefix index in Redis.
Each prefix ``exp_epoch_3:{data}:{gen}`` matches 4 keys.  Median wall time per call over
distinct prefixes (every method gets its own prefixes, so none deletes what another
measures):

* ours — ``MooncakeStore.delete_prefix([p])``: index range read + ``batch_remove``
  (forced) + index removal; and 64 prefixes per call;
* ``remove_by_regex("^bench/<p>([:_]|$)", force=True)`` — the master matches every key;
  and one alternation regex of 64 prefixes;
* ``batch_remove`` of the 4 exact keys — the floor, but it needs the keys (an index);
* listing: the master's ``/get_all_keys`` + filter (what a prefix delete without an
  index must read) vs ``MooncakeStore.list(p)``.

    python benchmarks/bench_mooncake_prefix_delete.py            # N = 10k, 100k
    python benchmarks/bench_mooncake_prefix_delete.py --large    # N = 10k, 100k, 1M
    python benchmarks/bench_mooncake_prefix_delete.py --quick    # N = 10k
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import SEGS, TURNS, keys_for, markdown_table  # noqa: E402
from fd_routing_replay.store import open_store  # noqa: E402
from fd_routing_replay.store.mooncake.store import FRAME  # noqa: E402
from fdrr_dev.testing.mooncake import MooncakeMaster, mooncake_master_binary  # noqa: E402
from fdrr_dev.testing.redis import RedisServer  # noqa: E402

NAMESPACE = "bench"
SAMPLES = 15
BATCH = 2000


def regex_for(prefixes: list[str]) -> str:
    """Mooncake keys of the store's namespace that the prefixes match, boundary-safe."""
    body = "|".join(re.escape(p) for p in prefixes)
    return f"^{NAMESPACE}/({body})([:_]|$)"


def load(store, keys: list[str]) -> float:
    """Put every key (64-byte framed values, batched) and index it; return keys/s."""
    value = FRAME + bytes(64)
    config = store.replicate_config
    started = time.perf_counter()
    for start in range(0, len(keys), BATCH):
        page = keys[start:start + BATCH]
        code = store.client.put_batch([f"{NAMESPACE}/{k}" for k in page],
                                      [value] * len(page), config)
        if code != 0:
            raise RuntimeError(f"put_batch failed with {code} at key {start}")
        store.index.add(page)
    return len(keys) / (time.perf_counter() - started)


def timed(call, expect: int | None = None) -> float:
    """Seconds ``call`` took; with ``expect``, check it removed that many keys."""
    started = time.perf_counter()
    answer = call()
    elapsed = time.perf_counter() - started
    if expect is not None:
        got = sum(answer.values()) if isinstance(answer, dict) else \
            sum(code == 0 for code in answer) if isinstance(answer, list) else answer
        if got != expect:
            raise RuntimeError(f"removed {got} keys, expected {expect}")
    return elapsed


def measure(n: int, redis: RedisServer) -> dict[str, float]:
    master = MooncakeMaster().start()
    store = None
    try:
        segment = max(256 * 2**20, n * 1024)
        store = open_store({"type": "mooncake", "namespace": NAMESPACE, "mooncake": {
            "master_server": master.address, "index_url": redis.url,
            "master_http": master.admin, "global_segment_size": segment,
            "local_buffer_size": 16 * 2**20}}, instrument=False)
        redis.flushall()
        keys, prefixes = keys_for(n)
        rate = load(store, keys)
        groups = iter(prefixes)

        def take(count: int) -> list[str]:
            return [next(groups) for _ in range(count)]

        result: dict[str, float] = {"n": len(keys), "load_rate": rate}
        ours, regex, exact, lists, dumps = [], [], [], [], []
        for _ in range(SAMPLES):
            prefix = take(1)[0]
            ours.append(timed(lambda p=prefix: store.delete_prefix([p]), 4))
            prefix = take(1)[0]
            regex.append(timed(lambda p=prefix: store.client.remove_by_regex(regex_for([p]),
                                                                             True), 4))
            prefix = take(1)[0]
            exact_keys = [f"{NAMESPACE}/{prefix}:{t}:{s}" for t in range(TURNS)
                          for s in range(SEGS)]
            exact.append(timed(lambda k=exact_keys: store.client.batch_remove(k, True), 4))
            prefix = take(1)[0]
            lists.append(timed(lambda p=prefix: store.list(p)))
        for _ in range(3):
            prefix = take(1)[0]
            dumps.append(timed(lambda p=prefix: [
                line for line in urllib.request.urlopen(
                    f"http://{master.admin}/get_all_keys", timeout=600).read().split(b"\n")
                if line.startswith(f"{NAMESPACE}/{p}".encode())]))
        result["ours_1"] = statistics.median(ours)
        result["regex_1"] = statistics.median(regex)
        result["exact_4"] = statistics.median(exact)
        result["list_ours"] = statistics.median(lists)
        result["list_dump"] = statistics.median(dumps)
        many_ours, many_regex = [], []
        for _ in range(3):
            batch = take(64)
            many_ours.append(timed(lambda b=batch: store.delete_prefix(b), 256))
            batch = take(64)
            many_regex.append(timed(lambda b=batch: store.client.remove_by_regex(regex_for(b),
                                                                                 True), 256))
        result["ours_64"] = statistics.median(many_ours)
        result["regex_64"] = statistics.median(many_regex)
        return result
    finally:
        if store is not None:
            store.close()
        master.cleanup()


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 10k only")
    parser.add_argument("--large", action="store_true", help="add N = 1M (~1 GB master memory)")
    args = parser.parse_args()
    if mooncake_master_binary() is None:
        print("skipped: mooncake_master not found (pip install 'fd-routing-replay[mooncake]')")
        return 0
    sizes = [10_000] if args.quick else [10_000, 100_000] + ([1_000_000] if args.large else [])
    rows = []
    with RedisServer() as redis:
        for n in sizes:
            r = measure(n, redis)
            rows.append([f"{r['n']:,}", ms(r["ours_1"]), ms(r["regex_1"]),
                         f"{r['regex_1'] / r['ours_1']:,.0f}x", ms(r["exact_4"]),
                         ms(r["ours_64"]), ms(r["regex_64"]),
                         f"{r['regex_64'] / r['ours_64']:,.1f}x",
                         ms(r["list_ours"]), ms(r["list_dump"]), f"{r['load_rate']:,.0f}"])
            print(f"N={r['n']:,} done", file=sys.stderr, flush=True)
    print("### Mooncake Store: prefix delete, our index vs remove_by_regex / batch_remove\n")
    print(f"Median ms per call over {SAMPLES} distinct prefixes (3 for 64-prefix calls and the "
          "key dump); each prefix matches 4 keys; TCP loopback, forced removes.\n")
    print(markdown_table(
        ["N keys", "ours, 1 prefix", "remove_by_regex, 1 prefix", "speedup", "batch_remove, 4 "
         "exact keys", "ours, 64 prefixes", "remove_by_regex, 64-way alternation", "speedup",
         "list(prefix), ours", "/get_all_keys + filter", "load, keys/s"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
