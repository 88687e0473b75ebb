"""Multi-turn prefix omission: engine-side cost per turn of a 100-turn, 32k-token rollout.

Each turn re-sends the conversation: turn t forwards ≈ 328·(t+1) positions, 60 MoE layers
× top-8 (uint8), rows already in the host slot cache (as after a prefix-cache hit).
Reference, measured side by side in the same run on the same slot cache: the full
hand-off (every position gathered into the writer's ring).  Ours: the same
:class:`~fd_routing_replay.capture.handoff.Handoff` with ``prefix_omission``: it checks the
stored previous turn (``durable_prefix``) and the tokens hash of the shared prefix and hands
over only the new positions; the writer prepends the stored rows.  Engine-side cost = what
the engine thread pays (``Handoff.finish``: the prefix check, the gather into the ring, the
put's description); the writer's work happens off that thread (thread mode here, flushed
untimed after each hand-off).  The stored records of both paths are compared at every turn.

Usage: python benchmarks/bench_prefix_omission.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_seconds, markdown_table  # noqa: E402

from fd_routing_replay.capture.handoff import Handoff  # noqa: E402
from fd_routing_replay.capture.slots import HostSlotCache  # noqa: E402
from fd_routing_replay.codec import decode_record  # noqa: E402
from fd_routing_replay.store.local import LocalStore  # noqa: E402
from fd_routing_replay.writer import RoutingWriter  # noqa: E402

LAYERS, TOP_K, BLOCK = 60, 8, 64


def run(turns: int, max_tokens: int) -> tuple[list[list[object]], dict[str, float]]:
    rng = np.random.default_rng(0)
    cache = HostSlotCache(max_tokens, LAYERS, TOP_K, np.dtype(np.uint8), 255)
    cache.array[...] = rng.integers(0, 64, size=cache.array.shape, dtype=np.uint8)
    tokens = rng.integers(0, 150_000, size=max_tokens + 1).tolist()
    block_row = np.arange(max_tokens // BLOCK, dtype=np.int64)
    per_turn = max_tokens // turns
    rows = []
    total = {"full": 0.0, "omit": 0.0, "full_bytes": 0, "omit_bytes": 0}
    with tempfile.TemporaryDirectory() as root:
        store = {"type": "local", "namespace": "bench", "local": {"root": root}}
        writer = RoutingWriter(store, {"mode": "thread", "journal_dir": f"{root}/j",
                                       "dead_letter_dir": f"{root}/d",
                                       "capacity_bytes": 256 << 20}, only_last_turn=True)
        full_side, omit_side = (Handoff(cache, writer, num_experts=64, layer_map=range(1, LAYERS + 1),
                                        prefix_omission=omit) for omit in (False, True))
        reader = LocalStore(root, "bench")
        row_bytes = LAYERS * TOP_K
        for turn in range(turns):
            n = per_turn * (turn + 1)
            start = time.perf_counter()
            assert full_side.finish(f"full_1:{turn}:0", None, block_row, n, BLOCK, tokens)
            full_s = time.perf_counter() - start
            full_bytes = n * row_bytes
            assert writer.flush(timeout=120)      # the writer's work stays out of the next timing
            omitted_before = omit_side.counters["prefix_omitted"]
            prefix = writer.durable_prefix(f"omit_1:{turn}:0")      # what the hand-off will see
            start = time.perf_counter()
            assert omit_side.finish(f"omit_1:{turn}:0", None, block_row, n, BLOCK, tokens)
            omit_s = time.perf_counter() - start
            skip = prefix.num_tokens if omit_side.counters["prefix_omitted"] > omitted_before else 0
            omit_bytes = (n - skip) * row_bytes
            assert writer.flush(timeout=120)
            full = decode_record(reader.get(f"full_1:{turn}:0"))
            omitted = decode_record(reader.get(f"omit_1:{turn}:0"))
            assert np.array_equal(full.ids, omitted.ids) and full.metadata == omitted.metadata \
                and full.provenance == omitted.provenance, f"turn {turn} differs"
            total["full"] += full_s
            total["omit"] += omit_s
            total["full_bytes"] += full_bytes
            total["omit_bytes"] += omit_bytes
            if turn in (1, turns // 10, turns // 2, turns - 1):
                rows.append([turn + 1, n, f"{full_bytes / 2**20:.2f} MiB", fmt_seconds(full_s),
                             f"{omit_bytes / 2**20:.3f} MiB", fmt_seconds(omit_s),
                             f"{full_s / omit_s:.0f}×", f"{full_bytes / omit_bytes:.0f}×"])
        writer.close()
    return rows, total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 turns, 8k tokens")
    args = parser.parse_args()
    turns, tokens = (20, 8192) if args.quick else (100, 32768)
    rows, total = run(turns, tokens)
    print(f"{turns} turns up to {tokens} tokens, {LAYERS} layers × top-{TOP_K} uint8; stored "
          "records of both paths identical (ids, metadata, provenance) at every turn\n")
    print(markdown_table(["turn", "positions", "full: bytes handed over", "full: engine time",
                          "omission: bytes", "omission: engine time", "time ratio",
                          "bytes ratio"], rows))
    print(f"\nall {turns} turns: full {fmt_seconds(total['full'])} / "
          f"{total['full_bytes'] / 2**20:.0f} MiB, omission {fmt_seconds(total['omit'])} / "
          f"{total['omit_bytes'] / 2**20:.1f} MiB ({total['full'] / total['omit']:.0f}× less "
          "engine time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
