"""``fd-rr``: inspect and manage stored routing records from a shell.

Every failure prints one clear ``error:`` line (passwords in URLs masked) and exits
non-zero; tracebacks are shown only with ``--debug``.  Exit status: 0 success, 1 failure,
2 usage error (argparse); ``fsck`` adds 1 = inconsistencies found and 3 = could not check.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from fd_routing_replay import __version__
from fd_routing_replay.errors import RoutingReplayError
from fd_routing_replay.redact import RedactingFilter, redact_text

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
#: ``fd-rr fsck``: the store was checked and is inconsistent (not repaired).
EXIT_FSCK_INCONSISTENT = 1
#: ``fd-rr fsck``: the store could not be checked (not opened, no index, an error midway).
EXIT_FSCK_ERROR = 3
EXIT_INTERRUPTED = 130

# Ids at or above this are counted with np.unique instead of np.bincount, whose array
# grows with the largest id (a crafted uint32 id would ask for 32 GiB).
_BINCOUNT_LIMIT = 1 << 20


# -- shared helpers ---------------------------------------------------------------------------

def _open_store(args: argparse.Namespace) -> Any:
    # A registry of this command's own: --stats reports only the calls it made (a CLI
    # process is never scraped).
    from prometheus_client import CollectorRegistry

    from fd_routing_replay.config import load_config
    from fd_routing_replay.store import open_store

    store = open_store(args.store if args.store else load_config(args.config), args.namespace,
                       metrics_registry=CollectorRegistry())
    metrics = getattr(store, "metrics", None)
    if metrics is not None:
        args.opened.append((store.describe(), metrics))
    return store


def _store_call_summary(where: str, metrics: Any) -> str:
    """``--stats``: one line per store the command opened (calls, errors, latency, bytes)."""
    snap = metrics.snapshot()
    parts = []
    for op, calls in snap["calls"].items():
        if calls:
            p50, p99 = (q * 1e3 for q in metrics.latency_quantiles(op))
            parts.append(f"{op} {calls} (errors {snap['errors'][op]}, p50 {p50:.2f} ms, "
                         f"p99 {p99:.2f} ms)")
    return (f"store calls to {where}: {'; '.join(parts) or 'none'}; read "
            f"{snap['bytes_read']} B, written {snap['bytes_written']} B")


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str))


def _progress(done: int, total: int, label: str) -> None:
    if not sys.stderr.isatty():
        return
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _rows(rows: list[tuple[str, Any]]) -> str:
    """Labels in one column wide enough for the longest, so no label runs into its value."""
    width = max(len(label) for label, _ in rows) + 2
    return "\n".join(f"{label:<{width}}{value}".rstrip() for label, value in rows)


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
    with _open_store(args) as store:
        if args.namespaces:
            names = _list_namespaces(store)
            if args.json:
                _print_json({"store": store.describe(), "namespaces": names})
            for name in [] if args.json else names:
                print(name)
            if not names:
                print(f"fd-rr ls: {store.describe()} holds no namespace{_missing_root(store)}",
                      file=sys.stderr)
            return EXIT_OK
        keys = store.list(args.prefix)
        note = None if keys else _empty_note(store, args.prefix)
        where = store.describe()
    if args.json:
        _print_json({"store": where, "namespace": store.namespace, "prefix": args.prefix,
                     "count": len(keys), "keys": keys})
    else:
        for key in keys:
            print(key)
        if args.count:
            print(f"{len(keys)} record(s)", file=sys.stderr)
    if note:
        print(f"fd-rr ls: {note}", file=sys.stderr)
    return EXIT_OK


# -- show / get -------------------------------------------------------------------------------

def _load(store: Any, key: str, raw: Any = None) -> Any:
    """The record under ``key`` (rr-v1 or FastDeploy .pdtensor; a rollout stored per layer
    is assembled) as a :class:`~fd_routing_replay.reader.StoredRecord`, validated as
    :class:`~fd_routing_replay.reader.RoutingReader` validates what it hands out:
    checksum, expert-id range and the rollout the record belongs to."""
    from fd_routing_replay.codec import check_expert_range
    from fd_routing_replay.errors import InvalidRolloutId, RecordError
    from fd_routing_replay.keys import split_layer_key
    from fd_routing_replay.reader import read_stored

    stored = read_stored(store, key, raw=raw)
    if stored is None:
        raise LookupError(f"no record under key {key!r} in {store.describe()}")
    try:
        expected = split_layer_key(key)[0].text
    except InvalidRolloutId:
        expected = None  # a key outside the rollout grammar: nothing to compare with
    record = stored.record
    if expected is not None and record.rollout_id != expected:
        raise RecordError(f"record stored under {key!r} belongs to rollout "
                          f"{record.rollout_id!r}; the store is inconsistent (run fd-rr fsck)")
    check_expert_range(record)
    return stored


def _expert_load(ids: np.ndarray, fill: int, num_experts: int | None) -> dict[str, Any]:
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
    with _open_store(args) as store:
        stored = _load(store, args.key, args.raw_geometry)
    record, header = stored.record, stored.header
    # A fastdeploy-raw file does not say how many experts there are: count those seen.
    experts_known = stored.format != "fastdeploy-raw"
    num_experts = record.num_experts if experts_known else None
    layers = record.ids.shape[0]
    if args.layer is not None and not 0 <= args.layer < layers:
        raise LookupError(f"--layer {args.layer}: the record has {layers} layer row(s), "
                          f"0..{layers - 1}")
    ids = record.ids if args.layer is None else record.ids[args.layer]
    load = _expert_load(ids, record.fill_value, num_experts)
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
        _print_json(summary)
        return EXIT_OK
    experts = num_experts if experts_known else \
        f"unknown (not stored; highest id seen {load['highest_id']})"
    rows: list[tuple[str, Any]] = [
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
    rows += [(f"  {name}", f"{value:#018x}" if name == "checksum" and isinstance(value, int)
              else value) for name, value in header.items() if name not in shown]
    scope = (f"layer row {args.layer} (decoder layer {decoder_layer})" if args.layer is not None
             else f"all {layers} layer(s) summed; --layer N shows one")
    unused = f"{load['unused_experts']} of {num_experts}" if experts_known else \
        f"{load['unused_experts']} of ids 0..{load['highest_id']}"
    rows += [
        ("expert load", scope),
        ("  min", load["min"]),
        ("  max", load["max"]),
        ("  mean", f"{load['mean']:.1f}"),
        ("  unused experts", unused),
        ("  unrouted entries", load["unrouted_entries"]),
    ]
    print(_rows(rows))
    return EXIT_OK


def cmd_get(args: argparse.Namespace) -> int:
    with _open_store(args) as store:
        record = _load(store, args.key, args.raw_geometry).record
    # np.save appends ".npy" to a name without it: say where the file really is.
    path = args.output if str(args.output).endswith(".npy") else f"{args.output}.npy"
    np.save(path, record.ids)
    print(f"wrote {path}: {list(record.ids.shape)} {record.ids.dtype}")
    return EXIT_OK


# -- rm ---------------------------------------------------------------------------------------

def _confirm(question: str) -> bool:
    if not sys.stdin.isatty():
        raise RoutingReplayError("refusing to delete without confirmation: stdin is not a "
                                 "terminal; pass --yes")
    sys.stderr.write(question)  # never stdout: it may be --json for a script
    sys.stderr.flush()
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def _rm_older(args: argparse.Namespace) -> int:
    """``rm --older-than``: the retention sweeper by hand, over prefixes or the namespace."""
    from fd_routing_replay.retention import parse_duration, sweep

    ttl = parse_duration(args.older_than)
    if ttl <= 0:
        raise RoutingReplayError("--older-than must be more than 0 seconds")
    prefixes = args.targets or [None]
    with _open_store(args) as store:
        where = store.describe()
        planned = [key for prefix in prefixes
                   for key in sweep(store, ttl_s=ttl, prefix=prefix, dry_run=True).expired]
        if args.dry_run or not planned or not (args.yes or _confirm(
                f"delete {len(planned)} record(s) older than {args.older_than} from {where}? "
                "[y/N] ")):
            aborted = bool(planned) and not args.dry_run
            if args.json:
                _print_json({"store": where, "older_than_s": ttl, "would_delete": planned,
                             "deleted": 0, "dry_run": bool(args.dry_run), "aborted": aborted})
            else:
                for key in planned if args.dry_run else ():
                    print(key)
                print(("would delete" if args.dry_run else "aborted; nothing deleted of")
                      + f" {len(planned)} record(s) older than {args.older_than}"
                      if planned else f"nothing older than {args.older_than}; nothing deleted")
            return EXIT_FAILURE if aborted else EXIT_OK
        deleted = kept = 0
        for prefix in prefixes:
            report = sweep(store, ttl_s=ttl, prefix=prefix)
            deleted += report.deleted
            kept += report.kept_replaced
    if args.json:
        _print_json({"store": where, "older_than_s": ttl, "deleted": deleted,
                     "kept_replaced": kept, "dry_run": False, "aborted": False})
    else:
        print(f"deleted {deleted} record(s) older than {args.older_than}"
              + (f" ({kept} replaced meanwhile, kept)" if kept else ""))
    return EXIT_OK


def cmd_rm(args: argparse.Namespace) -> int:
    if args.older_than is not None:
        return _rm_older(args)
    if not args.targets:
        raise RoutingReplayError("rm needs KEY… (or --prefix PREFIX…, or --older-than DURATION)")
    if args.dry_run:
        raise RoutingReplayError("--dry-run goes with --older-than")
    with _open_store(args) as store:
        where = store.describe()
        if not args.prefix:
            removed = store.delete(args.targets)
            if args.json:
                _print_json({"store": where, "keys": args.targets, "deleted": removed})
            else:
                print(f"deleted {removed} of {len(args.targets)} key(s)")
            return EXIT_OK
        targets = args.targets
        if not args.yes:
            total = sum(len(store.list(p)) for p in targets)
            if total == 0 or not _confirm(f"delete {total} record(s) under {len(targets)} "
                                          f"prefix(es) from {where}? [y/N] "):
                aborted = total > 0
                if args.json:
                    _print_json({"store": where, "prefixes": dict.fromkeys(targets, 0),
                                 "deleted": 0, "aborted": aborted})
                else:
                    print("aborted; nothing deleted" if aborted else
                          "nothing matches; nothing deleted")
                return EXIT_FAILURE if aborted else EXIT_OK
        counts: dict[str, int] = {}
        for index, prefix in enumerate(targets, 1):
            counts[prefix] = store.delete_prefix([prefix])[prefix]
            if not args.json:
                print(f"{prefix}\t{counts[prefix]}")
            _progress(index, len(targets), "deleting")
    if args.json:
        _print_json({"store": where, "prefixes": counts, "deleted": sum(counts.values()),
                     "aborted": False})
    else:
        print(f"deleted {sum(counts.values())} record(s)")
    return EXIT_OK


# -- config check -----------------------------------------------------------------------------

def _check_store_type(store_config: Any) -> str:
    """The backend a store config names; ConfigError naming the known ones if none is."""
    from fd_routing_replay.errors import ConfigError
    from fd_routing_replay.store.registry import (
        ENTRY_POINT_GROUP,
        known_store_types,
        store_type_of,
    )

    name = store_type_of(store_config)
    known = known_store_types()
    if name not in known:
        key = "store.url" if store_config.url else "store.type"
        raise ConfigError(f"{key}: unknown store type {name!r}; known types: {', '.join(known)} "
                          f"(third-party backends register under the entry-point group "
                          f"{ENTRY_POINT_GROUP!r})")
    return name


def cmd_config_check(args: argparse.Namespace) -> int:
    import yaml

    from fd_routing_replay.config import config_to_dict, load_config

    try:
        config = load_config(args.file)
        store_type = _check_store_type(config.store)
    except RoutingReplayError as exc:
        if args.json:
            _print_json({"file": args.file, "valid": False, "error": redact_text(str(exc))})
        raise
    effective = config_to_dict(config, redact=True)
    if args.json:
        _print_json({"file": args.file, "valid": True, "store_type": store_type,
                     "config": effective})
    else:
        print(yaml.safe_dump(effective, sort_keys=False), end="")
        print(f"# {args.file}: valid (store type {store_type})", file=sys.stderr)
    return EXIT_OK


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    check = sub.add_parser(
        "check", help="validate a file and print the effective config", allow_abbrev=False,
        formatter_class=_HelpFormatter,
        description="Validate a YAML/JSON config (with the FD_RR_* variables of this shell "
                    "applied) and print the effective configuration, passwords masked. The "
                    "store type must be a built-in or a registered backend.",
        epilog="example:\n  fd-rr config check configs/redis.yaml --json")
    check.add_argument("file", help="the YAML or .json config file")
    check.add_argument("--json", action="store_true", help="print a JSON object instead")
    check.set_defaults(func=cmd_config_check)


# -- fsck -------------------------------------------------------------------------------------

def _fsck_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="only report (the default)")
    mode.add_argument("--repair", action="store_true",
                      help="drop dangling and invalid index entries, index intact unindexed payloads, "
                           "quarantine payloads with invalid keys and corrupt records")
    parser.add_argument("--deep", action="store_true",
                        help="also read every record and verify its rr-v1 checksum (reads all data)")
    parser.add_argument("--batch", type=_positive_int, default=1000,
                        help="keys per Redis round trip (default 1000)")
    parser.add_argument("--migrate-index", action="store_true",
                        help="first move the index into store.redis.index_buckets buckets")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _positive_int(text: str) -> int:
    from fd_routing_replay._parse import parse_int

    try:
        value = parse_int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def cmd_fsck(args: argparse.Namespace) -> int:
    from fd_routing_replay.store.fsck import fsck

    try:
        store = _open_store(args)
    except (RoutingReplayError, OSError, ImportError) as exc:
        raise RoutingReplayError(f"cannot open the store: {exc}") from exc
    with store:
        try:
            report = fsck(store, repair=args.repair, batch=args.batch, deep=args.deep,
                          migrate_index=args.migrate_index)
        except (TypeError, RoutingReplayError, OSError) as exc:
            raise RoutingReplayError(f"fsck of {store.describe()} failed: {exc}") from exc
    if args.json:
        _print_json({**asdict(report), "consistent": report.consistent})
    else:
        print(report.to_text())
    return EXIT_OK if report.consistent or report.repaired else EXIT_FSCK_INCONSISTENT


# -- subcommand table ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Subcommand:
    """One ``fd-rr`` subcommand.  Add a command by appending one to :data:`SUBCOMMANDS`.

    Either ``run`` (with ``arguments`` adding its options) is given here, or ``module``
    names a module exposing ``add_arguments(parser)`` and ``run(args) -> int``, imported
    only when its subcommand runs (keeps ``fd-rr ls`` fast).
    """

    name: str
    help: str
    description: str
    examples: tuple[str, ...]
    run: Callable[[argparse.Namespace], int] | None = None
    arguments: Callable[[argparse.ArgumentParser], None] | None = None
    module: str | None = None
    store_options: bool = True
    #: Exit status when the command fails with an error.
    error_status: int = EXIT_FAILURE


def _ls_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_mutually_exclusive_group()
    what.add_argument("prefix", nargs="?", default=None,
                      help="only keys matching this boundary-safe prefix")
    what.add_argument("--namespaces", action="store_true",
                      help="list the store's namespaces instead of keys")
    p.add_argument("--count", action="store_true", help="print the count to stderr")
    p.add_argument("--json", action="store_true", help="print a JSON object instead")


def _raw_geometry(text: str) -> Any:
    from fd_routing_replay.reader import RawGeometry

    try:
        return RawGeometry.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _raw_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--raw-geometry", type=_raw_geometry, metavar="top_k=K,dtype=D[,num_layers=L]",
                   help="read a header-less FastDeploy raw value (its P2PStore keys) with this geometry")


def _show_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("key")
    _raw_argument(p)
    p.add_argument("--layer", type=_layer_row, metavar="N",
                   help="expert load of layer row N only (0-based, as in `get`'s array)")
    p.add_argument("--json", action="store_true", help="print a JSON object instead")


def _layer_row(text: str) -> int:
    from fd_routing_replay._parse import parse_int

    try:
        return parse_int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _get_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("key")
    _raw_argument(p)
    p.add_argument("-o", "--output", required=True,
                   help="the .npy file to write ('.npy' is appended when missing)")


def _rm_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("targets", nargs="*", metavar="KEY_OR_PREFIX")
    p.add_argument("--prefix", action="store_true", help="treat arguments as prefixes")
    p.add_argument("--older-than", metavar="DURATION",
                   help="delete records created more than DURATION ago (90s, 30m, 2h, 7d), under "
                        "the given prefixes or the whole namespace; records of unknown age are kept")
    p.add_argument("--dry-run", action="store_true",
                   help="with --older-than: list what would be deleted, delete nothing")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("--json", action="store_true", help="print a JSON object instead")


SUBCOMMANDS: list[Subcommand] = [
    Subcommand("ls", "list keys (optionally under a prefix) or namespaces",
               "List the sorted keys of a namespace, all or those matching a boundary-safe "
               "prefix (exp:1 matches exp:1, exp:1:… and exp:1_…, never exp:10…). When there "
               "are none, stderr says which store and namespace were read.",
               ("fd-rr ls exp_epoch_3 --store local://./routing_replay_output",
                "fd-rr ls --namespaces --config configs/redis.yaml"),
               run=cmd_ls, arguments=_ls_arguments),
    Subcommand("show", "header, shape and expert usage of a record",
               "Print a record's format, header, shape, dtype, size, creation time (UTC) and "
               "its expert load (min/max/mean per expert, unused experts, unrouted entries), "
               "summed over layers or for one layer row. The record is validated as the "
               "trainer's reader validates it.",
               ("fd-rr show 'exp_epoch_3_17:0:1:0' --config configs/redis.yaml",
                "fd-rr show 'exp_epoch_3_17:0:1:0' --layer 5 --json"),
               run=cmd_show, arguments=_show_arguments),
    Subcommand("get", "save a record's ids as .npy",
               "Validate a record as the trainer's reader does and save its [layers, tokens, "
               "top_k] expert ids as a NumPy .npy file.",
               ("fd-rr get 'exp_epoch_3_17:0:1:0' -o routing.npy --config configs/local.yaml",),
               run=cmd_get, arguments=_get_arguments),
    Subcommand("rm", "delete keys, or prefixes with --prefix",
               "Delete keys (printing how many existed), or with --prefix everything under "
               "each boundary-safe prefix, asking first unless --yes.",
               ("fd-rr rm 'exp_1:0:0' --store redis://127.0.0.1:6379/0",
                "fd-rr rm --prefix exp_epoch_2 exp_epoch_1 --yes --config configs/redis.yaml",
                "fd-rr rm --older-than 2h --dry-run --store local:///data/rr"),
               run=cmd_rm, arguments=_rm_arguments),
    Subcommand("config", "configuration tools",
               "Configuration tools; `fd-rr config check FILE` validates a config file.",
               ("fd-rr config check configs/local.yaml",),
               arguments=_config_arguments, store_options=False),
    Subcommand("demo", "run the end-to-end demo on the local store",
               "Run multi-turn rollouts through the harness engine with capture on, read the "
               "records back and check them against a teacher-forced forward pass.",
               ("fd-rr demo --output ./demo_output --rollouts 16",),
               module="fd_routing_replay.harness.demo", store_options=False),
    Subcommand("doctor", "check RDMA devices, the store and its index",
               "Check that this node can store and read records: config, RDMA devices, "
               "Redis, opening the store, a record round trip and a sample of the index. "
               "Exit status 1 when a check failed.",
               ("fd-rr doctor --config configs/p2pstore-rdma.yaml",),
               module="fd_routing_replay.doctor"),
    Subcommand("fsck", "find and repair index/payload inconsistencies",
               "Compare an indexed store's prefix index with its payloads; --repair drops "
               "dangling index entries and indexes unindexed payloads. Exit status: 0 "
               "consistent or repaired, 1 inconsistent, 2 usage error, 3 could not check.",
               ("fd-rr fsck --config configs/redis.yaml",
                "fd-rr fsck --repair --json --store redis://127.0.0.1:6379/0"),
               run=cmd_fsck, arguments=_fsck_arguments, error_status=EXIT_FSCK_ERROR),
    Subcommand("dead-letters", "list, replay or drop the writer's dead letters",
               "List the operations the store rejected for good (ls), submit them again through "
               "a writer with the configured store once the cause is fixed (replay: those "
               "accepted are removed, those rejected again stay with the new error), or delete "
               "them (drop). The directory is the one the config and rank identity (--dp-rank, "
               "--tp-rank, --device-id) select, or --dir.",
               ("fd-rr dead-letters ls --config configs/redis.yaml",
                "fd-rr dead-letters replay --all --config configs/redis.yaml",
                "fd-rr dead-letters drop 00001764536512345678.0 --yes --dir /data/rr/dead"),
               module="fd_routing_replay.cli_dead_letters"),
    Subcommand("compare", "routing mismatch between a record and a trainer's routing",
               "Compare the record under KEY with the routing a trainer recomputed (a .npy "
               "file, [layers, tokens, top_k]): flip rate overall and per layer, tokens "
               "with a flipped layer, top-k overlap, expert load drift. Exit status 1 when "
               "--max-flip-rate is exceeded.",
               ("fd-rr compare 'exp_1:0:0' trainer_routing.npy --store local:///data/rr",),
               module="fd_routing_replay.cli_compare"),
]


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps descriptions to the terminal; keeps the example lines of an epilog as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("example"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _invoked(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word; fd-rr's own options are flags)."""
    return next((word for word in argv if not word.startswith("-")), None)


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The argument parser; ``argv`` says which external subcommand's options to load."""
    parser = argparse.ArgumentParser(
        prog="fd-rr", allow_abbrev=False, formatter_class=_HelpFormatter,
        description="Inspect and manage stored routing records. `fd-rr COMMAND --help` "
                    "describes a command, with an example.",
        epilog="exit status: 0 success, 1 failure (fsck: inconsistent), 2 usage error, "
               "3 fsck could not check")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--stats", action="store_true",
                        help="print the store calls the command made (count, errors, latency, "
                             "bytes) on stderr")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    store_opts = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    store_opts.add_argument("--config", help="YAML/JSON config (default: $FD_ROUTING_REPLAY_CONFIG)")
    store_opts.add_argument("--store", help="store URL, e.g. local:///data/rr or redis://host/0")
    store_opts.add_argument("--namespace", help="override the config's namespace")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    invoked = _invoked(argv)
    for command in SUBCOMMANDS:
        examples = "\n".join(f"  {line}" for line in command.examples)
        p = sub.add_parser(command.name, help=command.help, description=command.description,
                           epilog=f"example{'s' if len(command.examples) > 1 else ''}:\n"
                                  f"{examples}",
                           formatter_class=_HelpFormatter,
                           parents=[store_opts] if command.store_options else [],
                           allow_abbrev=False)
        p.set_defaults(func=command.run, external=command.module,
                       error_status=command.error_status)
        if command.arguments is not None:
            command.arguments(p)
        elif command.module is not None and command.name == invoked:
            importlib.import_module(command.module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())
    args.opened = []
    try:
        if args.func is None:
            return importlib.import_module(args.external).run(args)
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (RoutingReplayError, LookupError, OSError, TimeoutError, ImportError) as exc:
        if args.debug:
            raise
        print(f"error: {redact_text(str(exc))}", file=sys.stderr)
        return args.error_status
    finally:
        if args.stats:
            for where, metrics in args.opened:
                print(redact_text(_store_call_summary(where, metrics)), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
