"""Prometheus export: capture counters through the writer, labels, bind address, readers."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from fd_routing_replay.capture import CAPTURE_COUNTERS, CAPTURE_GAUGES, render_capture
from fd_routing_replay.capture.fd25 import CaptureGeometry, create_manager
from fd_routing_replay.codec import RoutingRecord
from fd_routing_replay.config import ConfigError, config_from_dict
from fd_routing_replay.core.paths import RankIdentity
from fd_routing_replay.integrations.metrics import metric_names
from fd_routing_replay.metrics import LABELS, SnapshotCollector
from fd_routing_replay.reader import RoutingReader
from fdrr_dev.harness.paddle_runtime import paddle
from fdrr_dev.testing.process import free_port

GEOMETRY = CaptureGeometry(max_num_seqs=4, max_model_len=32, num_moe_layers=2, top_k=2,
                           num_experts=8, block_size=4, total_block_num=16)


def _config(tmp_path, **writer):
    return config_from_dict({
        "enabled": True,
        "store": {"type": "local", "namespace": "met", "local": {"root": str(tmp_path / "store")}},
        "writer": {"mode": "thread", "journal_dir": str(tmp_path / "journal"),
                   "dead_letter_dir": str(tmp_path / "dead"), **writer},
    }, source="test")


def _scrape(registry) -> dict[str, dict]:
    """{sample name: {frozenset(labels): value}} from the registry's exposition text."""
    from prometheus_client import generate_latest

    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
    return out


