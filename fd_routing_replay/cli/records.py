"""``fd-rr ls``, ``show`` and ``get``: list keys or namespaces, summarise one record (header,
shape, expert load), save one record's ids as ``.npy``.

``ls`` lists every key, partial records (``{rollout_id}_partial``) included, and counts
those apart (``--count``, ``--json``); ``--partial`` lists only them.

Each record is read and validated as the trainer's reader validates it
(:func:`~fd_routing_replay.cli.common.load_record`).
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from fd_routing_replay.cli.common import (
    EXIT_OK,
    add_raw_argument,
    load_record,
    open_store,
    print_json,
    rows,
)
from fd_routing_replay.codec.record import RecordFormat
from fd_routing_replay.errors import RoutingReplayError
from fd_routing_replay.keys import split_partial_key

__all__ = ["cmd_get", "cmd_ls", "cmd_show", "expert_load", "get_arguments", "ls_arguments",
           "show_arguments"]

# Ids at or above this are counted with np.unique instead of np.bincount, whose array
# grows with the largest id (a crafted uint32 id would ask for 32 GiB).
_BINCOUNT_LIMIT = 1 << 20


# -- ls ---------------------------------------------------------------------------------------

def _list_namespaces(store: Any) -> list[str]:
    supports = getattr(store, "supports_list_namespaces", None)
    if supports is None or not supports():
        raise RoutingReplayError(f"{store.describe()} cannot list its namespaces; name one "
                                 "with --namespace")
    return sorted(store.list_namespaces())


def _missing_root(store: Any) -> str:
    """`` (the root directory … does not exist)`` for a file store whose root is absent."""
    root = getattr(store, "root", None)
    if root is not None and not Path(root).exists():
        return f" (the root directory {root} does not exist)"
    return ""


def _empty_note(store: Any, prefix: str | None) -> str:
    """Why ``ls`` printed nothing: the store and namespace read, and what is there."""
    where = store.describe()
    if prefix is not None:
        return f"no records under prefix {prefix!r} in {where}"
    note = f"no records in {where}: the namespace is empty or absent"
    if _missing_root(store):
        return note + _missing_root(store)
    try:
        others = _list_namespaces(store)
    except RoutingReplayError:
        return note
    if others:
        return f"{note}; namespaces there: {', '.join(others)} (use --namespace)"
    return f"{note}; the store holds no namespace"


def cmd_ls(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        if args.namespaces:
            names = _list_namespaces(store)
            if args.json:
                print_json({"store": store.describe(), "namespaces": names})
            for name in [] if args.json else names:
                print(name)
            if not names:
                print(f"fd-rr ls: {store.describe()} holds no namespace{_missing_root(store)}",
                      file=sys.stderr)
            return EXIT_OK
        keys = store.list(args.prefix)
        partials = [key for key in keys if split_partial_key(key) is not None]
        keys = partials if args.partial else keys
        note = None if keys else _empty_note(store, args.prefix) if not args.partial else \
            f"no partial records{f' under prefix {args.prefix!r}' if args.prefix else ''} in {store.describe()}"
        where = store.describe()
    if args.json:
        print_json({"store": where, "namespace": store.namespace, "prefix": args.prefix,
                    "count": len(keys), "partial": len(partials), "keys": keys})
    else:
        for key in keys:
            print(key)
        if args.count:
            print(f"{len(keys)} record(s), {len(partials)} of them partial" if partials and
                  not args.partial else f"{len(keys)} record(s)", file=sys.stderr)
    if note:
        print(f"fd-rr ls: {note}", file=sys.stderr)
    return EXIT_OK


# -- show / get -------------------------------------------------------------------------------

def expert_load(ids: np.ndarray, fill: int, num_experts: int | None) -> dict[str, Any]:
    """min/max/mean load per expert, unused experts and unrouted entries of ``ids``.

    Memory stays bounded by the record's size whatever the ids are.  Without
    ``num_experts`` (FastDeploy files do not store it) the experts are 0..highest id seen.
    """
    routed = ids[ids != fill]
    if routed.size and int(routed.max()) < _BINCOUNT_LIMIT:
        full = np.bincount(routed.reshape(-1))
        values = np.flatnonzero(full)
        counts = full[values]
    else:
        values, counts = np.unique(routed, return_counts=True)
    highest = int(values[-1]) if values.size else None
    span = num_experts if num_experts is not None else (highest + 1 if highest is not None else 0)
    unused = span - int(values.size)
    return {
        "min": 0 if unused or not values.size else int(counts.min()),
        "max": int(counts.max()) if values.size else 0,
        "mean": routed.size / span if span else 0.0,
        "experts_used": int(values.size),
        "unused_experts": unused,
        "num_experts": num_experts,
        "highest_id": highest,
        "routed_entries": int(routed.size),
        "unrouted_entries": int(ids.size - routed.size),
    }


def _utc(created: Any) -> str | None:
    """A unix time as ISO-8601 UTC (``2025-01-02T03:04:05Z``), None when absent or absurd."""
    if isinstance(created, bool) or not isinstance(created, (int, float)):
        return None
    try:
        moment = datetime.fromtimestamp(created, tz=UTC)
    except (OverflowError, OSError, ValueError):
        return None
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def cmd_show(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        stored = load_record(store, args.key, args.raw_geometry)
    record, header = stored.record, stored.header
    # A fastdeploy-raw file does not say how many experts there are: count those seen.
    experts_known = stored.format != RecordFormat.FASTDEPLOY_RAW
    num_experts = record.num_experts if experts_known else None
    layers = record.ids.shape[0]
    if args.layer is not None and not 0 <= args.layer < layers:
        raise LookupError(f"--layer {args.layer}: the record has {layers} layer row(s), "
                          f"0..{layers - 1}")
    ids = record.ids if args.layer is None else record.ids[args.layer]
    load = expert_load(ids, record.fill_value, num_experts)
    decoder_layer = None if args.layer is None else record.layer_map[args.layer]
    summary = {
        "key": args.key,
        "format": stored.format,
        "header": header,
        "created_utc": _utc(header.get("created")),
        "bytes": stored.nbytes,
        "layer": args.layer,
        "decoder_layer": decoder_layer,
        "unrouted_entries": load["unrouted_entries"],
        "expert_load": load,
    }
    if args.json:
        print_json(summary)
        return EXIT_OK
    experts = num_experts if experts_known else \
        f"unknown (not stored; highest id seen {load['highest_id']})"
    lines: list[tuple[str, Any]] = [
         ("key", args.key),
         ("rollout id", record.rollout_id),
         ("format", stored.format),
         ("shape", f"{list(record.ids.shape)}  (layers, tokens, top_k)"),
         ("dtype", record.ids.dtype),
         ("fill value", record.fill_value),
         ("experts", experts),
         ("size", f"{stored.nbytes} bytes"),
         ("created", summary["created_utc"] or header.get("created", "unknown")),
         ("header", ""),
     ]
    shown = {"rollout_id", "shape", "dtype", "format", "created", "fill_value", "num_experts"}
    lines += [(f"  {name}", f"{value:#018x}" if name == "checksum" and isinstance(value, int)
               else value) for name, value in header.items() if name not in shown]
    scope = (f"layer row {args.layer} (decoder layer {decoder_layer})" if args.layer is not None
             else f"all {layers} layer(s) summed; --layer N shows one")
    unused = f"{load['unused_experts']} of {num_experts}" if experts_known else \
        f"{load['unused_experts']} of ids 0..{load['highest_id']}"
    lines += [
         ("expert load", scope),
         ("  min", load["min"]),
         ("  max", load["max"]),
         ("  mean", f"{load['mean']:.1f}"),
         ("  unused experts", unused),
         ("  unrouted entries", load["unrouted_entries"]),
     ]
    print(rows(lines))
    return EXIT_OK


def cmd_get(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        record = load_record(store, args.key, args.raw_geometry).record
    # np.save appends ".npy" to a name without it: say where the file really is.
    path = args.output if str(args.output).endswith(".npy") else f"{args.output}.npy"
    np.save(path, record.ids)
    print(f"wrote {path}: {list(record.ids.shape)} {record.ids.dtype}")
    return EXIT_OK


# -- arguments --------------------------------------------------------------------------------

def ls_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_mutually_exclusive_group()
    what.add_argument("prefix", nargs="?", default=None,
                      help="only keys matching this boundary-safe prefix")
    what.add_argument("--namespaces", action="store_true",
                      help="list the store's namespaces instead of keys")
    p.add_argument("--count", action="store_true", help="print the count to stderr")
    p.add_argument("--partial", action="store_true",
                   help="only partial records of running (or aborted) rollouts, {rollout_id}_partial")
    p.add_argument("--json", action="store_true", help="print a JSON object instead")


def show_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("key")
    add_raw_argument(p)
    p.add_argument("--layer", type=_layer_row, metavar="N",
                   help="expert load of layer row N only (0-based, as in `get`'s array)")
    p.add_argument("--json", action="store_true", help="print a JSON object instead")


def _layer_row(text: str) -> int:
    from fd_routing_replay.core.parsing import parse_int

    try:
        return parse_int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def get_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("key")
    add_raw_argument(p)
    p.add_argument("-o", "--output", required=True,
                   help="the .npy file to write ('.npy' is appended when missing)")
