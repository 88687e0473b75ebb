"""``fd-rr rm``: delete keys, everything under boundary-safe prefixes, or (``--older-than``)
the records the retention sweeper would expire, asking first unless ``--yes``.

Questions go to stderr (stdout may be ``--json`` for a script); without a terminal on
stdin, deleting by prefix or age needs ``--yes``.
"""

from __future__ import annotations

import argparse
import sys

from fd_routing_replay.cli.common import EXIT_FAILURE, EXIT_OK, open_store, print_json, progress
from fd_routing_replay.errors import RoutingReplayError

__all__ = ["cmd_rm", "rm_arguments"]


def _confirm(question: str) -> bool:
    if not sys.stdin.isatty():
        raise RoutingReplayError("refusing to delete without confirmation: stdin is not a "
                                 "terminal; pass --yes")
    sys.stderr.write(question)  # never stdout: it may be --json for a script
    sys.stderr.flush()
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def _rm_older(args: argparse.Namespace) -> int:
    """``rm --older-than``: the retention sweeper by hand, over prefixes or the namespace."""
    from fd_routing_replay.store.retention import parse_duration, sweep

    ttl = parse_duration(args.older_than)
    if ttl <= 0:
        raise RoutingReplayError("--older-than must be more than 0 seconds")
    prefixes = args.targets or [None]
    with open_store(args) as store:
        where = store.describe()
        planned = [key for prefix in prefixes
                   for key in sweep(store, ttl_s=ttl, prefix=prefix, dry_run=True).expired]
        if args.dry_run or not planned or not (args.yes or _confirm(
                f"delete {len(planned)} record(s) older than {args.older_than} from {where}? "
                "[y/N] ")):
            aborted = bool(planned) and not args.dry_run
            if args.json:
                print_json({"store": where, "older_than_s": ttl, "would_delete": planned,
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
        print_json({"store": where, "older_than_s": ttl, "deleted": deleted,
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
    with open_store(args) as store:
        where = store.describe()
        if not args.prefix:
            removed = store.delete(args.targets)
            if args.json:
                print_json({"store": where, "keys": args.targets, "deleted": removed})
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
                    print_json({"store": where, "prefixes": dict.fromkeys(targets, 0),
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
            progress(index, len(targets), "deleting")
    if args.json:
        print_json({"store": where, "prefixes": counts, "deleted": sum(counts.values()),
                    "aborted": False})
    else:
        print(f"deleted {sum(counts.values())} record(s)")
    return EXIT_OK


def rm_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("targets", nargs="*", metavar="KEY_OR_PREFIX")
    p.add_argument("--prefix", action="store_true", help="treat arguments as prefixes")
    p.add_argument("--older-than", metavar="DURATION",
                   help="delete records created more than DURATION ago (90s, 30m, 2h, 7d), under "
                        "the given prefixes or the whole namespace; records of unknown age are kept")
    p.add_argument("--dry-run", action="store_true",
                   help="with --older-than: list what would be deleted, delete nothing")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("--json", action="store_true", help="print a JSON object instead")
