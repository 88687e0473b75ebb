"""``fd-rr compare KEY FILE.npy``: how far a trainer's routing is from the rollout's.

The record under ``KEY`` is read and validated as ``fd-rr show`` reads it; ``FILE.npy`` is
the routing a trainer recomputed for the same positions, ``[layers, tokens, top_k]`` (the
layout ``fd-rr get`` writes; ``--layout TLK`` for ``[tokens, layers, top_k]``, e.g. an
SGLang-style array over all decoder layers, whose MoE rows are picked by the record's
layer map).  The metrics are :func:`fd_routing_replay.trainers.compare.compare_routing`'s.
``--max-flip-rate`` turns it into a check: exit status 1 above the rate.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from fd_routing_replay.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    add_raw_argument,
    load_record,
    open_store,
    rows,
)
from fd_routing_replay.errors import RoutingReplayError

__all__ = ["add_arguments", "load_recomputed", "run"]


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("key", help="the rollout id (or key) whose record to compare with")
    parser.add_argument("file", type=Path, help="the trainer's routing as a NumPy .npy file")
    parser.add_argument("--layout", choices=("LTK", "TLK"), default="LTK",
                        help="FILE's axes: LTK = [layers, tokens, top_k] (default, as `get` "
                             "writes), TLK = [tokens, layers, top_k]")
    add_raw_argument(parser)
    parser.add_argument("--max-flip-rate", type=_rate, metavar="RATE",
                        help="exit status 1 when the flip rate is above RATE")
    parser.add_argument("--json", action="store_true", help="print a JSON object instead")


def load_recomputed(path: Path, layout: str, layer_map: tuple[int, ...]) -> np.ndarray:
    """``[L, T, K]`` ids from ``path`` (never unpickled); a TLK array with more layers than
    the record is taken as one over all decoder layers and its MoE rows are picked."""
    try:
        array = np.load(path, allow_pickle=False)
    except ValueError as exc:
        raise RoutingReplayError(f"{path}: not a plain NumPy array ({exc})") from exc
    if array.ndim != 3 or array.dtype.kind not in "iu":
        raise RoutingReplayError(f"{path}: expected a 3-D integer array, got {array.dtype} "
                                 f"{list(array.shape)}")
    if layout == "TLK":
        if array.shape[1] != len(layer_map):
            if layer_map and array.shape[1] > max(layer_map):
                array = array[:, list(layer_map)]
            else:
                raise RoutingReplayError(
                    f"{path}: {array.shape[1]} layers, the record has {len(layer_map)} MoE "
                    f"layers {list(layer_map)}")
        array = array.transpose(1, 0, 2)
    return array


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fd-rr compare``."""
    from fd_routing_replay.trainers.compare import compare_routing

    with open_store(args) as store:
        record = load_record(store, args.key, args.raw_geometry).record
    recomputed = load_recomputed(args.file, args.layout, tuple(record.layer_map))
    try:
        result: dict[str, Any] = compare_routing(record, recomputed)
    except ValueError as exc:
        raise RoutingReplayError(f"{args.file}: {exc}") from exc
    limit = args.max_flip_rate
    failed = limit is not None and result["flip_rate"] > limit
    if args.json:
        print(json.dumps({"key": args.key, "file": str(args.file), **result,
                          "max_flip_rate": limit, "passed": not failed}, indent=2))
    else:
        per_layer = ", ".join("-" if rate is None else f"{layer}:{rate:.3f}" for layer, rate
                              in zip(result["layers"], result["per_layer_flip_rate"], strict=True))
        print(rows([
            ("key", args.key),
            ("compared", f"{result['compared_tokens']} tokens x {len(result['layers'])} layers "
                         f"({result['decisions']} decisions, {result['unrouted_decisions']} "
                         f"unrouted skipped)"),
            ("flip rate", f"{result['flip_rate']:.4f} ({result['flipped_decisions']} "
                          f"decisions whose top-k set differs)"),
            ("tokens flipped", f"{result['token_flip_share']:.4f} (at least one layer)"),
            ("mean overlap", f"{result['mean_overlap']:.4f}"),
            ("load drift", f"L1 {result['load_drift_l1']:.4f}, max "
                           f"{result['max_abs_load_drift']:.4f} (one expert)"),
            ("per layer", per_layer),
        ]))
    if failed:
        print(f"flip rate {result['flip_rate']:.4f} is above --max-flip-rate {limit}",
              file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK
