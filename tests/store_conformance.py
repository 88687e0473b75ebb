"""The conformance suite every store backend must pass.

A backend's test module subclasses :class:`StoreConformance` and provides the fixture
``make_store(namespace) -> RoutingStore`` opening stores on ONE shared backing (same
directory / server), so namespace isolation can be checked.
"""

from __future__ import annotations

import random
import threading

import pytest

from fd_routing_replay.errors import InvalidRolloutId
from fd_routing_replay.keys import prefix_matches

BAD_KEYS = ["", "a/b:0:0", "a\\b:0:0", "a..b:0:0", "..", "a b:0:0", "a\tb:0:0",
            "a\x00b:0:0", "a\x7fb:0:0", "x" * 513, "é" * 300]


def random_value(rng: random.Random, size: int | None = None) -> bytes:
    size = rng.randint(0, 4096) if size is None else size
    return rng.randbytes(size)


def random_keys(rng: random.Random, count: int) -> list[str]:
    """Keys shaped like real rollouts, dense in shared prefixes (x:1 vs x:10)."""
    keys = set()
    while len(keys) < count:
        exp = rng.choice(["exp", "exp_a", "exp_ab", "e1"])
        data = rng.choice(["1", "10", "11", "100", "2"])
        key = f"{exp}_{data}:{rng.randint(0, 12)}:{rng.randint(0, 2)}:{rng.randint(0, 1)}"
        if rng.random() < 0.2:
            key += f"_{rng.randint(0, 11)}"
        keys.add(key)
    return sorted(keys)


