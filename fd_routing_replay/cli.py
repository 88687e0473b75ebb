"""``fd-rr``: inspect and manage stored routing records from a shell.

Every failure prints one clear ``error:`` line and exits non-zero; tracebacks are shown
only with ``--debug``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from fd_routing_replay.errors import RoutingReplayError

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

# Subcommands owned by other modules: name -> (module, help, takes the store options).
# Each module exposes ``add_arguments(parser)`` and ``run(args) -> int``; it is imported
# only when its subcommand runs.
_EXTERNAL = {
    "demo": ("fd_routing_replay.harness.demo", "run the end-to-end demo on the local store",
             False),
    "doctor": ("fd_routing_replay.doctor", "check RDMA devices, the store and its index", True),
    "fsck": ("fd_routing_replay.store.fsck", "find and repair index/payload inconsistencies",
             True),
}


def _open_store(args: argparse.Namespace) -> Any:
    from fd_routing_replay.config import load_config
    from fd_routing_replay.store import open_store

    if args.store:
        return open_store(args.store, args.namespace)
    config = load_config(args.config)
    return open_store(config, args.namespace)


def _progress(done: int, total: int, label: str) -> None:
    if not sys.stderr.isatty():
        return
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def cmd_ls(args: argparse.Namespace) -> int:
    with _open_store(args) as store:
        keys = store.list(args.prefix)
    for key in keys:
        print(key)
    if args.count:
        print(f"{len(keys)} record(s)", file=sys.stderr)
    return EXIT_OK


def _load(store: Any, key: str) -> Any:
    """The record under ``key`` (rr-v1 or FastDeploy .pdtensor; a rollout stored per layer
    is assembled) as a :class:`~fd_routing_replay.reader.StoredRecord`."""
    from fd_routing_replay.reader import read_stored

    stored = read_stored(store, key)
    if stored is None:
        raise LookupError(f"no record under key {key!r} in {store.describe()}")
    return stored


def cmd_show(args: argparse.Namespace) -> int:
    with _open_store(args) as store:
        stored = _load(store, args.key)
    record, header = stored.record, stored.header
    ids = record.ids
    routed = ids[ids != record.fill_value]
    # A fastdeploy-raw file does not say how many experts there are: count those seen.
    experts_known = stored.format != "fastdeploy-raw"
    load = np.bincount(routed.astype(np.int64),
                       minlength=record.num_experts if experts_known else 0)
    summary = {
        "key": args.key,
        "format": stored.format,
        "header": header,
        "bytes": stored.nbytes,
        "unrouted_entries": int(ids.size - routed.size),
        "expert_load": {"min": int(load.min(initial=0)), "max": int(load.max(initial=0)),
                        "mean": float(load.mean()) if load.size else 0.0,
                        "unused_experts": int((load == 0).sum()),
                        "num_experts": record.num_experts if experts_known else None},
    }
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return EXIT_OK
    experts = record.num_experts if experts_known else "unknown (not stored; ids seen up to " \
        f"{load.size - 1})"
    print(f"key          {args.key}")
    print(f"rollout id   {record.rollout_id}")
    print(f"format       {stored.format}")
    print(f"shape        {list(ids.shape)}  (layers, tokens, top_k)")
    print(f"dtype        {ids.dtype}   fill {record.fill_value}   experts {experts}")
    print(f"size         {summary['bytes']} bytes")
    for name, value in header.items():
        if name not in ("rollout_id", "shape", "dtype", "format"):
            print(f"  {name:<11}{value}")
    el = summary["expert_load"]
    print(f"expert load  min {el['min']}  max {el['max']}  mean {el['mean']:.1f}  "
          f"unused experts {el['unused_experts']}  unrouted entries {summary['unrouted_entries']}")
    return EXIT_OK


def cmd_get(args: argparse.Namespace) -> int:
    with _open_store(args) as store:
        record = _load(store, args.key).record
    np.save(args.output, record.ids)
    print(f"wrote {args.output}: {list(record.ids.shape)} {record.ids.dtype}")
    return EXIT_OK


def cmd_rm(args: argparse.Namespace) -> int:
    with _open_store(args) as store:
        if args.prefix:
            targets = args.targets
            if not args.yes:
                counts = {p: len(store.list(p)) for p in targets}
                total = sum(counts.values())
                if total == 0:
                    print("nothing matches; nothing deleted")
                    return EXIT_OK
                if not _confirm(f"delete {total} record(s) under {len(targets)} prefix(es) "
                                f"from {store.describe()}? [y/N] "):
                    print("aborted; nothing deleted")
                    return EXIT_FAILURE
            total = 0
            for index, prefix in enumerate(targets, 1):
                count = store.delete_prefix([prefix])[prefix]
                total += count
                print(f"{prefix}\t{count}")
                _progress(index, len(targets), "deleting")
            print(f"deleted {total} record(s)")
        else:
            removed = store.delete(args.targets)
            print(f"deleted {removed} of {len(args.targets)} key(s)")
    return EXIT_OK


def _confirm(question: str) -> bool:
    if not sys.stdin.isatty():
        raise RoutingReplayError("refusing to delete without confirmation: stdin is not a "
                                 "terminal; pass --yes")
    return input(question).strip().lower() in ("y", "yes")


def cmd_config_check(args: argparse.Namespace) -> int:
    import yaml

    from fd_routing_replay.config import config_to_dict, load_config

    config = load_config(args.file)
    print(yaml.safe_dump(config_to_dict(config, redact=True), sort_keys=False), end="")
    print(f"# {args.file}: valid", file=sys.stderr)
    return EXIT_OK


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The argument parser; ``argv`` says which external subcommand's options to load."""
    parser = argparse.ArgumentParser(prog="fd-rr", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    store_opts = argparse.ArgumentParser(add_help=False)
    store_opts.add_argument("--config", help="YAML/JSON config (default: $FD_ROUTING_REPLAY_CONFIG)")
    store_opts.add_argument("--store", help="store URL, e.g. local:///data/rr or redis://host/0")
    store_opts.add_argument("--namespace", help="override the config's namespace")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("ls", parents=[store_opts], help="list keys (optionally under a prefix)")
    p.add_argument("prefix", nargs="?", default=None)
    p.add_argument("--count", action="store_true", help="print the count to stderr")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("show", parents=[store_opts], help="header, shape and expert usage")
    p.add_argument("key")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("get", parents=[store_opts], help="save a record's ids as .npy")
    p.add_argument("key")
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(func=cmd_get)

    p = sub.add_parser("rm", parents=[store_opts], help="delete keys, or prefixes with --prefix")
    p.add_argument("targets", nargs="+", metavar="KEY_OR_PREFIX")
    p.add_argument("--prefix", action="store_true", help="treat arguments as prefixes")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("config", help="configuration tools")
    config_sub = p.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    check = config_sub.add_parser("check", help="validate a file and print the effective config")
    check.add_argument("file")
    check.set_defaults(func=cmd_config_check)

    for name, (module_name, help_text, takes_store) in _EXTERNAL.items():
        p = sub.add_parser(name, help=help_text, parents=[store_opts] if takes_store else [])
        p.set_defaults(func=None, external=module_name)
        # Only the module of the subcommand being run is imported (keeps `fd-rr ls` fast).
        if name in argv:
            importlib.import_module(module_name).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if getattr(args, "func", None) is None:
            return importlib.import_module(args.external).run(args)
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (RoutingReplayError, LookupError, OSError, TimeoutError, ImportError) as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
