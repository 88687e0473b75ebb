"""Set encoding (``capture.encoding: set``): bytes per token-layer and throughput.

Claim (issue 15): the ``set`` payload stores a token-layer's top-k in at most 1.1 × the
information bound log2 C(E, k) / 8 bytes, for E ∈ {64, 160, 256} and k ∈ {2, 6, 8}, on
uniform and on skewed routing; encode and decode throughput in token-layers per second,
measured in the same run against one copy of the plain payload (``np.copyto``).

Routing: ``uniform`` (every k-set equally likely), ``zipf`` (per layer, expert popularity
∝ 1 / rank^1.2 under a random permutation, k drawn without replacement by Gumbel top-k)
and ``harness`` (the router of the harness's tiny MoE model, fd_routing_replay.harness,
run over random prompts with E experts and top-k; skipped when Paddle is missing).  The
set payload has a fixed width per row, so its size cannot depend on the routing; the zstd
columns (the ``zstd`` command, level 3, when installed) show whether general-purpose
compression on top would pay.

Usage: python benchmarks/bench_set_encoding.py [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import markdown_table  # noqa: E402

from fd_routing_replay.codec import (  # noqa: E402
    RoutingRecord,
    decode_record,
    encode_record,
    encode_record_parts,
    routing_dtype,
)

EXPERTS = (64, 160, 256)
TOP_KS = (2, 6, 8)
ZIPF_EXPONENT = 1.2
TARGET = 1.1
ROLLOUT = "exp_bench_set_0000042:gen7:0:0"


def uniform_routing(rng: np.random.Generator, layers: int, tokens: int, experts: int,
                    top_k: int) -> np.ndarray:
    keys = rng.random((layers * tokens, experts), dtype=np.float32)
    return np.argpartition(keys, top_k - 1, axis=1)[:, :top_k].reshape(layers, tokens, top_k)


def zipf_routing(rng: np.random.Generator, layers: int, tokens: int, experts: int,
                 top_k: int) -> np.ndarray:
    out = np.empty((layers, tokens, top_k), dtype=np.int64)
    weights = -ZIPF_EXPONENT * np.log(np.arange(1, experts + 1, dtype=np.float32))
    for layer in range(layers):
        scores = weights[rng.permutation(experts)] + rng.gumbel(size=(tokens, experts)).astype(
            np.float32)
        out[layer] = np.argpartition(-scores, top_k - 1, axis=1)[:, :top_k]
    return out


def harness_routing(rng: np.random.Generator, experts: int, top_k: int,
                    sequences: int) -> np.ndarray | None:
    """The tiny MoE model's own top-k over random prompts: ``[L_moe, S·n, K]``."""
    try:
        from fd_routing_replay.harness.model import TinyMoEConfig, TinyMoEModel
    except Exception:  # noqa: BLE001 - Paddle missing or broken: the row says so
        return None
    model = TinyMoEModel(TinyMoEConfig(num_experts=experts, top_k=top_k, seed=1234))
    config = model.config
    parts = [model.forward_full(rng.integers(1, config.vocab_size, size=256)).topk_ids
             for _ in range(sequences)]
    return np.concatenate(parts, axis=1).astype(np.int64)


def zstd_size(data: bytes) -> int | None:
    if shutil.which("zstd") is None:
        return None
    done = subprocess.run(["zstd", "-3", "-c", "-q"], input=data, capture_output=True, check=True)
    return len(done.stdout)


def median_rates(operations: list[tuple[str, Callable[[], object]]], rows: int,
                 repeats: int) -> dict[str, float]:
    """Token-layers per second of each operation: median over round-robin repeats."""
    samples: dict[str, list[float]] = {name: [] for name, _ in operations}
    for _, func in operations:
        func()  # warm up: page faults, lookup tables
    for _ in range(repeats):
        for name, func in operations:
            start = time.perf_counter()
            func()
            samples[name].append(time.perf_counter() - start)
    return {name: rows / statistics.median(times) for name, times in samples.items()}