class StoreConformance:
    """Behaviour every RoutingStore must have; subclasses provide ``make_store``."""

    @pytest.fixture
    def store(self, make_store):
        return make_store("conformance")

    def test_put_get_round_trip(self, store, rng):
        values = {k: random_value(rng) for k in random_keys(rng, 30)}
        values["big_1:0:0"] = random_value(rng, 3 * 1024 * 1024 + 17)
        values["empty_1:0:0"] = b""
        for key, value in values.items():
            store.put(key, value)
        for key, value in values.items():
            got = store.get(key)
            assert got is not None, key
            assert bytes(got) == value, key
            assert store.exists(key)

    def test_put_accepts_every_buffer_type(self, store, rng):
        payload = random_value(rng, 1000)
        for index, value in enumerate((payload, bytearray(payload), memoryview(payload))):
            store.put(f"buf_{index}:0:0", value)
            assert bytes(store.get(f"buf_{index}:0:0")) == payload

    def test_put_parts_equals_joined_put(self, store, rng):
        parts = [random_value(rng, n) for n in (64, 0, 5000, 3)]
        store.put_parts("parts_1:0:0", [parts[0], memoryview(parts[1]), *parts[2:]])
        assert bytes(store.get("parts_1:0:0")) == b"".join(parts)

    def test_overwrite_replaces_value(self, store, rng):
        first, second = random_value(rng, 100), random_value(rng, 10)
        store.put("ow_1:0:0", first)
        store.put("ow_1:0:0", second)
        assert bytes(store.get("ow_1:0:0")) == second
        assert store.list("ow_1") == ["ow_1:0:0"]

    def test_missing_key(self, store):
        assert store.get("missing_1:0:0") is None
        assert not store.exists("missing_1:0:0")

    def test_delete_is_idempotent_and_counts(self, store):
        store.put("del_1:0:0", b"a")
        store.put("del_1:1:0", b"b")
        assert store.delete(["del_1:0:0", "del_1:1:0", "del_1:2:0"]) == 2
        assert store.delete(["del_1:0:0"]) == 0
        assert store.get("del_1:0:0") is None
        assert store.list("del_1") == []

    def test_prefix_delete_is_boundary_safe(self, store):
        keys = ["x:1", "x:1:0:0", "x:1:1:0", "x:1_3", "x:10:0:0", "x:100:0:0",
                "x:2:0:0", "x_1:0:0", "y:1:0:0"]
        for key in keys:
            store.put(key, key.encode())
        assert store.delete_prefix(["x:1"]) == {"x:1": 4}
        assert store.list() == sorted(["x:10:0:0", "x:100:0:0", "x:2:0:0", "x_1:0:0", "y:1:0:0"])
        assert store.delete_prefix(["x:10:", "x_"]) == {"x:10:": 1, "x_": 1}
        assert store.list() == sorted(["x:100:0:0", "x:2:0:0", "y:1:0:0"])
        assert store.delete_prefix("nothing") == {"nothing": 0}

    def test_prefix_delete_matches_reference_on_random_keys(self, store, rng):
        keys = random_keys(rng, 120)
        for key in keys:
            store.put(key, b"v")
        prefixes = sorted({k[: rng.randint(1, len(k))] for k in rng.sample(keys, 12)})
        prefixes = [p for p in prefixes if not p.endswith(("..", "."))]
        remaining = set(keys)
        for prefix in prefixes:
            expected = {k for k in remaining if prefix_matches(k, prefix)}
            assert store.list(prefix) == sorted(expected), prefix
            assert store.delete_prefix([prefix]) == {prefix: len(expected)}, prefix
            remaining -= expected
            assert store.list() == sorted(remaining)

    def test_list_is_sorted_and_filtered(self, store, rng):
        keys = random_keys(rng, 40)
        for key in reversed(keys):
            store.put(key, b"v")
        assert store.list() == keys
        probe = keys[len(keys) // 2].split(":")[0]
        assert store.list(probe) == [k for k in keys if prefix_matches(k, probe)]

    def test_empty_prefix_is_rejected(self, store):
        store.put("keep_1:0:0", b"v")
        with pytest.raises(InvalidRolloutId):
            store.delete_prefix([""])
        assert store.exists("keep_1:0:0")

    def test_namespaces_are_isolated(self, make_store):
        first, second = make_store("ns_one"), make_store("ns_two")
        first.clear()
        second.clear()
        first.put("shared_1:0:0", b"one")
        second.put("shared_1:0:0", b"two")
        second.put("other_1:0:0", b"two")
        assert first.delete_prefix(["shared_1"]) == {"shared_1": 1}
        assert bytes(second.get("shared_1:0:0")) == b"two"
        first.put("shared_1:0:0", b"one")
        assert first.clear() == 1
        assert second.list() == ["other_1:0:0", "shared_1:0:0"]
        assert second.clear() == 2

    def test_concurrent_writers_to_different_keys(self, store, rng):
        payloads = {f"conc_{t}:{i}:0": random_value(rng, 2048) for t in range(4)
                    for i in range(25)}
        errors: list[BaseException] = []

        def write(thread: int) -> None:
            try:
                for key, value in payloads.items():
                    if key.startswith(f"conc_{thread}:"):
                        store.put(key, value)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=write, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        for key, value in payloads.items():
            assert bytes(store.get(key)) == value

    @pytest.mark.parametrize("bad", BAD_KEYS, ids=repr)
    def test_bad_keys_are_rejected(self, store, bad):
        for call in (lambda: store.put(bad, b"v"), lambda: store.get(bad),
                     lambda: store.exists(bad), lambda: store.delete([bad]),
                     lambda: store.delete_prefix([bad])):
            with pytest.raises(InvalidRolloutId):
                call()

    def test_long_and_unicode_keys(self, store):
        long_base = "a" * 300
        keys = [f"{long_base}:0:0", f"{long_base}:1:0", f"{'a' * 299}:0:0",
                "数据_7:0:0", "ünï_cødé:3:1"]
        for key in keys:
            store.put(key, key.encode())
        for key in keys:
            assert bytes(store.get(key)) == key.encode()
        assert store.list(long_base) == [f"{long_base}:0:0", f"{long_base}:1:0"]
        assert store.delete_prefix([long_base]) == {long_base: 2}
        assert store.get(f"{'a' * 299}:0:0") == f"{'a' * 299}:0:0".encode()

    def test_close_is_idempotent(self, make_store):
        store = make_store("closing")
        store.close()
        store.close()

    def test_declared_capabilities_hold(self, store):
        """The backend's declaration (``BACKEND`` in its module) claims what its stores do:
        ``indexed`` exactly when the store is an IndexedStore, ``cross_process`` exactly
        when it says so, and the read capabilities only where the methods exist."""
        from fd_routing_replay.store.backend import Capability, backend_named
        from fd_routing_replay.store.indexed import as_indexed

        backend = backend_named(store.scheme)
        assert backend is not None, f"{type(store).__name__}.scheme {store.scheme!r} names no " \
                                    "declared backend"
        declared = backend.capabilities
        assert (Capability.INDEXED in declared) == (as_indexed(store) is not None)
        assert (Capability.CROSS_PROCESS in declared) == store.supports_cross_process()
        if Capability.SLICED_READS in declared:
            assert callable(getattr(store, "read_ranges", None))
        if Capability.BATCH_READS in declared:
            assert callable(getattr(store, "get_many", None))
