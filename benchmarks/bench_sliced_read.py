"""Sliced reads: 64 trainer ranks (PP 8 × CP 8) each reading its share of one record.

Reference, measured side by side in the same run on the same stored record: every rank
reads the whole record (``RoutingReader.get``, checksum verified) and slices it in memory
— what a trainer does without sliced reads.  Ours: ``RoutingReader.get_slice`` with the
rank's decoder layers (its pipeline stage) and its two context-parallel chunks (Megatron's
load-balanced split: chunks ``r`` and ``2·cp − 1 − r`` of ``2·cp``).  Bytes are counted
by the store's own metrics (``InstrumentedStore``); times are medians over the ranks of
paired measurements (whole, then sliced, for each rank in turn), CPU and wall.

Usage: python benchmarks/bench_sliced_read.py [--quick]
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


def run(num_layers: int, num_tokens: int, top_k: int) -> list[list[object]]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, size=(num_layers, num_tokens, top_k), dtype=np.uint16)
    layers = tuple(range(1, num_layers + 1))                     # decoder layer 0 is dense
    record = RoutingRecord("bench_1:0:0", ids, 256, layers=layers)
    from prometheus_client import CollectorRegistry

    with tempfile.TemporaryDirectory() as root:
        registry = CollectorRegistry()
        store = open_store(f"local://{root}", "bench", metrics_registry=registry)
        store.put_parts("bench_1:0:0", encode_record_parts(record))
        reader = RoutingReader(store)
        labels = {"namespace": "bench", "store": "local", "rank": ""}

        def read_bytes() -> float:
            return registry.get_sample_value("fd_rr_store_read_bytes_total", labels) or 0.0

        reader.get("bench_1:0:0")                                 # warm the page cache
        whole_wall, whole_cpu, sliced_wall, sliced_cpu = [], [], [], []
        whole_bytes = sliced_bytes = 0.0
        for pp in range(PP):
            for cp in range(CP):
                mine, spans = rank_share(layers, num_tokens, pp, cp)
                before, wall, cpu = read_bytes(), time.perf_counter(), time.process_time()
                full = reader.get("bench_1:0:0")
                reference = [slice_record(full, layers=mine, tokens=span).ids for span in spans]
                whole_wall.append(time.perf_counter() - wall)
                whole_cpu.append(time.process_time() - cpu)
                whole_bytes += read_bytes() - before
                before, wall, cpu = read_bytes(), time.perf_counter(), time.process_time()
                got = [reader.get_slice("bench_1:0:0", layers=mine, tokens=span).ids
                       for span in spans]
                sliced_wall.append(time.perf_counter() - wall)
                sliced_cpu.append(time.process_time() - cpu)
                sliced_bytes += read_bytes() - before
                for a, b in zip(reference, got, strict=True):
                    np.testing.assert_array_equal(a, b)           # same answer, fewer bytes
        store.close()
    med = statistics.median
    size = f"{num_layers}×{num_tokens}×{top_k} uint16 ({ids.nbytes / 2**20:.1f} MiB)"
    return [
        [size, "whole record per rank (reference)", f"{whole_bytes / 2**20:.1f} MiB",
         fmt_seconds(med(whole_wall)), fmt_seconds(med(whole_cpu)), "1×", "1×"],
        [size, "get_slice: the rank's layers and CP chunks", f"{sliced_bytes / 2**20:.1f} MiB",
         fmt_seconds(med(sliced_wall)), fmt_seconds(med(sliced_cpu)),
         f"{whole_bytes / sliced_bytes:.0f}× fewer bytes",
         f"{med(whole_wall) / med(sliced_wall):.0f}× faster (wall)"],
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 4k-token record")
    args = parser.parse_args()
    rows = run(60, 4096 if args.quick else 32768, 8)
    print(f"64 ranks (PP {PP} × CP {CP}), local store, page cache warm; totals over the 64 ranks, "
          "medians per rank\n")
    print(markdown_table(["record", "read", "bytes read (64 ranks)", "wall / rank (median)",
                          "CPU / rank (median)", "bytes vs reference", "time vs reference"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
