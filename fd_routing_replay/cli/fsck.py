"""``fd-rr fsck``: compare an indexed store's prefix index with its payloads and, with
``--repair``, make them agree (:func:`fd_routing_replay.store.index.fsck.fsck`).

Exit status: 0 consistent or repaired, 1 inconsistent, 3 could not check (the store did
not open, has no index, or the check failed midway).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

from fd_routing_replay.cli.common import (
    EXIT_FSCK_INCONSISTENT,
    EXIT_OK,
    open_store,
    print_json,
)
from fd_routing_replay.errors import RoutingReplayError

__all__ = ["cmd_fsck", "fsck_arguments"]


def fsck_arguments(parser: argparse.ArgumentParser) -> None:
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
    from fd_routing_replay.core.parsing import parse_int

    try:
        value = parse_int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def cmd_fsck(args: argparse.Namespace) -> int:
    from fd_routing_replay.store.index.fsck import fsck

    try:
        store = open_store(args)
    except (RoutingReplayError, OSError, ImportError) as exc:
        raise RoutingReplayError(f"cannot open the store: {exc}") from exc
    with store:
        try:
            report = fsck(store, repair=args.repair, batch=args.batch, deep=args.deep,
                          migrate_index=args.migrate_index)
        except (TypeError, RoutingReplayError, OSError) as exc:
            raise RoutingReplayError(f"fsck of {store.describe()} failed: {exc}") from exc
    if args.json:
        print_json({**asdict(report), "consistent": report.consistent})
    else:
        print(report.to_text())
    return EXIT_OK if report.consistent or report.repaired else EXIT_FSCK_INCONSISTENT
