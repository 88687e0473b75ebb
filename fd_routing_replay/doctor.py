"""``fd-rr doctor``: is this node ready to store and read routing records?

Checks, in order, each reported on one line (``OK``, ``WARN``, ``FAIL`` or ``SKIP``):

1. **config** — the config file (or ``--store`` URL) loads and names a backend;
2. **rdma** — RDMA devices, ports, link layers and GIDs (pyverbs), and which transport
   P2PStore or Mooncake will use;
3. **redis** — for ``redis``, ``p2pstore`` and ``mooncake`` stores (the index Redis):
   reachable, version, eviction policy, round-trip latency;
   **mooncake** — for ``mooncake`` stores only: the master's RPC port answers, and its
   HTTP server reports healthy with its mounted segments (``store.mooncake.master_http``);
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
from dataclasses import asdict, dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

from fd_routing_replay.redact import redact_text, redact_url

EXIT_OK, EXIT_FAILED = 0, 1
OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
_LABELS = {OK: "[ OK ]", WARN: "[WARN]", FAIL: "[FAIL]", SKIP: "[SKIP]"}
_INDEXED_TYPES = ("redis", "p2pstore", "mooncake")


@dataclass
class Check:
    """The outcome of one check."""

    name: str
    status: str
    summary: str
    details: list[str] = field(default_factory=list)
    elapsed_ms: float = 0.0


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

def check_rdma(store_type: str, store_config: Any) -> Check:
    """List RDMA devices; for a p2pstore store, say which transport it will use."""
    from fd_routing_replay.rdma.devices import choose_device, list_devices

    report = list_devices()
    details = report.summary().splitlines()[1:]
    if store_type == "mooncake":
        from fd_routing_replay.store.mooncake import mooncake_settings

        if mooncake_settings(store_config)["protocol"] == "tcp":
            return Check("rdma", OK, f"store.mooncake.protocol is tcp; {report.reason}", details)
        if report.tcp_only:
            return Check("rdma", FAIL, f"store.mooncake.protocol is rdma but {report.reason}; "
                                       "set protocol: tcp", details)
        return Check("rdma", OK, f"Mooncake will use RDMA: {report.reason}", details)
    if store_type != "p2pstore":
        verdict = "TCP only" if report.tcp_only else "RDMA available"
        return Check("rdma", SKIP, f"not used by the {store_type} store; {verdict}: "
                                   f"{report.reason}", details)
    from fd_routing_replay.store.p2pstore import p2pstore_settings

    settings = p2pstore_settings(store_config)
    if settings["protocol"] == "tcp":
        return Check("rdma", OK, f"store.p2pstore.protocol is tcp; {report.reason}", details)
    choice = choose_device(settings["device"], report)
    if choice.protocol == "rdma":
        return Check("rdma", OK, f"P2PStore will use RDMA: {choice.reason}", details)
    if not choice.ok and choice.candidates:
        return Check("rdma", FAIL, f"store.p2pstore.device={settings['device']!r}: "
                                   f"{choice.reason}", details)
    return Check("rdma", WARN, f"P2PStore will fall back to its TCP transport: {choice.reason}",
                 details)


def redis_target(store_type: str, store_config: Any) -> str | None:
    """The Redis URL a store depends on (None for stores without Redis)."""
    if store_type == "redis":
        url = store_config.url or store_config.redis.url
        return url if urlsplit(url).scheme.startswith("redis") else store_config.redis.url
    if store_type == "p2pstore":
        from fd_routing_replay.store.p2pstore import p2pstore_settings

        return p2pstore_settings(store_config)["metadata_server"]
    if store_type == "mooncake":
        from fd_routing_replay.store.mooncake import mooncake_settings

        return mooncake_settings(store_config)["index_url"]
    return None


def _redis_client(store_type: str, store_config: Any, url: str, timeout_s: float) -> Any:
    if store_type in ("redis", "mooncake"):
        from fd_routing_replay.store._redis import redis_client_from_config

        section = replace(store_config.redis, socket_timeout_s=timeout_s)
        if store_type == "mooncake":  # the index Redis, with store.redis's credentials
            section = replace(section, url=url)
            store_config = replace(store_config, url=None)
        return redis_client_from_config(replace(store_config, redis=section))[0]
    import redis

    if urlsplit(url).scheme == "redis+sentinel":
        return _sentinel_client(url, timeout_s)
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


def _sentinel_client(url: str, timeout_s: float) -> Any:
    """``redis+sentinel://[[user:]password@]h:p,h:p/service[/db]`` (P2PStore's form)."""
    from redis.sentinel import Sentinel

    rest = url.split("://", 1)[1]
    auth, _, rest = rest.rpartition("@")
    username, _, password = auth.partition(":") if ":" in auth else ("", "", auth)
    nodes_text, _, tail = rest.partition("/")
    service, _, db = tail.partition("/")
    nodes = [(host, int(port or 26379)) for host, _, port in
             (node.strip().partition(":") for node in nodes_text.split(",") if node.strip())]
    sentinel = Sentinel(nodes, socket_timeout=timeout_s)
    return sentinel.master_for(service or "mymaster", db=int(db or 0), socket_timeout=timeout_s,
                               password=password or None, username=username or None)


