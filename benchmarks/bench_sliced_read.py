"""Sliced reads: 64 trainer ranks (PP 8 × CP 8) each reading its share of one record.

Reference, measured side by side in the same run on the same stored record: every rank
reads the whole record (``RoutingReader.get``, checksum verified) and slices it in memory
— what a trainer does without sliced reads.  Ours: ``RoutingReader.get_slice`` with the
rank's decoder layers (its pipeline stage) and its two context-parallel chunks (Megatron's
load-balanced split: chunks ``r`` and ``2·cp − 1 − r`` of ``2·cp``).  Bytes are counted
by the store's own metrics (``InstrumentedStore``); times are medians over the ranks of
paired measurements (whole, then sliced, for each rank in turn), CPU and wall.

On Redis (a throwaway ``redis-server`` on loopback) bytes are what the server sent
(``INFO stats`` ``total_net_output_bytes``); a sliced read fetches the chunks holding the
header and the rank's bytes, so the record is stored twice, in ``store.redis.chunk_bytes``
of 1 MiB (the default since issue #33) and of 8 MiB (the default before), and read both
ways from each.

Usage: python benchmarks/bench_sliced_read.py [--quick] [--stores local,redis]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_seconds, markdown_table  # noqa: E402

from fd_routing_replay.codec import RoutingRecord, encode_record_parts  # noqa: E402
from fd_routing_replay.reader import RoutingReader  # noqa: E402
from fd_routing_replay.reader.sliced import slice_record  # noqa: E402
from fd_routing_replay.store import open_store  # noqa: E402

PP, CP = 8, 8


def rank_share(layers: tuple[int, ...], num_tokens: int, pp: int, cp: int) -> tuple[list[int], list[slice]]:
    per_stage = -(-len(layers) // PP)
    chunk = -(-num_tokens // (2 * CP))
    mine = list(layers[pp * per_stage:(pp + 1) * per_stage])
    spans = [slice(c * chunk, min((c + 1) * chunk, num_tokens)) for c in (cp, 2 * CP - 1 - cp)]
    return mine, spans


def _paired(whole_reader, sliced_readers, layers, num_tokens, sent):  # noqa: ANN001
    """For every rank: the whole record then each sliced way; bytes via ``sent()``."""
    results = {name: ([], [], 0.0) for name in ["whole", *sliced_readers]}
    whole_reader.get("bench_1:0:0")                                 # warm caches
    for pp in range(PP):
        for cp in range(CP):
            mine, spans = rank_share(layers, num_tokens, pp, cp)
            before, wall, cpu = sent(), time.perf_counter(), time.process_time()
            full = whole_reader.get("bench_1:0:0")
            reference = [slice_record(full, layers=mine, tokens=span).ids for span in spans]
            walls, cpus, total = results["whole"]
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
            results["whole"] = (walls, cpus, total + sent() - before)
            for name, reader in sliced_readers.items():
                before, wall, cpu = sent(), time.perf_counter(), time.process_time()
                got = [reader.get_slice("bench_1:0:0", layers=mine, tokens=span).ids
                       for span in spans]
                walls, cpus, total = results[name]
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
                results[name] = (walls, cpus, total + sent() - before)
                for a, b in zip(reference, got, strict=True):
                    np.testing.assert_array_equal(a, b)           # same answer, fewer bytes
    return results


def run(num_layers: int, num_tokens: int, top_k: int, store_kind: str) -> list[list[object]]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, size=(num_layers, num_tokens, top_k), dtype=np.uint16)
    layers = tuple(range(1, num_layers + 1))                     # decoder layer 0 is dense
    record = RoutingRecord("bench_1:0:0", ids, 256, layers=layers)
    from prometheus_client import CollectorRegistry

    labels = {"namespace": "bench", "store": store_kind, "rank": ""}
    names = {"sliced": "get_slice: the rank's layers and CP chunks"}
    if store_kind == "local":
        root = tempfile.TemporaryDirectory()
        registry = CollectorRegistry()
        store = open_store(f"local://{root.name}", "bench", metrics_registry=registry)
        store.put_parts("bench_1:0:0", encode_record_parts(record))
        reader = RoutingReader(store)
        results = _paired(reader, {"sliced": reader}, layers, num_tokens, lambda: registry.
                          get_sample_value("fd_rr_store_read_bytes_total", labels) or 0.0)
        store.close()
        root.cleanup()
    else:
        from fdrr_dev.testing.redis import RedisServer

        results = {}
        with RedisServer() as server:
            for chunk in (8, 1):
                store = open_store({"url": server.url, "namespace": f"bench{chunk}",
                                    "redis": {"chunk_bytes": chunk * 2**20}}, instrument=False)
                store.put_parts("bench_1:0:0", encode_record_parts(record))
                reader = RoutingReader(store)
                got = _paired(reader, {"sliced": reader}, layers, num_tokens,
                              lambda: float(server.info("stats")["total_net_output_bytes"]))
                results[f"whole{chunk}"], results[f"sliced{chunk}"] = got["whole"], got["sliced"]
                store.close()
        results["whole"] = results["whole8"]
        names = {"whole1": "whole record per rank, 1 MiB chunks (the default)",
                 "sliced1": "get_slice, 1 MiB chunks (the default)",
                 "sliced8": "get_slice, 8 MiB chunks (the default before #33)"}
    med = statistics.median
    size = f"{num_layers}×{num_tokens}×{top_k} uint16 ({ids.nbytes / 2**20:.1f} MiB), {store_kind}"
    whole_walls, whole_cpus, whole_bytes = results["whole"]
    reference = "whole record per rank (reference)" + (", 8 MiB chunks" if store_kind != "local"
                                                       else "")
    rows = [[size, reference, f"{whole_bytes / 2**20:.1f} MiB",
             fmt_seconds(med(whole_walls)), fmt_seconds(med(whole_cpus)), "1×", "1×"]]
    for name, label in names.items():
        walls, cpus, total = results[name]
        rows.append([size, label, f"{total / 2**20:.1f} MiB", fmt_seconds(med(walls)),
                     fmt_seconds(med(cpus)), f"{whole_bytes / total:.1f}× fewer bytes",
                     f"{med(whole_walls) / med(walls):.1f}× faster (wall)"])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 4k-token record")
    parser.add_argument("--stores", default="local,redis")
    args = parser.parse_args()
    rows = []
    for kind in args.stores.split(","):
        rows += run(60, 4096 if args.quick else 32768, 8, kind)
    print(f"64 ranks (PP {PP} × CP {CP}), page cache warm; totals over the 64 ranks, medians per "
          "rank; bytes: the local store's read metrics, what Redis sent (INFO)\n")
    print(markdown_table(["record", "read", "bytes read (64 ranks)", "wall / rank (median)",
                          "CPU / rank (median)", "bytes vs reference", "time vs reference"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
