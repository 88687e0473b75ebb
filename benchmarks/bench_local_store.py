"""Local store: put/get of 1 MB and 15 MB records, and delete_prefix cost versus N.

Reference approaches, measured side by side in the same run:
- put/get: FastDeploy's local store saves each record with ``paddle.save`` (pickle) and
  loads it with ``paddle.load``.
- delete by prefix: a flat directory of one file per key, listed and filtered on every
  call (what a store without prefix buckets must do; FastDeploy's has no prefix delete).

Usage: python benchmarks/bench_local_store.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from urllib.parse import quote

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_seconds, markdown_table, median_seconds  # noqa: E402

from fd_routing_replay.codec import RoutingRecord, decode_record, encode_record_parts  # noqa: E402
from fd_routing_replay.keys import prefix_matches  # noqa: E402
from fd_routing_replay.store.local import LocalStore  # noqa: E402


def bench_put_get(root: Path, repeats: int) -> list[list[object]]:
    rng = np.random.default_rng(0)
    # 60 layers x top-8 uint8: 2,184 tokens is 1 MB, 32,768 tokens is 15 MB.
    return [put_get_row(root, label, rng.integers(0, 64, size=(60, tokens, 8), dtype=np.uint8),
                        repeats)
            for label, tokens in (("1 MB", 2184), ("15 MB", 32768))]


def put_get_row(root: Path, label: str, ids: np.ndarray, repeats: int) -> list[object]:
    import paddle

    record = RoutingRecord(rollout_id="bench_1:0:0", ids=ids, num_experts=64)
    store = LocalStore(root / "ours", "bench")
    put = median_seconds(lambda: store.put_parts("bench_1:0:0", encode_record_parts(record)),
                         repeats)
    get = median_seconds(lambda: decode_record(store.get("bench_1:0:0")), repeats)
    ref_path = str(root / "ref.pdparams")
    tensor = paddle.to_tensor(ids)
    ref_put = median_seconds(lambda: paddle.save(tensor, ref_path), repeats)
    ref_get = median_seconds(lambda: paddle.load(ref_path), repeats)
    return [label, fmt_seconds(put), fmt_seconds(ref_put), f"{ref_put / put:.1f}×",
            fmt_seconds(get), fmt_seconds(ref_get), f"{ref_get / get:.1f}×"]


def keys_for(count: int) -> list[str]:
    return [f"exp_epoch_3:{d}:{g}:{t}:0" for d in range(count // 4) for g in range(2)
            for t in range(2)]


def bench_prefix_delete(root: Path, sizes: list[int], repeats: int) -> list[list[object]]:
    return [prefix_delete_row(root, size, repeats) for size in sizes]


def prefix_delete_row(root: Path, size: int, repeats: int) -> list[object]:
    ours = LocalStore(root / f"ours{size}", "bench")
    flat = root / f"flat{size}"
    flat.mkdir()
    for key in keys_for(size):
        ours.put(key, b"r")
        (flat / quote(key, safe="")).write_bytes(b"r")
    probes = iter(range(size // 4 - 1, -1, -1))
    current = {"prefix": ""}

    def next_probe() -> None:
        current["prefix"] = f"exp_epoch_3:{next(probes)}"

    def ours_delete() -> None:
        assert ours.delete_prefix([current["prefix"]])[current["prefix"]] == 4

    def flat_delete() -> None:
        matched = [n for n in os.listdir(flat)
                   if prefix_matches(n.replace("%3A", ":"), current["prefix"])]
        for name in matched:
            os.unlink(flat / name)
        assert len(matched) == 4

    t_ours = median_seconds(ours_delete, repeats, next_probe)
    t_flat = median_seconds(flat_delete, repeats, next_probe)
    shutil.rmtree(root / f"ours{size}")
    shutil.rmtree(flat)
    return [f"{size:,}", fmt_seconds(t_ours), fmt_seconds(t_flat), f"{t_flat / t_ours:.0f}×"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    args = parser.parse_args()
    sizes = [1_000, 10_000] if args.quick else [1_000, 10_000, 100_000]
    repeats = 5 if args.quick else 15
    with tempfile.TemporaryDirectory(prefix="fdrr-bench-") as tmp:
        root = Path(tmp)
        print("### Local store: put / get (rr-v1 record vs paddle.save / paddle.load)\n")
        print(markdown_table(
            ["record", "put (ours)", "put (paddle.save)", "speed-up", "get+decode (ours)",
             "get (paddle.load)", "speed-up"], bench_put_get(root, repeats)))
        print("\n### Local store: delete one rollout by prefix (4 records) vs N stored\n")
        print(markdown_table(
            ["N stored", "ours (prefix buckets)", "flat dir, list + filter", "speed-up"],
            bench_prefix_delete(root, sizes, repeats)))


if __name__ == "__main__":
    main()
