"""The conformance suite on the two embedded backends, plus local-store specifics."""

from __future__ import annotations

import os
import stat

import pytest

from fd_routing_replay.errors import TransientStoreError
from fd_routing_replay.store.local.tree import LocalStore
from fd_routing_replay.store.memory import MemoryStore
from tests.store_conformance import StoreConformance


class TestMemoryStore(StoreConformance):
    @pytest.fixture
    def make_store(self, request):
        name = f"t{id(request.node)}"
        return lambda namespace: MemoryStore(name=name, namespace=namespace)


class TestLocalStore(StoreConformance):
    @pytest.fixture
    def make_store(self, tmp_path):
        return lambda namespace: LocalStore(tmp_path, namespace)


@pytest.fixture
def local(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "root", "ns", fsync=True)


def test_layout_follows_key_components(local):
    local.put("exp_a_7:0:1", b"v")
    assert (local.base / "+exp" / "_a" / "_7" / ":0" / ":1" / "@").read_bytes() == b"v"


def test_delete_prunes_empty_buckets(local):
    local.put("exp_a_7:0:1", b"v")
    local.put("exp_b_7:0:1", b"v")
    local.delete(["exp_a_7:0:1"])
    assert not (local.base / "+exp" / "_a").exists()
    assert (local.base / "+exp" / "_b").exists()
    local.delete_prefix(["exp"])
    assert list(local.base.iterdir()) == []


def test_no_temp_files_left_after_puts(local):
    for index in range(20):
        local.put(f"t_{index}:0:0", os.urandom(100))
    leftovers = [p for p in local.base.rglob(".tmp-*")]
    assert leftovers == []
    assert local.list() == sorted(f"t_{i}:0:0" for i in range(20))


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_unwritable_directory_is_transient(local):  # pragma: no cover - non-root only
    local.put("ro_1:0:0", b"v")
    directory = local.base / "+ro"
    directory.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(TransientStoreError):
            local.put("ro_1:1:0", b"v")
    finally:
        directory.chmod(stat.S_IRWXU)


def test_store_outside_namespace_is_untouched(tmp_path):
    outsider = tmp_path / "other.txt"
    outsider.write_text("keep")
    store = LocalStore(tmp_path, "ns")
    store.put("k_1:0:0", b"v")
    assert store.clear() == 1
    assert outsider.read_text() == "keep"


def test_root_replaced_by_a_file_is_transient(tmp_path):
    # Root cannot be denied a directory by chmod, so break the path itself instead.
    store = LocalStore(tmp_path / "root", "ns")
    (tmp_path / "root").write_bytes(b"not a directory")
    with pytest.raises(TransientStoreError, match="cannot write"):
        store.put("k_1:0:0", b"v")
    (tmp_path / "root").unlink()
    store.put("k_1:0:0", b"v")
    assert store.get("k_1:0:0") == b"v"


def test_namespaces_are_listed_where_the_store_can(tmp_path):
    from fd_routing_replay.store.local.fastdeploy import FastDeployLocalStore
    from fd_routing_replay.store.local.tree import LocalStore
    from fd_routing_replay.store.memory import MemoryStore

    for namespace in ("alpha", "beta"):
        LocalStore(tmp_path / "tree", namespace).put("exp_0:0:0", b"x")
    (tmp_path / "tree" / ".fdrr").mkdir(exist_ok=True)              # never a namespace
    assert LocalStore(tmp_path / "tree", "gamma").list_namespaces() == ["alpha", "beta"]
    assert LocalStore(tmp_path / "missing", "alpha").list_namespaces() == []
    name = f"ns-{tmp_path.name}"
    MemoryStore(name, "one").put("exp_0:0:0", b"x")
    MemoryStore(name, "two")                                       # empty: not listed
    assert MemoryStore(name, "three").list_namespaces() == ["one"]
    fd = FastDeployLocalStore(tmp_path / "fd", "claimed")
    assert fd.list_namespaces() == []
    assert all(s.supports_list_namespaces() for s in (fd, MemoryStore(name, "one")))