def check_redis(store_type: str, store_config: Any, timeout_s: float, pings: int = 5) -> Check:
    """Reachability, version, eviction policy and ping latency of the store's Redis."""
    url = redis_target(store_type, store_config)
    location = redact_url(url)
    try:
        client = _redis_client(store_type, store_config, url, timeout_s)
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


def check_mooncake(store_config: Any, timeout_s: float) -> Check:
    """The Mooncake master answers on its RPC port; with ``master_http``, its ``/health``
    says ok and ``/get_all_segments`` lists the segments records can go to."""
    import urllib.request

    from fd_routing_replay.store.mooncake import mooncake_settings

    settings = mooncake_settings(store_config)
    master = settings["master_server"]
    host, _, port = master.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        return Check("mooncake", FAIL, f"mooncake_master RPC port {master} does not answer: "
                                       f"{type(exc).__name__}: {exc}",
                     ["is mooncake_master running there (--rpc_port, --rpc_address)?"])
    admin = settings["master_http"]
    if not admin:
        return Check("mooncake", OK, f"mooncake_master {master} accepts connections",
                     ["set store.mooncake.master_http (the master's --metrics_port) to check "
                      "its health and segments, and to let fsck list objects"])
    try:
        with urllib.request.urlopen(f"http://{admin}/health", timeout=timeout_s) as answer:
            health = json.loads(answer.read())
        with urllib.request.urlopen(f"http://{admin}/get_all_segments",
                                    timeout=timeout_s) as answer:
            segments = [line for line in answer.read().decode().split("\n") if line]
    except (OSError, ValueError) as exc:
        return Check("mooncake", FAIL, f"mooncake_master HTTP server {admin} does not answer: "
                                       f"{type(exc).__name__}: {exc}")
    if health.get("status") != "ok":
        return Check("mooncake", FAIL, f"mooncake_master {master} is not healthy: {health}")
    summary = f"mooncake_master {master}: healthy, {len(segments)} segment(s) mounted"
    if not segments and not settings["global_segment_size"]:
        return Check("mooncake", WARN, summary, [
            "no segment is mounted and store.mooncake.global_segment_size is 0: puts will fail "
            "(-200) until a segment holder (mooncake_client) joins"])
    return Check("mooncake", OK, summary, segments[:10])


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
    from fd_routing_replay.store.indexed import IndexedStore

    index = getattr(store, "index", None)
    if not isinstance(getattr(store, "inner", store), IndexedStore):  # unwrap the metrics
        return Check("index", SKIP, f"{store.describe()} keeps no separate index")
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
    missing = [k for k, found in zip(keys, store.payloads_exist(keys), strict=True) if not found]
    if missing:  # a delete racing the sample: look once more
        missing = [k for k, found in zip(missing, store.payloads_exist(missing), strict=True)
                   if not found and index.contains(k)]
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
    from fd_routing_replay.store.registry import store_type_of

    report = Report()
    store_type = store_type_of(store_config)
    report.add(Check("config", OK, f"store type {store_type}, namespace "
                                   f"{store_config.namespace}"
                                   + (f" ({redact_url(source)})" if source else "")))
    report.add(_timed("rdma", lambda: check_rdma(store_type, store_config)))
    redis_ok = True
    if store_type in _INDEXED_TYPES:
        redis_ok = report.add(_timed("redis", lambda: check_redis(store_type, store_config,
                                                                  timeout_s))).status != FAIL
    else:
        report.add(Check("redis", SKIP, f"the {store_type} store does not use Redis"))
    if redis_ok and store_type == "mooncake":
        redis_ok = report.add(_timed("mooncake", lambda: check_mooncake(
            store_config, timeout_s))).status != FAIL
    if not redis_ok:
        for name in ("store", "roundtrip", "index"):
            report.add(Check(name, SKIP, "needs Redis"))
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
