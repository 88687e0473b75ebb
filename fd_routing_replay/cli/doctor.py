"""``fd-rr doctor``: is this node ready to store and read routing records?

Checks, in order, each reported on one line (``OK``, ``WARN``, ``FAIL`` or ``SKIP``):

1. **config** — the config file (or ``--store`` URL) loads and names a backend;
2. **rdma** — RDMA devices, ports, link layers and GIDs (pyverbs), and which transport
   the store will use (the backend's ``rdma_check``, e.g. P2PStore's or Mooncake's);
3. **redis** — for stores that depend on a Redis (the backend's ``redis_target``: its data,
   index or metadata server): reachable, version, eviction policy, round-trip latency;
   then the backend's own ``doctor_checks`` (e.g. **mooncake**: the master answers);
4. **store** — the store opens;
5. **roundtrip** — a test record (a valid rollout id under ``_doctor_…``) is encoded with
   the rr-v1 codec, put, read back, verified (checksum and ids), listed and deleted;
6. **index** — a sample of prefix-index entries all have their payloads (the check
   ``fd-rr fsck`` runs on every entry; it repairs what this finds).

Exit status 0 when nothing failed (warnings allowed), 1 otherwise.  An unreachable Redis
fails within ``--timeout`` seconds and skips the checks that need it.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from fd_routing_replay.core.diagnostics import FAIL, OK, SKIP, WARN, Check
from fd_routing_replay.core.redact import redact_text, redact_url

EXIT_OK, EXIT_FAILED = 0, 1
_LABELS = {OK: "[ OK ]", WARN: "[WARN]", FAIL: "[FAIL]", SKIP: "[SKIP]"}


@dataclass
class Report:
    """Every check run, in order."""

    checks: list[Check] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(check.status == FAIL for check in self.checks)

    def add(self, check: Check) -> Check:
        self.checks.append(check)
        return check

    def to_text(self) -> str:
        lines = ["fd-rr doctor"]
        for check in self.checks:
            lines.append(f"{_LABELS[check.status]} {check.name:<10} {check.summary}")
            lines.extend(f"{'':18}{detail}" for detail in check.details)
        failures = sum(c.status == FAIL for c in self.checks)
        warnings = sum(c.status == WARN for c in self.checks)
        lines.append(f"result: {'FAILED' if failures else 'healthy'} "
                     f"({failures} failure(s), {warnings} warning(s))")
        return "\n".join(lines)


def _timed(name: str, function: Callable[[], Check]) -> Check:
    start = time.perf_counter()
    try:
        check = function()
    except Exception as exc:  # noqa: BLE001 - every failure becomes a FAIL line
        check = Check(name, FAIL, f"{type(exc).__name__}: {redact_text(str(exc))}")
    check.elapsed_ms = (time.perf_counter() - start) * 1000
    return check


# -- individual checks --------------------------------------------------------------------------

def check_rdma(backend: Any, store_type: str, store_config: Any) -> Check:
    """List RDMA devices; say which transport the store will use (its backend's
    ``rdma_check``), or that it uses none."""
    from fd_routing_replay.rdma.devices import list_devices

    report = list_devices()
    details = report.summary().splitlines()[1:]
    if backend is None or backend.rdma_check is None:
        verdict = "TCP only" if report.tcp_only else "RDMA available"
        return Check("rdma", SKIP, f"not used by the {store_type} store; {verdict}: "
                                   f"{report.reason}", details)
    check = backend.rdma_check(store_config, report)
    if not isinstance(check, Check) or check.status == SKIP:
        raise ValueError(f"the {store_type} backend's rdma_check answered {check!r}; expected "
                         f"a core.diagnostics.Check with status {OK}, {WARN} or {FAIL}")
    check.details = details + check.details
    return check


def redis_target(store_type: str, store_config: Any) -> str | None:
    """The Redis URL a store depends on (None for stores without Redis)."""
    from fd_routing_replay.store.backend import backend_named

    backend = backend_named(store_type)
    if backend is None or backend.redis_target is None:
        return None
    return backend.redis_target(store_config).url


def check_redis(target: Any, timeout_s: float, pings: int = 5) -> Check:
    """Reachability, version, eviction policy and ping latency of the Redis a store depends
    on (a :class:`~fd_routing_replay.store.backend.RedisTarget`)."""
    location = redact_url(target.url)
    try:
        client = target.connect(timeout_s)
        latencies = []
        for _ in range(pings):
            start = time.perf_counter()
            client.ping()
            latencies.append((time.perf_counter() - start) * 1000)
        info = client.info("server")
    except Exception as exc:  # noqa: BLE001 - reported as the failure
        return Check("redis", FAIL, f"cannot reach Redis at {location}: "
                                    f"{type(exc).__name__}: {redact_text(str(exc))}",
                     ["is redis-server running there, and the host/port/password right?"])
    version = str(info.get("redis_version", "?"))
    details = [f"ping: median {statistics.median(latencies):.2f} ms, max {max(latencies):.2f} ms "
               f"over {pings} pings"]
    status, notes = OK, []
    try:
        policy = client.config_get("maxmemory-policy").get("maxmemory-policy")
    except Exception:  # noqa: BLE001 - CONFIG may be disabled by ACL or the provider
        policy = None
    if isinstance(policy, bytes):
        policy = policy.decode()
    if policy and policy != "noeviction":
        status = WARN
        notes.append(f"maxmemory-policy is {policy}: Redis may evict index entries or "
                     f"records under memory pressure; set noeviction")
    major = int(version.split(".")[0]) if version.split(".")[0].isdigit() else 0
    if major and major < 6:
        status = WARN
        notes.append(f"Redis {version} is older than 6; tested with 7")
    try:
        client.close()
    except Exception:  # noqa: BLE001
        pass
    return Check("redis", status, f"{location}: Redis {version}, ping median "
                                  f"{statistics.median(latencies):.2f} ms"
                                  + (f", maxmemory-policy {policy}" if policy else ""),
                 notes + details)


def doctor_rollout_id() -> str:
    """A valid rollout id under the ``_doctor_`` prefix, unique to this run."""
    host = "".join(c if c.isalnum() or c == "-" else "-" for c in socket.gethostname())[:40]
    return f"_doctor_{host or 'host'}-{os.getpid()}-{secrets.token_hex(4)}:0:0"


def check_roundtrip(store: Any) -> Check:
    """Put, get, verify, list and delete one encoded test record; always clean up."""
    import numpy as np

    from fd_routing_replay.codec import RoutingRecord, encode_record
    from fd_routing_replay.keys import parse_rollout_id
    from fd_routing_replay.reader import decode_stored

    rollout_id = parse_rollout_id(doctor_rollout_id()).text
    ids = np.random.default_rng().integers(0, 64, size=(4, 64, 8), dtype=np.uint8)
    encoded = encode_record(RoutingRecord(rollout_id, ids, 64, metadata={"doctor": True}))
    times: dict[str, float] = {}

    def timed(label: str, call: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = call()
        times[label] = (time.perf_counter() - start) * 1000
        return result

    problems = []
    try:
        timed("put", lambda: store.put(rollout_id, encoded))
        value = timed("get", lambda: store.get(rollout_id))
        if value is None:
            problems.append("get returned None right after put")
        else:
            record = decode_stored(value, rollout_id, verify=True).record  # any stored format
            if record.rollout_id != rollout_id or not np.array_equal(record.ids, ids):
                problems.append("the record read back differs from the one written")
        if rollout_id not in store.list(rollout_id.rsplit(":", 2)[0]):
            problems.append("the record is missing from list(prefix)")
        removed = timed("delete", lambda: store.delete([rollout_id]))
        if removed != 1:
            problems.append(f"delete reported {removed} removed, expected 1")
        if store.get(rollout_id) is not None:
            problems.append("the record is still readable after delete")
    finally:
        try:
            store.delete([rollout_id])
        except Exception:  # noqa: BLE001 - cleanup is best effort; the failure is reported
            pass
    summary = (f"{rollout_id} ({len(encoded):,} B): "
               + ", ".join(f"{label} {ms:.1f} ms" for label, ms in times.items()))
    if problems:
        return Check("roundtrip", FAIL, summary, problems)
    return Check("roundtrip", OK, summary + "; verified and deleted")


def check_index(store: Any, sample: int) -> Check:
    """Every sampled index entry has a payload (the fsck check, on a sample)."""
    from fd_routing_replay.store.indexed import as_indexed

    indexed = as_indexed(store)
    if indexed is None:
        return Check("index", SKIP, f"{store.describe()} keeps no separate index")
    index = indexed.index
    total = len(index)
    if total == 0:
        return Check("index", OK, "index is empty")
    from fd_routing_replay.store.index import printable, split_members

    invalid: list[bytes] = []
    try:
        members = index.sample(min(sample, total))
        keys, invalid = split_members(members or [])
    except Exception:  # noqa: BLE001 - ZRANDMEMBER needs Redis 6.2: take the first page
        keys = next(iter(index.all_pages(sample)), [])
    missing = [k for k, found in zip(keys, indexed.payloads_exist(keys), strict=True) if not found]
    if missing:  # a delete racing the sample: look once more
        missing = [k for k, found in zip(missing, indexed.payloads_exist(missing), strict=True)
                   if not found and index.contains(k)]
    if missing and indexed.supports_expiry():  # expired by retention.ttl_s: not a problem
        expired = set(indexed.expired_entries(missing))  # type: ignore[attr-defined]
        missing = [k for k in missing if k not in expired]
    summary = f"sampled {len(keys) + len(invalid)} of {total} entries"
    if invalid:
        return Check("index", FAIL, f"{summary}: {len(invalid)} are not valid keys (run `fd-rr fsck "
                                    f"--repair` to drop them)", [printable(m) for m in invalid[:10]])
    if missing:
        return Check("index", FAIL, f"{summary}: {len(missing)} without payload "
                                    f"(run `fd-rr fsck --repair`)", missing[:10])
    return Check("index", OK, f"{summary}: all have their payloads")


# -- command ------------------------------------------------------------------------------------

def diagnose(store_config: Any, *, timeout_s: float = 3.0, sample: int = 1000,
             source: str = "") -> Report:
    """Run every check against ``store_config``; never raises."""
    from fd_routing_replay.store import open_store
    from fd_routing_replay.store.registry import backend_of, store_type_of

    report = Report()
    store_type = store_type_of(store_config)
    backend = backend_of(store_config)
    report.add(Check("config", OK, f"store type {store_type}, namespace "
                                   f"{store_config.namespace}"
                                   + (f" ({redact_url(source)})" if source else "")))
    report.add(_timed("rdma", lambda: check_rdma(backend, store_type, store_config)))
    blocked = ""
    if backend is not None and backend.redis_target is not None:
        target = backend.redis_target
        if report.add(_timed("redis", lambda: check_redis(target(store_config),
                                                          timeout_s))).status == FAIL:
            blocked = "needs Redis"
    else:
        report.add(Check("redis", SKIP, f"the {store_type} store does not use Redis"))
    for name, check in (backend.doctor_checks if backend is not None and not blocked else ()):
        if report.add(_timed(name, lambda check=check: check(store_config,
                                                             timeout_s))).status == FAIL:
            blocked = f"the {name} check failed"
            break
    if blocked:
        for name in ("store", "roundtrip", "index"):
            report.add(Check(name, SKIP, blocked))
        return report
    holder: dict[str, Any] = {}

    def _open() -> Check:
        holder["store"] = open_store(store_config)
        return Check("store", OK, f"opened {holder['store'].describe()}")

    opened = report.add(_timed("store", _open))
    if opened.status == FAIL:
        for name in ("roundtrip", "index"):
            report.add(Check(name, SKIP, "the store did not open"))
        return report
    store = holder["store"]
    try:
        report.add(_timed("roundtrip", lambda: check_roundtrip(store)))
        report.add(_timed("index", lambda: check_index(store, sample)))
    finally:
        store.close()
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``fd-rr doctor``."""
    # --config, --store and --namespace come from fd-rr's shared store options.
    parser.add_argument("--timeout", type=float, default=3.0,
                        help="seconds to wait for Redis before failing (default 3)")
    parser.add_argument("--sample", type=int, default=1000,
                        help="index entries to check for a payload (default 1000)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    """Run the checks, print the report, exit 0 when nothing failed."""
    from fd_routing_replay.config import load_config
    from fd_routing_replay.store import store_config_from

    namespace = getattr(args, "namespace", None)
    try:
        if getattr(args, "store", None):
            store_config, source = store_config_from(args.store, namespace), args.store
        else:
            config = load_config(getattr(args, "config", None))
            store_config = store_config_from(config, namespace)
            source = getattr(args, "config", None) or os.environ.get(
                "FD_ROUTING_REPLAY_CONFIG", "defaults")
    except Exception as exc:  # noqa: BLE001 - a bad config is a failed check
        report = Report([Check("config", FAIL, f"{type(exc).__name__}: {redact_text(str(exc))}")])
    else:
        report = diagnose(store_config, timeout_s=getattr(args, "timeout", 3.0),
                          sample=getattr(args, "sample", 1000), source=str(source))
    # Every check already masks what it quotes; one more pass guards the ones to come.
    if getattr(args, "json", False):
        print(redact_text(json.dumps({"failed": report.failed,
                                      "checks": [asdict(check) for check in report.checks]},
                                     indent=2)))
    else:
        print(redact_text(report.to_text()))
    sys.stdout.flush()
    return EXIT_FAILED if report.failed else EXIT_OK
