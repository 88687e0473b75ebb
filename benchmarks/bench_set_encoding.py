"""Set encoding (``capture.encoding: set``): bytes per token-layer and throughput.

Claims (issues 15 and 21): the ``set`` payload stores a token-layer's top-k in at most
1.1 × the information bound log2 C(E, k) / 8 bytes, for E ∈ {64, 160, 256} and
k ∈ {2, 6, 8} and for today's MoE shapes up to (E, k) = (512, 10) (69-bit ranks), on
uniform and on skewed routing.  Speed (issue 21): with the compiled codec
(custom_ops/set_codec.cc), decoding a set record costs at most 20 × decoding the plain
record, and encoding it at most 10 × encoding the plain record, measured side by side in
this run: per repeat the plain and set calls run back to back (CPU time of this thread),
the cost ratio is taken per repeat, and the table shows the median ratio.  The compiled
codec is the package's one implementation; the NumPy one it replaced is the tests' oracle
now (tests/set_oracle.py), which benchmarks do not import, so its column is gone
(docs/benchmarks.md keeps the last figures measured with it).

Routing: ``uniform`` (every k-set equally likely), ``zipf`` (per layer, expert popularity
∝ 1 / rank^1.2 under a random permutation, k drawn without replacement by Gumbel top-k)
and ``harness`` (the router of the harness's tiny MoE model, fdrr_dev.harness,
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

import fd_routing_replay.codec.setcodec as setcodec  # noqa: E402
from fd_routing_replay.codec import (  # noqa: E402
    RoutingRecord,
    decode_record,
    encode_record,
    encode_record_parts,
    routing_dtype,
)

EXPERTS = (64, 160, 256)
TOP_KS = (2, 6, 8)
MODELS = ((8, 2), (64, 8), (128, 8), (160, 6), (256, 8), (384, 8), (512, 10))
"""(E, k) of today's MoE models (Mixtral 8×2 ... Qwen3-Next-style 512×10)."""
DECODE_GOAL, ENCODE_GOAL = 20.0, 10.0
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
        from fdrr_dev.harness.model import TinyMoEConfig, TinyMoEModel
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


def paired_seconds(operations: list[tuple[str, Callable[[], object]]],
                   repeats: int) -> dict[str, list[float]]:
    """CPU seconds (this thread) of each operation per repeat, round robin, so the ratio
    of two operations can be taken per repeat (a noisy moment hits both)."""
    samples: dict[str, list[float]] = {name: [] for name, _ in operations}
    for _, func in operations:
        func()  # warm up: page faults, lookup tables
    for _ in range(repeats):
        for name, func in operations:
            start = time.thread_time()
            func()
            samples[name].append(time.thread_time() - start)
    return samples


def median_ratio(samples: dict[str, list[float]], top: str, bottom: str) -> float:
    return statistics.median(a / b for a, b in zip(samples[top], samples[bottom], strict=True))


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
    plain = encode_record(record)
    encoded = encode_record(record, encoding="set")

    operations = [
        ("plain encode", lambda: encode_record_parts(record)),
        ("set encode", lambda: encode_record_parts(record, encoding="set")),
        ("plain decode", lambda: decode_record(plain)),
        ("set decode", lambda: decode_record(encoded)),
    ]
    samples = paired_seconds(operations, repeats)

    def rate(name: str) -> str:
        return f"{rows / statistics.median(samples[name]) / 1e6:,.1f} M"

    encode_cost = median_ratio(samples, "set encode", "plain encode")
    decode_cost = median_ratio(samples, "set decode", "plain decode")
    met = "yes" if encode_cost <= ENCODE_GOAL and decode_cost <= DECODE_GOAL else "**NO**"
    return [experts, ids.shape[2], routing, rate("plain encode"), rate("set encode"),
            f"{encode_cost:.1f}×", rate("plain decode"), rate("set decode"),
            f"{decode_cost:.1f}×", met]


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
    for experts, top_k in MODELS:
        if experts in EXPERTS and top_k in TOP_KS:
            continue
        uniform = uniform_routing(rng, layers, tokens, experts, top_k)
        sizes.append(size_row("uniform", uniform, experts))
        sizes.append(size_row(f"zipf {ZIPF_EXPONENT}",
                              zipf_routing(rng, layers, tokens, experts, top_k), experts))
        speeds.append(speed_row("uniform", uniform, experts, repeats))

    print(f"### Bytes per token-layer ({layers} layers × {tokens} tokens per record; harness: "
          "its model's 3 MoE layers over random 256-token prompts)\n")
    print(markdown_table(["E", "k", "routing", "plain B", "set B", "bound B", "set / bound",
                          f"≤ {TARGET}×", "set + zstd-3 B", "sorted plain + zstd-3 B"], sizes))
    if harness_missing:
        print("\nharness rows skipped: Paddle (fdrr_dev.harness) not importable")
    print(f"\n### Throughput and cost vs the plain record ({layers} × {tokens} token-layers per "
          f"record, {repeats} paired repeats, CPU time of one thread)\n")
    print(f"Set codec: {setcodec.set_codec_backend()} ({setcodec.set_codec_reason()}). "
          "encode = `encode_record_parts` (plain: header + checksum of a zero-copy view; set: "
          "+ the set payload); decode = `decode_record`, checksum verified (plain: zero-copy "
          "view; set: + decoding into a new array). Rates: token-layers per second (median); "
          "costs: median over repeats of set time / plain time of the same repeat. Goals: "
          f"encode ≤ {ENCODE_GOAL:.0f}×, decode ≤ {DECODE_GOAL:.0f}×.\n")
    print(markdown_table(["E", "k", "routing", "plain encode", "set encode", "encode cost",
                          "plain decode", "set decode", "decode cost", "goals met"], speeds))


if __name__ == "__main__":
    main()
