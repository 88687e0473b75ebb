"""The compiled ops on CPU against reference approaches, side by side in one run.

For a 60-layer top-8 model with uint8 routing (160 experts):

* the per-layer record call (what the MoE hook runs in every layer): the library's bound
  ``StepRecorder.record`` against the same write done with Paddle's own eager ops (the
  bad-id mask, ``where``, the cast, a slice assignment, the two counter updates), at
  1/64/512/8k/64k tokens -- both checked equal;
* ``pack_request`` (a finished request's rows gathered through its block-table row into the
  writer's ring, ``[L, T, K]``) of 1k, 8k and 32k tokens from a slot cache of 4x as many
  slots in KV blocks of 64 slots in random order, against ONE memcpy of the same bytes
  (``np.copyto``).  "hot": back-to-back calls; "cold": a 64 MB buffer is streamed through
  the caches before every timed call (a request's rows are long out of cache when it
  finishes);
* the writer's unrouted-token count of a record (custom_ops/unrouted.cc in the C library)
  against NumPy's ``(ids == fill).any(axis=(0, 2))`` and one memcpy of the record, at 1k, 8k
  and 32k tokens.

Every repeat times each variant once in turn (round robin), so load from other processes
hits all rows alike.  Usage: python benchmarks/bench_ops.py [--quick] [--seed N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_seconds, markdown_table  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # Paddle's "no ccache" notice
    import paddle  # noqa: E402

from fd_routing_replay import ops  # noqa: E402
from fd_routing_replay.writer.record import count_unrouted  # noqa: E402

NUM_LAYERS, TOP_K, EXPERTS, BLOCK = 60, 8, 160, 64
_EVICT = np.ones(64 << 20, np.uint8)


def evict_caches() -> None:
    """Stream 64 MB (twice a 32 MB L3) so the next call starts from DRAM."""
    _EVICT.sum(dtype=np.uint64)


def round_robin(variants: list[Callable[[], object]], repeats: int, number: int = 1,
                setup: Callable[[], object] | None = None) -> list[float]:
    """Median seconds per call of each variant; ``number`` calls per sample."""
    for fn in variants:
        fn()  # warm up: page faults, first-call costs
    samples: list[list[float]] = [[] for _ in variants]
    for _ in range(repeats):
        for index, fn in enumerate(variants):
            if setup is not None:
                setup()
            start = time.perf_counter()
            for _ in range(number):
                fn()
            samples[index].append((time.perf_counter() - start) / number)
    return [statistics.median(s) for s in samples]


def record_case(rng: np.random.Generator, tokens: int, repeats: int) -> list[str]:
    """One MoE layer's record: the bound call against Paddle's eager ops doing the same."""
    layer = 7
    mine, theirs = (ops.new_step_buffer(tokens, NUM_LAYERS, TOP_K, EXPERTS) for _ in range(2))
    counters, their_counters = paddle.zeros([NUM_LAYERS + 1], "int64"), paddle.zeros([NUM_LAYERS + 1], "int64")
    recorder = ops.bind_step_recorder(mine, counters, num_experts=EXPERTS,
                                      host_rows=np.empty((tokens, NUM_LAYERS, TOP_K), np.uint8),
                                      host_counters=np.zeros(NUM_LAYERS + 1, np.int64),
                                      host_extra=np.zeros(0, np.uint8))
    raw = rng.integers(0, EXPERTS, (tokens, TOP_K))
    raw[rng.random(raw.shape) < 0.01] = EXPERTS + 3            # a few bad ids
    ids = paddle.to_tensor(raw)                                # Paddle's topk: int64

    def bound() -> None:
        recorder.record(ids, layer, tokens)

    def paddle_ops() -> None:
        bad = (ids < 0) | (ids >= EXPERTS)
        theirs[:tokens, layer, :] = paddle.where(bad, paddle.full_like(ids, 255), ids).cast("uint8")
        their_counters[0] += bad.sum()
        their_counters[1 + layer] += 1

    number = max(1, 2000 // tokens)
    t_bound, t_paddle = round_robin([bound, paddle_ops], repeats, number)
    if not np.array_equal(np.from_dlpack(mine), np.from_dlpack(theirs)) or \
            not np.array_equal(counters.numpy(), their_counters.numpy()):
        raise RuntimeError("the bound record and Paddle's ops disagree")
    return [f"record one MoE layer, {tokens:,} tokens × top-8", fmt_seconds(t_bound),
            f"Paddle eager ops {fmt_seconds(t_paddle)}", f"**{t_paddle / t_bound:.0f}×** less"]


def pack_case(rng: np.random.Generator, tokens: int, repeats: int) -> list[list[str]]:
    """A finished request's rows into a preallocated ``[L, T, K]`` (the writer's ring)."""
    num_slots = 4 * tokens
    cache = rng.integers(0, EXPERTS, (num_slots, NUM_LAYERS, TOP_K)).astype(np.uint8)
    block_row = rng.permutation(num_slots // BLOCK).astype(np.int64)
    out = np.empty((NUM_LAYERS, tokens, TOP_K), np.uint8)
    packed_src = rng.integers(0, EXPERTS, out.nbytes).astype(np.uint8)  # real pages
    packed_dst = np.ones(out.nbytes, np.uint8)
    pack = ops.request_packer()
    variants = [lambda: np.copyto(packed_dst, packed_src),
                lambda: pack(cache, block_row, 0, tokens, BLOCK, out)]
    rows = []
    for state, setup in (("hot", None), ("cold", evict_caches)):
        memcpy, mine = round_robin(variants, repeats, setup=setup)
        rows.append([f"pack_request, {tokens:,} tokens × 60 layers × top-8 ({out.nbytes / 1e6:.1f} MB, {state})",
                     fmt_seconds(mine), f"memcpy {fmt_seconds(memcpy)}", f"**{mine / memcpy:.2f}× memcpy**"])
    positions = np.arange(tokens)
    slots = block_row[positions // BLOCK] * BLOCK + positions % BLOCK
    if not np.array_equal(out, cache[slots].transpose(1, 0, 2)):
        raise RuntimeError("pack_request disagrees with NumPy")
    return rows


def unrouted_case(rng: np.random.Generator, tokens: int, repeats: int) -> list[str]:
    """The writer's count of tokens with the fill in some layer, on a record's ids."""
    ids = rng.integers(0, EXPERTS, (NUM_LAYERS, tokens, TOP_K)).astype(np.uint8)
    lost = rng.integers(0, tokens, max(1, tokens // 100))
    ids[rng.integers(0, NUM_LAYERS, lost.size), lost, rng.integers(0, TOP_K, lost.size)] = 255
    src, dst = rng.integers(0, 255, ids.nbytes).astype(np.uint8), np.ones(ids.nbytes, np.uint8)

    def numpy_count() -> int:
        return int(np.count_nonzero((ids == 255).any(axis=(0, 2))))

    memcpy, mine, theirs = round_robin([lambda: np.copyto(dst, src), lambda: count_unrouted(ids, 255),
                                        numpy_count], repeats)
    if count_unrouted(ids, 255) != numpy_count():
        raise RuntimeError("the unrouted counts disagree")
    return [f"unrouted count of a record, {tokens:,} tokens × 60 layers × top-8 ({ids.nbytes / 1e6:.1f} MB)",
            fmt_seconds(mine), f"NumPy {fmt_seconds(theirs)} · memcpy {fmt_seconds(memcpy)}",
            f"**{mine / memcpy:.2f}× memcpy** · {theirs / mine:.0f}× less than NumPy"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats, smaller sizes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    if ops.ops_backend() != "compiled":
        print(f"bench_ops: the compiled ops did not load ({ops.ops_backend_reason()}); run `make ops`",
              file=sys.stderr)
        return 1
    repeats = 5 if args.quick else 31
    sizes = [1024, 8192] if args.quick else [1024, 8192, 32768]
    rows = [record_case(rng, tokens, repeats)
            for tokens in ([1, 64, 512, 8192] if args.quick else [1, 64, 512, 8192, 65536])]
    for tokens in sizes:
        rows += pack_case(rng, tokens, repeats)
    rows += [unrouted_case(rng, tokens, repeats) for tokens in sizes]
    print(f"CPU, {ops.ops_backend()} ops ({ops.ops_backend_reason()}); median of {repeats} "
          "round-robin samples.\n")
    print(markdown_table(["case", "fd-routing-replay", "reference approach (same run, same inputs)", "ratio"],
                         rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
