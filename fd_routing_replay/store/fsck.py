"""``fd-rr fsck``: find and repair disagreements between payloads and the prefix index.

Stores write the payload before its index entry and delete the payload before its index
entry, so a crash can leave only two kinds of debris:

* **unindexed payload** — a record no prefix delete or ``list`` can see.  Repair indexes
  it (the record is intact; dropping it would lose data).
* **dangling index entry** — an entry whose payload is gone.  Repair drops the entry
  (after checking once more that the payload is still absent).

Any store exposing ``index`` (a :class:`~fd_routing_replay.store.index.PrefixIndex`),
``iter_payload_keys()`` and ``payloads_exist(keys)`` can be checked (and, optionally,
``translate_errors(action)``, a context manager mapping client errors to store errors);
the Redis backend does.  Finding unindexed payloads scans every key of the database (``SCAN``), so run it as
an offline check.  Repair is safe while writers are idle; a dry run is safe any time.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass, field
from typing import Any, Protocol

EXIT_OK, EXIT_INCONSISTENT, EXIT_ERROR = 0, 1, 2
_SHOW = 20


class IndexedStore(Protocol):
    """What fsck needs from a store."""

    namespace: str
    index: Any

    def iter_payload_keys(self) -> Any: ...

    def payloads_exist(self, keys: list[str]) -> list[bool]: ...

    def describe(self) -> str: ...


@dataclass
class FsckReport:
    """What fsck found (and, with ``repaired``, fixed) in one namespace."""

    store: str
    namespace: str
    indexed: int = 0
    payloads: int = 0
    dangling: list[str] = field(default_factory=list)
    unindexed: list[str] = field(default_factory=list)
    repaired: bool = False

    @property
    def consistent(self) -> bool:
        """True when nothing was found."""
        return not self.dangling and not self.unindexed

    def to_text(self) -> str:
        """A readable multi-line report."""
        lines = [f"fsck {self.store}",
                 f"  index entries    {self.indexed}",
                 f"  payloads         {self.payloads}",
                 f"  dangling entries {len(self.dangling)} (index entry, payload missing)",
                 f"  unindexed        {len(self.unindexed)} (payload not in the index)"]
        for label, keys in (("dangling", self.dangling), ("unindexed", self.unindexed)):
            for key in keys[:_SHOW]:
                lines.append(f"    {label}: {key}")
            if len(keys) > _SHOW:
                lines.append(f"    ... and {len(keys) - _SHOW} more {label}")
        if self.consistent:
            lines.append("  result: consistent")
        elif self.repaired:
            lines.append("  result: repaired (dangling entries dropped, payloads indexed)")
        else:
            lines.append("  result: INCONSISTENT (run with --repair to fix)")
        return "\n".join(lines)


def fsck(store: IndexedStore, repair: bool = False, *, batch: int = 1000) -> FsckReport:
    """Compare a store's index with its payloads; with ``repair``, fix both kinds."""
    for needed in ("index", "iter_payload_keys", "payloads_exist"):
        if not hasattr(store, needed):
            raise TypeError(f"fsck needs a store with an index; {store.describe()} has no "
                            f"{needed!r}")
    guard = getattr(store, "translate_errors", None)
    with guard("fsck") if guard is not None else contextlib.nullcontext():
        return _fsck(store, repair, batch)


def _fsck(store: IndexedStore, repair: bool, batch: int) -> FsckReport:
    index = store.index
    report = FsckReport(store=store.describe(), namespace=store.namespace)
    # 1. dangling entries: walk the index page by page, check payloads in one round trip.
    for page in index.all_pages(batch):
        report.indexed += len(page)
        present = store.payloads_exist(page)
        report.dangling.extend(key for key, found in zip(page, present, strict=True)
                               if not found)
    # 2. unindexed payloads: scan the payloads, check index membership per page.
    page: list[str] = []
    for key in store.iter_payload_keys():
        report.payloads += 1
        page.append(key)
        if len(page) >= batch:
            report.unindexed.extend(_not_indexed(index, page))
            page = []
    if page:
        report.unindexed.extend(_not_indexed(index, page))
    report.dangling.sort()
    report.unindexed.sort()
    if repair and not report.consistent:
        _repair(store, report, batch)
        report.repaired = True
    return report


def _not_indexed(index: Any, keys: list[str]) -> list[str]:
    pipe = index.client.pipeline(transaction=False)
    for key in keys:
        pipe.zscore(index.key, key.encode("utf-8"))
    return [key for key, score in zip(keys, pipe.execute(), strict=True) if score is None]


def _repair(store: IndexedStore, report: FsckReport, batch: int) -> None:
    for start in range(0, len(report.dangling), batch):
        page = report.dangling[start:start + batch]
        # A writer may have re-created a payload since the scan: keep those entries.
        still_missing = [key for key, found in zip(page, store.payloads_exist(page),
                                                   strict=True) if not found]
        store.index.remove(still_missing)
    store.index.add(report.unindexed)


# -- command line ---------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``fd-rr fsck``."""
    # --config, --store and --namespace come from fd-rr's shared store options.
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true",
                      help="only report (the default)")
    mode.add_argument("--repair", action="store_true",
                      help="drop dangling index entries and index unindexed payloads")
    parser.add_argument("--batch", type=int, default=1000, help="keys per Redis round trip")


def run(args: argparse.Namespace) -> int:
    """Run fsck; exit 0 when consistent (or repaired), 1 when inconsistent, 2 on error."""
    from fd_routing_replay.config import load_config
    from fd_routing_replay.errors import RoutingReplayError
    from fd_routing_replay.store import open_store

    repair = bool(getattr(args, "repair", False))
    try:
        if getattr(args, "store", None):
            store = open_store(args.store, getattr(args, "namespace", None))
        else:
            store = open_store(load_config(getattr(args, "config", None)),
                               getattr(args, "namespace", None))
    except (RoutingReplayError, OSError) as exc:
        print(f"error: cannot open the store: {exc}", file=sys.stderr)
        return EXIT_ERROR
    with store:
        try:
            report = fsck(store, repair=repair, batch=getattr(args, "batch", 1000))
        except (TypeError, RoutingReplayError) as exc:
            print(f"error: fsck of {store.describe()} failed: {exc}", file=sys.stderr)
            return EXIT_ERROR
    print(report.to_text())
    return EXIT_OK if report.consistent or report.repaired else EXIT_INCONSISTENT
