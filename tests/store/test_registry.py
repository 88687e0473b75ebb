"""open_store, the registry, entry points and the instrumented wrapper."""

from __future__ import annotations

import inspect

import pytest

from fd_routing_replay.errors import ConfigError, UnknownStoreType
from fd_routing_replay.store import (
    RoutingStore,
    known_store_types,
    open_store,
    register_store,
    store_config_from,
)
from fd_routing_replay.store.base import RoutingStore as BaseStore
from fd_routing_replay.store.instrumented import InstrumentedStore
from fd_routing_replay.store.local import LocalStore
from fd_routing_replay.store.memory import MemoryStore
from fd_routing_replay.store.metrics import OPERATIONS


def test_open_by_url_type_dict_and_config(tmp_path):
    from fd_routing_replay.config import load_config

    by_url = open_store(f"local://{tmp_path}/a", namespace="n1", instrument=False)
    assert isinstance(by_url, LocalStore) and by_url.root == tmp_path / "a"
    assert by_url.namespace == "n1"
    assert isinstance(open_store("memory", instrument=False), MemoryStore)
    assert isinstance(open_store("memory://shared", instrument=False), MemoryStore)
    by_dict = open_store({"type": "local", "local": {"root": str(tmp_path / "b")}})
    assert by_dict.root == tmp_path / "b"
    config = load_config(overrides={"store": {"local": {"root": str(tmp_path / "c")}}}, env={})
    assert open_store(config).root == tmp_path / "c"
    assert open_store(config.store).root == tmp_path / "c"


def test_unknown_type_names_the_known_ones():
    with pytest.raises((UnknownStoreType, ConfigError)) as info:
        open_store("nosuch://x")
    message = str(info.value)
    assert "nosuch" in message and "local" in message and "memory" in message


def test_url_without_scheme_is_a_clear_error():
    with pytest.raises((ConfigError, UnknownStoreType)):
        open_store({"url": "/just/a/path"})


def test_open_store_rejects_other_argument_types():
    with pytest.raises(TypeError, match="open_store"):
        open_store(42)


def test_registered_factory_is_used():
    made = []

    def factory(store_config):
        made.append(store_config.namespace)
        return MemoryStore("custom", store_config.namespace)

    register_store("custom-test", factory)
    store = open_store({"type": "custom-test", "namespace": "abc"})
    assert isinstance(store.inner, MemoryStore) and made == ["abc"]
    assert open_store("custom-test://x", namespace="xyz").namespace == "xyz"
    assert made == ["abc", "xyz"]
    assert "custom-test" in known_store_types()


def test_builtins_are_declared_by_their_modules_with_their_aliases(tmp_path):
    from fd_routing_replay.store.backend import backends
    from fd_routing_replay.store.registry import resolve_factory, store_type_of

    declared = backends()
    assert {"memory", "local", "redis", "p2pstore", "mooncake"} <= set(declared)
    assert {"file", "rediss", "redis+cluster"} <= set(known_store_types())
    assert resolve_factory("rediss") is declared["redis"].factory
    assert store_type_of(store_config_from("redis+cluster://h:1/0")) == "redis"
    assert isinstance(open_store(f"file://{tmp_path}", instrument=False), LocalStore)


def test_register_store_replaces_a_declared_backend_in_this_process():
    from fd_routing_replay.store import registry

    made = []

    def factory(store_config):
        made.append(store_config.namespace)
        return MemoryStore("replaced", store_config.namespace)

    register_store("memory", factory)
    try:
        assert open_store("memory://x", "rep", instrument=False).name == "replaced"
        assert registry.backend_of(store_config_from("memory://x")) is None
    finally:
        assert registry.unregister_store("memory")
    assert not registry.unregister_store("memory")
    assert open_store("memory://x", "rep", instrument=False).name == "x" and made == ["rep"]


def test_instrumented_wrapper_covers_the_whole_interface():
    public = {name for name, member in inspect.getmembers(BaseStore)
              if not name.startswith("_") and callable(member)}
    overridden = {name for name in public if name in InstrumentedStore.__dict__}
    assert public - overridden == set(), "InstrumentedStore must wrap every store method"
    timed = {"put", "put_parts", "get", "exists", "delete", "delete_prefix", "list", "clear",
             "read_ranges", "get_many"}
    assert set(OPERATIONS) == timed


