"""Fused put: one record per request vs one put per MoE layer, through P2PStore and Redis.

Claim (issue 6): storing a request's routing as ONE self-describing rr-v1 record is
cheaper than FastDeploy's per-layer mode (one raw ``[tokens, top_k]`` object per layer,
key ``{rollout_id}_{layer}``) in time, keys and metadata bytes — on P2PStore's TCP
transport and on Redis.  Shape: 60 layers x 32,768 tokens x top-8, uint8 (15.7 MB).

Side by side in one run, on one throwaway redis-server (free loopback port) and one
P2PStore client (TCP transport, metadata in that Redis):

* ``fused``      — our store, ``put_parts(header, payload)`` of one record; get + decode;
* ``per-layer``  — our store, 60 puts of the raw layer bytes; 60 gets;
* ``per-layer (raw P2PClient)`` — the reference as FastDeploy does it: 60
  ``P2PClient.put(key, ndarray)`` / ``get`` calls without our wrapper.

Delete is ``delete_prefix(rollout_id)`` for our stores (both layouts match the prefix) and
``delete_batch`` of the 60 keys for the raw client.  Times are medians over repetitions,
each on a fresh rollout id; "Redis bytes" is the ``used_memory`` growth per request.

    python benchmarks/bench_fused_put.py            # 32,768 tokens, 5 repetitions
    python benchmarks/bench_fused_put.py --quick    # 8,192 tokens, 3 repetitions
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_seconds, markdown_table  # noqa: E402

from fd_routing_replay.codec import RoutingRecord, decode_record, encode_record_parts  # noqa: E402
from fd_routing_replay.store import open_store  # noqa: E402
from fdrr_dev.testing.redis import RedisServer  # noqa: E402

LAYERS, TOP_K, EXPERTS = 60, 8, 128


def used_memory(server: RedisServer) -> int:
    return int(server.info("memory")["used_memory"])


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def run_case(label: str, server: RedisServer, repeats: int, put: Callable[[str], int],
             get: Callable[[str], None], delete: Callable[[str], None], keys: int
             ) -> dict[str, object]:
    puts, gets, deletes, redis_bytes, stored = [], [], [], [], 0
    for rep in range(repeats + 1):  # the first repetition warms connections up
        rollout = f"exp_epoch_3_{label.replace(' ', '-')}_{rep}:0:0"
        before = used_memory(server)
        seconds, stored = timed(lambda rollout=rollout: put(rollout))
        grown = used_memory(server) - before
        get_seconds, _ = timed(lambda rollout=rollout: get(rollout))
        delete_seconds, _ = timed(lambda rollout=rollout: delete(rollout))
        if rep:
            puts.append(seconds)
            gets.append(get_seconds)
            deletes.append(delete_seconds)
            redis_bytes.append(grown)
    return {"keys": keys, "stored": stored, "redis": statistics.median(redis_bytes),
            "put": statistics.median(puts), "get": statistics.median(gets),
            "delete": statistics.median(deletes)}


def cases_for_store(store, ids: np.ndarray) -> dict[str, tuple]:
    head, payload = encode_record_parts(RoutingRecord("x:0:0", ids, EXPERTS))

    def fused_put(rollout: str) -> int:
        head, payload = encode_record_parts(RoutingRecord(rollout, ids, EXPERTS))
        store.put_parts(rollout, [head, payload])
        return len(head) + payload.nbytes

    def fused_get(rollout: str) -> None:
        record = decode_record(store.get(rollout))
        assert record.ids.shape == ids.shape and record.ids[-1, -1, -1] == ids[-1, -1, -1]

    def layer_put(rollout: str) -> int:
        for layer in range(LAYERS):
            store.put(f"{rollout}_{layer}", ids[layer].tobytes())
        return ids.nbytes

    def layer_get(rollout: str) -> None:
        layers = [np.frombuffer(store.get(f"{rollout}_{layer}"), np.uint8) for layer in
                  range(LAYERS)]
        assert sum(a.size for a in layers) == ids.size

    def delete(rollout: str) -> None:
        assert store.delete_prefix([rollout])[rollout] >= 1

    return {"fused (1 record)": (fused_put, fused_get, delete, 1),
            f"per-layer ({LAYERS} puts)": (layer_put, layer_get, delete, LAYERS)}


def raw_client_case(store, ids: np.ndarray) -> tuple:
    """FastDeploy's per-layer calls on the bare P2PClient (no frame, no index, no escaping)."""
    client, run = store.client, store._bridge.run

    def put(rollout: str) -> int:
        for layer in range(LAYERS):
            assert run(client.put(f"raw/{rollout}_{layer}", ids[layer]), 120)
        return ids.nbytes

    def get(rollout: str) -> None:
        for layer in range(LAYERS):
            assert run(client.get(f"raw/{rollout}_{layer}"), 120) is not None

    def delete(rollout: str) -> None:
        run(client.delete_batch([f"raw/{rollout}_{layer}" for layer in range(LAYERS)]), 120)

    return put, get, delete, LAYERS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8,192 tokens, 3 repetitions")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    tokens = args.tokens or (8192 if args.quick else 32768)
    repeats = args.repeats or (3 if args.quick else 5)
    ids = np.random.default_rng(7).integers(0, EXPERTS, size=(LAYERS, tokens, TOP_K),
                                            dtype=np.uint8)
    rows = []
    with RedisServer() as server, tempfile.TemporaryDirectory() as logs:
        stores = {
            "P2PStore (TCP)": open_store({"type": "p2pstore", "namespace": "bench",
                                          "p2pstore": {"metadata_server": server.url,
                                                       "protocol": "tcp", "log_dir": logs}}),
            "Redis": open_store(server.url, "bench"),
        }
        try:
            for store_name, store in stores.items():
                cases = cases_for_store(store, ids)
                if store_name.startswith("P2PStore"):
                    cases["per-layer (raw P2PClient, FastDeploy's calls)"] = \
                        raw_client_case(store, ids)
                results = {name: run_case(name, server, repeats, *case)
                           for name, case in cases.items()}
                fused = results["fused (1 record)"]
                for name, result in results.items():
                    rows.append([store_name, name, result["keys"], f"{result['stored']:,}",
                                 f"{int(result['redis']):,}", fmt_seconds(result["put"]),
                                 fmt_seconds(result["get"]), fmt_seconds(result["delete"]),
                                 f"{result['put'] / fused['put']:.2f}x",
                                 f"{result['get'] / fused['get']:.2f}x"])
        finally:
            for store in stores.values():
                store.close()
    print(f"### Fused put vs per-layer puts ({LAYERS} layers x {tokens:,} tokens x top-{TOP_K}, "
          f"uint8, {ids.nbytes / 2**20:.1f} MiB per request; median of {repeats})\n")
    print(markdown_table(["store", "layout", "keys", "value bytes", "Redis bytes",
                          "put", "get", "delete", "put vs fused", "get vs fused"], rows))
    print("\nRedis bytes: growth of `used_memory` per request (P2PStore: metadata and our "
          "index only; the payload stays in the provider's memory).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
