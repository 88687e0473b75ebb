"""``fd-rr doctor`` hooks of the Mooncake backend: the index Redis it depends on, whether
its transport can run, and whether the master answers with segments to put records in."""

from __future__ import annotations

import json
import socket
import urllib.request
from typing import Any

from fd_routing_replay.config.backends import RedisTarget
from fd_routing_replay.config.stores.mooncake import mooncake_settings
from fd_routing_replay.core.diagnostics import FAIL, OK, WARN, Check
from fd_routing_replay.store.mooncake.clients import index_client

__all__ = ["check_master", "rdma_check", "redis_target"]


def redis_target(store_config: Any) -> RedisTarget:
    """The index Redis, reached with ``store.redis``'s credentials."""
    url = mooncake_settings(store_config).index_url
    return RedisTarget(url, lambda timeout_s: index_client(store_config, url, timeout_s)[0])


def rdma_check(store_config: Any, report: Any) -> Check:
    """Whether the configured transport can run: tcp always, rdma only with a usable NIC."""
    if mooncake_settings(store_config).protocol == "tcp":
        return Check("rdma", OK, f"store.mooncake.protocol is tcp; {report.reason}")
    if report.tcp_only:
        return Check("rdma", FAIL, f"store.mooncake.protocol is rdma but {report.reason}; set protocol: tcp")
    return Check("rdma", OK, f"Mooncake will use RDMA: {report.reason}")


def check_master(store_config: Any, timeout_s: float) -> Any:
    """``fd-rr doctor``: the master answers on its RPC port; with ``master_http``, its
    ``/health`` says ok and ``/get_all_segments`` lists the segments records can go to."""

    settings = mooncake_settings(store_config)
    master = settings.master_server
    host, _, port = master.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        return Check("mooncake", FAIL, f"mooncake_master RPC port {master} does not answer: "
                                       f"{type(exc).__name__}: {exc}",
                     ["is mooncake_master running there (--rpc_port, --rpc_address)?"])
    admin = settings.master_http
    if not admin:
        return Check("mooncake", OK, f"mooncake_master {master} accepts connections",
                     ["set store.mooncake.master_http (the master's --metrics_port) to check "
                      "its health and segments, and to let fsck list objects"])
    try:
        with urllib.request.urlopen(f"http://{admin}/health", timeout=timeout_s) as answer:  # noqa: S310
            health = json.loads(answer.read())
        with urllib.request.urlopen(f"http://{admin}/get_all_segments",  # noqa: S310
                                    timeout=timeout_s) as answer:
            segments = [line for line in answer.read().decode().split("\n") if line]
    except (OSError, ValueError) as exc:
        return Check("mooncake", FAIL, f"mooncake_master HTTP server {admin} does not answer: "
                                       f"{type(exc).__name__}: {exc}")
    if health.get("status") != "ok":
        return Check("mooncake", FAIL, f"mooncake_master {master} is not healthy: {health}")
    summary = f"mooncake_master {master}: healthy, {len(segments)} segment(s) mounted"
    if not segments and not settings.global_segment_size:
        return Check("mooncake", WARN, summary, [
            "no segment is mounted and store.mooncake.global_segment_size is 0: puts will fail "
            "(-200) until a segment holder (mooncake_client) joins"])
    return Check("mooncake", OK, summary, segments[:10])