def test_read_ranges_is_timed_where_the_backend_has_it(tmp_path):
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    local = open_store(f"local://{tmp_path}", "rng", metrics_registry=registry)
    local.put("r_1:0:0", b"0123456789")
    assert local.read_ranges("r_1:0:0", [(2, 3), (8, 5)]) == [b"234", b"89"]
    assert local.read_ranges("r_1:9:0", [(0, 1)]) is None
    labels = {"namespace": "rng", "store": "local", "rank": ""}
    assert registry.get_sample_value("fd_rr_store_operation_seconds_count",
                                     {**labels, "op": "read_ranges"}) == 2
    assert registry.get_sample_value("fd_rr_store_read_bytes_total", labels) == 5
    memory = open_store("memory://rng", "rng", metrics_registry=registry)
    assert getattr(memory, "read_ranges", None) is None      # a capability, not faked


def test_instrumented_wrapper_counts_calls_errors_and_bytes():
    store = InstrumentedStore(MemoryStore("instr", "ns"))
    assert isinstance(store, RoutingStore)
    store.put("a_1:0:0", b"12345")
    store.put_parts("a_1:1:0", [b"12", b"345"])
    assert bytes(store.get("a_1:0:0")) == b"12345"
    assert store.get("a_1:9:0") is None
    assert store.delete_prefix(["a_1"]) == {"a_1": 2}
    with pytest.raises(ValueError):
        store.put("bad key", b"")
    snap = store.metrics.snapshot()
    assert snap["calls"]["put"] == 2 and snap["errors"]["put"] == 1
    assert snap["calls"]["get"] == 2 and snap["bytes_read"] == 5
    assert snap["bytes_written"] == 10
    p50, p99 = store.metrics.latency_quantiles("put")
    assert 0 <= p50 <= p99


def test_instrumented_wrapper_exports_prometheus():
    from prometheus_client import CollectorRegistry, generate_latest

    from fd_routing_replay.store.metrics import StoreMetrics

    registry = CollectorRegistry()
    store = open_store("memory://prom", "ns", metrics_registry=registry, rank="r7")
    assert isinstance(store, InstrumentedStore)
    store.put("p_1:0:0", b"xyz")
    store.put("p_1:1:0", b"uvwxyz")
    with pytest.raises(ValueError):
        store.put("bad key", b"")
    assert bytes(store.get("p_1:0:0")) == b"xyz"
    labels = {"namespace": "ns", "store": "memory", "rank": "r7"}

    def sample(name, **extra):
        return registry.get_sample_value(name, {**labels, **extra})

    assert sample("fd_rr_store_operation_seconds_count", op="put") == 3
    assert sample("fd_rr_store_errors_total", op="put") == 1
    assert sample("fd_rr_store_written_bytes_total") == 9
    assert sample("fd_rr_store_read_bytes_total") == 3
    # buckets are cumulative and end at the call count
    bounds = [b for b in StoreMetrics().snapshot()["buckets"]["put"]]
    assert len(bounds) > 0 and sample("fd_rr_store_operation_seconds_bucket", op="put", le="+Inf") == 3
    # a second store of the same namespace and backend adds to the same counters
    again = open_store("memory://prom", "ns", metrics_registry=registry, rank="r7")
    again.exists("p_1:0:0")
    store.close()
    assert sample("fd_rr_store_operation_seconds_count", op="exists") == 1
    assert sample("fd_rr_store_operation_seconds_count", op="put") == 3
    assert "fd_rr_store_operation_seconds" in generate_latest(registry).decode()


def test_open_store_opt_out_returns_the_bare_backend():
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    assert isinstance(open_store("memory://bare", "ns", instrument=False,
                                 metrics_registry=registry), MemoryStore)
    assert isinstance(open_store({"url": "memory://bare", "metrics": False}, "ns",
                                 metrics_registry=registry), MemoryStore)
    assert registry.get_sample_value("fd_rr_store_written_bytes_total",
                                     {"namespace": "ns", "store": "memory", "rank": ""}) is None