@pytest.fixture
def manager(tmp_path):
    config = _config(tmp_path)
    width = -(-GEOMETRY.max_model_len // GEOMETRY.block_size)
    block_table = paddle.to_tensor(np.full((GEOMETRY.max_num_seqs, width), -1, dtype=np.int32))
    made = create_manager(config, GEOMETRY, block_table=block_table,
                          identity=RankIdentity(dp_rank=3, tp_rank=0))
    yield made
    made.close(timeout=30)


def test_capture_counters_are_served_with_the_writers_metrics(manager):
    manager.register_request(batch_id=0, request_id="chatcmpl-job_1:0:0:0")
    manager.register_request(batch_id=1, request_id="not a rollout id!")   # counted, not kept
    stats = manager.stats()
    assert stats["registered"] == 2 and stats["invalid_request_ids"] == 1
    registry = manager.writer.metrics_registry
    labels = {"namespace": "met", "store": "local", "rank": "dp3-tp0"}
    for key in CAPTURE_COUNTERS:
        if key in stats:
            assert registry.get_sample_value(f"fd_rr_capture_{key}_total", labels) == \
                pytest.approx(stats[key], rel=1e-6, abs=1e-3), key
    assert registry.get_sample_value("fd_rr_capture_registered_total", labels) == 2
    assert registry.get_sample_value("fd_rr_capture_invalid_request_ids_total", labels) == 1
    assert registry.get_sample_value("fd_rr_capture_bad_expert_ids_total", labels) == 0
    assert registry.get_sample_value("fd_rr_capture_host_cache_bytes", labels) == \
        stats["host_cache_bytes"] > 0
    # a scrape reads the manager live: the next registration shows without any push
    manager.register_request(batch_id=2, request_id="chatcmpl-job_2:0:0:0")
    assert registry.get_sample_value("fd_rr_capture_registered_total", labels) == 3


def _component_stats(manager, tmp_path) -> dict[str, dict]:
    """stats() of every capture component, each built as production builds it: the table
    API's manager, FastDeploy 2.6's worker capturer, and 2.6's engine side in its storing
    and its response (reference) modes."""
    from fd_routing_replay.capture.fd26 import EngineRouting, StepRoutingCapturer
    from fd_routing_replay.capture.slots import HostSlotCache
    from tests.capture.steps import ListWriter

    capturer = StepRoutingCapturer(max_batched_tokens=8, num_moe_layers=2, top_k=2, num_experts=8)
    cache = HostSlotCache(64, 2, 2, np.uint8, 255)
    storing = EngineRouting(_config(tmp_path), GEOMETRY, cache, writer=ListWriter())
    referencing = EngineRouting(config_from_dict({"enabled": True, "response": {"routes": "reference"}},
                                                 source="test"), GEOMETRY, cache, writer=ListWriter(),
                                response=True)
    try:
        return {"fd25 manager": manager.stats(), "fd26 capturer": capturer.stats(),
                "fd26 engine": storing.stats(), "fd26 engine, references": referencing.stats()}
    finally:
        capturer.close()


def test_every_capture_stat_is_exported_and_every_exported_one_is_reported(manager, tmp_path):
    """A counter added to a capture component without an entry in the metric table fails
    here, and so does an entry no component reports (a metric advertised that never comes)."""
    exported = set(CAPTURE_COUNTERS) | set(CAPTURE_GAUGES)
    reported = set()
    for component, stats in _component_stats(manager, tmp_path).items():
        numeric = {k for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        assert numeric - exported == set(), component
        reported |= numeric
    # FastDeploy 2.6's engine publishes its workers' capturer counters through the shared
    # slot cache (slots.STAT_FIELDS); those are the capturer's keys above.
    assert exported - reported == set(), "in the metric table but reported by no component"
    for key in exported:
        help_text = CAPTURE_COUNTERS.get(key) or CAPTURE_GAUGES[key]
        assert help_text and help_text[0].isupper() and not help_text.endswith("."), key


def test_every_family_carries_namespace_store_and_rank(manager):
    scraped = _scrape(manager.writer.metrics_registry)
    assert scraped, "nothing exported"
    for name, series in scraped.items():
        if not name.startswith("fd_rr_"):
            continue
        for labels in series:
            keys = dict(labels)
            assert all(keys.get(label) is not None for label in LABELS), (name, keys)
            assert keys["rank"] == "dp3-tp0" and keys["namespace"] == "met", (name, keys)


def test_metric_names_matches_what_is_exported(manager, tmp_path):
    """The catalogue the dashboard test relies on is what a live pipeline exposes."""
    from fd_routing_replay.store import open_store

    registry = CollectorRegistry()
    with open_store(f"local://{tmp_path}/store", "met", metrics_registry=registry) as store:
        store.exists("job_1:0:0")
    live = set(_scrape(manager.writer.metrics_registry)) | set(_scrape(registry))
    live = {name for name in live if name.startswith("fd_rr_") and not name.endswith("_created")}
    catalogue = metric_names()
    assert live - catalogue == set(), "exported but not catalogued"
    missing = {n for n in catalogue - live if not n.startswith("fd_rr_capture_")}
    # capture families appear only for keys the running component reports
    assert missing == set(), "catalogued but never exported"


def test_a_failing_source_is_left_out_of_the_scrape_not_fatal(caplog):
    registry = CollectorRegistry()

    def broken():
        raise RuntimeError("device gone")

    registry.register(SnapshotCollector(broken, render_capture, {"namespace": "n", "store": "s",
                                                                 "rank": ""}))
    registry.register(SnapshotCollector(lambda: {"steps": 4}, render_capture,
                                        {"namespace": "n", "store": "s", "rank": "ok"}))
    assert registry.get_sample_value("fd_rr_capture_steps_total",
                                     {"namespace": "n", "store": "s", "rank": "ok"}) == 4
    assert "device gone" in caplog.text


@pytest.mark.parametrize("addr", ["127.0.0.1", "::", "0.0.0.0", "localhost", "metrics-host.local"])
def test_metrics_addr_accepts_ip_literals_and_host_names(tmp_path, addr):
    assert _config(tmp_path, metrics_addr=addr).writer.metrics_addr == addr


def test_metrics_addr_is_checked_and_the_error_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"writer\.metrics_addr.*'999\.1\.1\.1'"):
        _config(tmp_path, metrics_addr="999.1.1.1")


def test_loopback_only_metrics_are_not_served_on_other_addresses(tmp_path):
    from fd_routing_replay.writer import RoutingWriter

    port = free_port()
    config = _config(tmp_path, metrics_port=port, metrics_addr="127.0.0.1")
    with RoutingWriter.from_config(config) as writer:
        host, bound = writer.metrics_address
        assert (host, bound) == ("127.0.0.1", port)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert b"fd_rr_writer_submitted_total" in response.read()


def test_a_busy_metrics_port_is_a_clear_error(tmp_path):
    import socket

    from fd_routing_replay.writer import RoutingWriter

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = _config(tmp_path, metrics_port=port, metrics_addr="127.0.0.1")
        with pytest.raises(ConfigError, match=rf"writer\.metrics_port: .*127\.0\.0\.1 port {port}"):
            RoutingWriter.from_config(config)


def test_a_reader_reports_its_reads(tmp_path, seed):
    """open_store instruments by default, so a trainer's RoutingReader is counted."""
    from fd_routing_replay.store import open_store

    registry = CollectorRegistry()
    ids = np.random.default_rng(seed).integers(0, 8, size=(2, 5, 2), dtype=np.uint8)
    with open_store(f"local://{tmp_path}/store", "rd", instrument=False) as bare:
        from fd_routing_replay.codec import encode_record

        bare.put("job_1:0:0", encode_record(RoutingRecord(rollout_id="job_1:0:0", ids=ids,
                                                          num_experts=8)))
    store = open_store(f"local://{tmp_path}/store", "rd", metrics_registry=registry)
    reader = RoutingReader(store)
    np.testing.assert_array_equal(reader.get("job_1:0:0").ids, ids)
    labels = {"namespace": "rd", "store": "local", "rank": ""}
    assert registry.get_sample_value("fd_rr_store_operation_seconds_count",
                                     {**labels, "op": "get"}) == 1
    assert registry.get_sample_value("fd_rr_store_read_bytes_total", labels) > ids.nbytes
