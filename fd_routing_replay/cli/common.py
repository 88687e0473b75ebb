"""What every ``fd-rr`` subcommand shares: exit statuses, opening the store, reading and
validating one record, and printing (JSON, aligned rows, a progress bar).

Subcommand modules import these; this module imports no subcommand, so the command table
(:mod:`.app`) and the commands depend on it one way.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
#: ``fd-rr fsck``: the store was checked and is inconsistent (not repaired).
EXIT_FSCK_INCONSISTENT = 1
#: ``fd-rr fsck``: the store could not be checked (not opened, no index, an error midway).
EXIT_FSCK_ERROR = 3
EXIT_INTERRUPTED = 130

__all__ = [
    "EXIT_FAILURE", "EXIT_FSCK_ERROR", "EXIT_FSCK_INCONSISTENT", "EXIT_INTERRUPTED", "EXIT_OK",
    "EXIT_USAGE", "HelpFormatter", "add_raw_argument", "load_record", "open_store",
    "print_json", "progress", "raw_geometry", "rows", "store_call_summary",
]


class HelpFormatter(argparse.HelpFormatter):
    """Wraps descriptions to the terminal; keeps the example lines of an epilog as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("example"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def open_store(args: argparse.Namespace) -> Any:
    """The store ``--store`` or the config names, in ``--namespace``; remembered in
    ``args.opened`` for ``--stats``."""
    # A registry of this command's own: --stats reports only the calls it made (a CLI
    # process is never scraped).
    from prometheus_client import CollectorRegistry

    from fd_routing_replay.config import load_config
    from fd_routing_replay.store import open_store as open_configured

    store = open_configured(args.store if args.store else load_config(args.config),
                            args.namespace, metrics_registry=CollectorRegistry())
    metrics = getattr(store, "metrics", None)
    if metrics is not None:
        args.opened.append((store.describe(), metrics))
    return store


def store_call_summary(where: str, metrics: Any) -> str:
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


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str))


def progress(done: int, total: int, label: str) -> None:
    """A progress bar on stderr, only when stderr is a terminal."""
    if not sys.stderr.isatty():
        return
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def rows(pairs: list[tuple[str, Any]]) -> str:
    """Labels in one column wide enough for the longest, so no label runs into its value."""
    width = max(len(label) for label, _ in pairs) + 2
    return "\n".join(f"{label:<{width}}{value}".rstrip() for label, value in pairs)


def load_record(store: Any, key: str, raw: Any = None) -> Any:
    """The record under ``key`` (rr-v1 or FastDeploy .pdtensor; a rollout stored per layer
    is assembled) as a :class:`~fd_routing_replay.reader.StoredRecord`, validated as
    :class:`~fd_routing_replay.reader.RoutingReader` validates what it hands out:
    checksum, expert-id range and the rollout the record belongs to."""
    from fd_routing_replay.codec import check_expert_range
    from fd_routing_replay.errors import InvalidRolloutId, RecordError
    from fd_routing_replay.keys import split_layer_key, split_partial_key
    from fd_routing_replay.reader import read_stored

    stored = read_stored(store, key, raw=raw)
    if stored is None:
        raise LookupError(f"no record under key {key!r} in {store.describe()}")
    partial = split_partial_key(key)       # {rollout_id}_partial: a running rollout's routing so far
    try:
        expected = partial.text if partial is not None else split_layer_key(key)[0].text
    except InvalidRolloutId:
        expected = None  # a key outside the rollout grammar: nothing to compare with
    if partial is not None and stored.record.metadata.get("partial") is not True:
        raise RecordError(f"the record under {key!r} is not marked partial (metadata partial: true)")
    record = stored.record
    if expected is not None and record.rollout_id != expected:
        raise RecordError(f"record stored under {key!r} belongs to rollout "
                          f"{record.rollout_id!r}; the store is inconsistent (run fd-rr fsck)")
    check_expert_range(record)
    return stored


def raw_geometry(text: str) -> Any:
    """``--raw-geometry``'s value as a :class:`~fd_routing_replay.reader.RawGeometry`."""
    from fd_routing_replay.reader import RawGeometry

    try:
        return RawGeometry.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_raw_argument(p: argparse.ArgumentParser) -> None:
    """``--raw-geometry``, for the commands that read one record."""
    p.add_argument("--raw-geometry", type=raw_geometry, metavar="top_k=K,dtype=D[,num_layers=L]",
                   help="read a header-less FastDeploy raw value (its P2PStore keys) with this geometry")
