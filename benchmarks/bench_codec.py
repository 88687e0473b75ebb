"""Codec overhead: rr-v1 encode + decode against one raw memcpy of the same payload.

Claim (issue 2): ``encode_record_parts`` + ``decode_record`` (checksum verified) of a 15 MB
record costs within 1.2x of ONE memcpy of the payload; the header stays ≤ 256 bytes.
Reference approach, measured side by side in the same run on the same data: one
``np.copyto`` of the payload into a preallocated array.  Each repeat times every row once,
in lockstep, in CPU time of this thread (``time.thread_time_ns``: what other processes on
a shared machine do does not count); a row's ratio is the median over repeats of its time
divided by the same repeat's memcpy (paired), its time the median of its own samples.
Records are format version 2 (issue #21): decoding also verifies the header checksum.
The checksum passes are shown through the package's checksum (the C library's XXH3 kernel,
issue #29, or the ``xxhash`` package where it is not built) and through ``xxhash`` itself,
next to one plain read pass over the same bytes (``ndarray.max``, vectorised): the floor
of any pass that reads every byte once.

``--cold`` streams 96 MiB through the cache before every timed call (untimed), so every row
reads its data and runs its code from memory: the regime where a pass is bound by DRAM
bandwidth, whatever the hash kernel.

Usage: python benchmarks/bench_codec.py [--quick] [--repeats N] [--cold]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_seconds, markdown_table  # noqa: E402

from fd_routing_replay.codec import (  # noqa: E402
    RoutingRecord,
    decode_record,
    encode_record,
    encode_record_parts,
    read_header,
)
from fd_routing_replay.codec.checksum import checksum_backend, xxh3_64  # noqa: E402

CASES = {
    "15 MB (60×32768×8 uint8)": (60, 32768, 8),
    "1 MB (64×2048×8 uint8)": (64, 2048, 8),
}


def bench_case(label: str, shape: tuple[int, int, int], repeats: int, seed: int,
               cold: bool = False) -> list[list[object]]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 128, size=shape, dtype=np.uint8)  # 128 experts, fill 255
    record = RoutingRecord("exp_epoch_3_data00042:gen7:0:0", ids, num_experts=128)
    destination = np.empty_like(ids)
    encoded = encode_record(record)
    payload = memoryview(ids.reshape(-1))
    encoded_payload = memoryview(encoded)[read_header(encoded).payload_offset:]
    flat, encoded_flat = ids.reshape(-1), np.frombuffer(encoded_payload, dtype=np.uint8)
    backend = checksum_backend()

    def parts_round_trip() -> None:
        encode_record_parts(record)
        decode_record(encoded)

    def full_round_trip() -> None:
        decode_record(encode_record(record))

    operations: list[tuple[str, Callable[[], object]]] = [
        ("reference: one memcpy of the payload (np.copyto)", lambda: np.copyto(destination, ids)),
        ("**encode_record_parts + decode_record**", parts_round_trip),
        ("encode_record (one copy) + decode_record", full_round_trip),
        ("encode_record_parts alone", lambda: encode_record_parts(record)),
        ("decode_record alone (verify=True)", lambda: decode_record(encoded)),
        ("decode_record (verify=False)", lambda: decode_record(encoded, verify=False)),
        ("read_header (v2: header checksum verified)", lambda: read_header(encoded)),
        (f"one xxh3_64 pass over the payload ({backend})", lambda: xxh3_64(payload)),
        (f"one xxh3_64 pass over the encoded record's payload ({backend})",
         lambda: xxh3_64(encoded_payload)),
        ("one xxh3_64 pass over the payload (xxhash package)", lambda: xxhash.xxh3_64_intdigest(payload)),
        ("one xxh3_64 pass over the encoded record's payload (xxhash package)",
         lambda: xxhash.xxh3_64_intdigest(encoded_payload)),
        ("one read pass over the payload (ndarray.max)", flat.max),
        ("one read pass over the encoded record's payload (ndarray.max)", encoded_flat.max),
    ]
    # Round-robin: every repeat times each operation once, so a burst of load from other
    # processes hits the reference and the codec alike instead of skewing one row.
    samples: list[list[int]] = [[] for _ in operations]
    for _, func in operations:
        func()  # warm up: page faults, caches
    flood = np.ones(96 << 20, np.uint8) if cold else None
    for _ in range(repeats):
        for index, (_, func) in enumerate(operations):
            if flood is not None:
                flood[::4096] += 1  # touch every page, then read every line: caches flushed
                flood.max()
            start = time.thread_time_ns()
            func()
            samples[index].append(time.thread_time_ns() - start)
    medians = [statistics.median(times) / 1e9 for times in samples]
    ratios = [statistics.median(t / max(m, 1) for t, m in zip(times, samples[0], strict=True))
              for times in samples]
    return [[label, name, fmt_seconds(seconds), f"{ratio:.2f}×"]
            for (name, _), seconds, ratio in zip(operations, medians, ratios, strict=True)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats (smoke run)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per row (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cold", action="store_true", help="flush the caches before each call")
    args = parser.parse_args(argv)
    repeats = args.repeats or (10 if args.quick else 200)

    rows = []
    for label, shape in CASES.items():
        rows += bench_case(label, shape, repeats, args.seed, args.cold)
    header_bytes = len(encode_record_parts(RoutingRecord(
        "exp_epoch_3_data00042:gen7:1:0:0".ljust(40, "x"), np.zeros((60, 32768, 8), np.uint8), 128))[0])
    print(f"Median of {repeats} calls (CPU time{', caches flushed before each' if args.cold else ''}); "
          "ratio = median of paired time / one memcpy of the same payload.\n")
    print(markdown_table(["payload", "operation", "median", "× memcpy"], rows))
    print(f"\nTarget: encode_record_parts + decode_record of 15 MB within 1.20× of one memcpy. "
          f"Header with a 40-character rollout id: {header_bytes} bytes (limit 256).")


if __name__ == "__main__":
    main()