def size_row(routing: str, ids: np.ndarray, experts: int) -> list[object]:
    dtype = routing_dtype(experts)
    ids = np.ascontiguousarray(ids, dtype=dtype)
    top_k = ids.shape[2]
    rows = ids.shape[0] * ids.shape[1]
    record = RoutingRecord(ROLLOUT, ids, experts)
    _, payload = encode_record_parts(record, encoding="set")
    decoded = decode_record(encode_record(record, encoding="set"))
    if not np.array_equal(decoded.ids, np.sort(ids, axis=2)):
        raise SystemExit(f"round trip failed for E={experts} k={top_k} {routing}")
    per_row = payload.nbytes / rows
    bound = math.log2(math.comb(experts, top_k)) / 8
    zstd_set = zstd_size(bytes(payload))
    zstd_plain = zstd_size(np.sort(ids, axis=2).tobytes())
    return [experts, top_k, routing, f"{top_k * dtype.itemsize} ({dtype.name})", f"{per_row:.3f}",
            f"{bound:.3f}", f"{per_row / bound:.3f}", "yes" if per_row <= TARGET * bound else "**NO**",
            "n/a" if zstd_set is None else f"{zstd_set / rows:.3f}",
            "n/a" if zstd_plain is None else f"{zstd_plain / rows:.3f}"]


def speed_row(routing: str, ids: np.ndarray, experts: int, repeats: int) -> list[object]:
    dtype = routing_dtype(experts)
    ids = np.ascontiguousarray(ids, dtype=dtype)
    rows = ids.shape[0] * ids.shape[1]
    record = RoutingRecord(ROLLOUT, ids, experts)
    encoded = encode_record(record, encoding="set")
    destination = np.empty_like(ids)
    rates = median_rates([
        ("copy", lambda: np.copyto(destination, ids)),
        ("encode", lambda: encode_record_parts(record, encoding="set")),
        ("decode", lambda: decode_record(encoded)),
    ], rows, repeats)

    def millions(rate: float) -> str:
        return f"{rate / 1e6:,.1f} M"

    return [experts, ids.shape[2], routing, millions(rates["copy"]), millions(rates["encode"]),
            millions(rates["decode"]), f"{rates['copy'] / rates['encode']:.0f}×",
            f"{rates['copy'] / rates['decode']:.0f}×"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small records, few repeats")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per row (median)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 7)
    layers, tokens = (8, 2048) if args.quick else (60, 4096)
    rng = np.random.default_rng(args.seed)

    sizes, speeds, harness_missing = [], [], False
    for experts in EXPERTS:
        for top_k in TOP_KS:
            uniform = uniform_routing(rng, layers, tokens, experts, top_k)
            skewed = zipf_routing(rng, layers, tokens, experts, top_k)
            harness = harness_routing(rng, experts, top_k, 2 if args.quick else 8)
            sizes.append(size_row("uniform", uniform, experts))
            sizes.append(size_row(f"zipf {ZIPF_EXPONENT}", skewed, experts))
            if harness is None:
                harness_missing = True
            else:
                sizes.append(size_row("harness", harness, experts))
            speeds.append(speed_row("uniform", uniform, experts, repeats))
            speeds.append(speed_row(f"zipf {ZIPF_EXPONENT}", skewed, experts, repeats))

    print(f"### Bytes per token-layer ({layers} layers × {tokens} tokens per record; harness: "
          "its model's 3 MoE layers over random 256-token prompts)\n")
    print(markdown_table(["E", "k", "routing", "plain B", "set B", "bound B", "set / bound",
                          f"≤ {TARGET}×", "set + zstd-3 B", "sorted plain + zstd-3 B"], sizes))
    if harness_missing:
        print("\nharness rows skipped: Paddle (fd_routing_replay.harness) not importable")
    print(f"\n### Throughput, token-layers per second ({layers} × {tokens} token-layers per "
          f"record, median of {repeats}, one core)\n")
    print("copy = `np.copyto` of the plain payload (uint8, uint16 for E = 256); encode = "
          "`encode_record_parts(..., encoding='set')`; decode = `decode_record` of the set "
          "record, checksum verified.\n")
    print(markdown_table(["E", "k", "routing", "plain copy", "set encode", "set decode",
                          "encode cost vs copy", "decode cost vs copy"], speeds))


if __name__ == "__main__":
    main()
