"""Per-rank journal and dead-letter directories: placeholders, derived defaults, no cwd."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from fd_routing_replay.config import WriterConfig, load_config
from fd_routing_replay.core.paths import RankIdentity, state_dir
from fd_routing_replay.errors import ConfigError
from fd_routing_replay.store.local import LocalStore
from fd_routing_replay.writer import RoutingWriter
from fd_routing_replay.writer.journal import resolve_writer_directories
from tests.writer.conftest import make_record

NAMESPACE = "dirs"


@pytest.fixture
def empty_cwd(tmp_path, monkeypatch) -> Path:
    """Run in an empty working directory; a test asserts it is still empty at the end."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


@pytest.fixture
def writers():
    opened: list[RoutingWriter] = []
    yield opened
    for writer in opened:
        writer.close(timeout=10)


def local_store(root: Path) -> dict:
    return {"type": "local", "namespace": NAMESPACE, "local": {"root": str(root)}}


def open_writer(writers, store, identity=None, **config) -> RoutingWriter:
    writer = RoutingWriter(store, {"mode": "thread", "capacity_bytes": 8 << 20, **config}, identity=identity)
    writers.append(writer)
    return writer


def test_two_ranks_on_one_store_root_get_their_own_directories(tmp_path, empty_cwd, writers,
                                                               monkeypatch, np_rng):
    from fd_routing_replay.writer import client as writer_client

    monkeypatch.setattr(writer_client, "_LOCK_WAIT_S", 0.0)  # a collision raises at once
    root = tmp_path / "store"
    first = open_writer(writers, local_store(root), RankIdentity(dp_rank=0, tp_rank=0, device_id=0))
    second = open_writer(writers, local_store(root), RankIdentity(dp_rank=1, tp_rank=0, device_id=1))
    assert first.journal.directory == root / ".fdrr" / NAMESPACE / "journal" / "dp0-tp0-dev0"
    assert second.journal.directory == root / ".fdrr" / NAMESPACE / "journal" / "dp1-tp0-dev1"
    assert second.dead_letters.directory == root / ".fdrr" / NAMESPACE / "dead_letter" / "dp1-tp0-dev1"
    for index, writer in enumerate((first, second)):
        key = f"rank{index}:0:0"
        assert writer.submit_put(key, make_record(np_rng, key))
        assert writer.flush(timeout=60)
    assert LocalStore(root, NAMESPACE).list() == ["rank0:0:0", "rank1:0:0"]
    assert list(empty_cwd.iterdir()) == []


def test_the_same_rank_twice_is_refused_clearly(tmp_path, empty_cwd, writers, monkeypatch):
    from fd_routing_replay.writer import client as writer_client

    monkeypatch.setattr(writer_client, "_LOCK_WAIT_S", 0.05)
    identity = RankIdentity(dp_rank=3, tp_rank=0, device_id=5)
    open_writer(writers, local_store(tmp_path / "store"), identity)
    with pytest.raises(ConfigError) as info:
        open_writer(writers, local_store(tmp_path / "store"), identity)
    message = str(info.value)
    assert "writer.journal_dir" in message and "in use by another routing writer" in message
    assert "dp3-tp0-dev5" in message and "rank identity" in message
    assert list(empty_cwd.iterdir()) == []


def test_placeholders_expand_once_at_start(tmp_path, empty_cwd, writers):
    identity = RankIdentity(dp_rank=2, tp_rank=1, device_id="GPU-1a2b", pid=4242, host="node-7")
    template = str(tmp_path / "w" / "{namespace}" / "{host}-dp{dp_rank}-tp{tp_rank}-{device_id}-{pid}")
    writer = open_writer(writers, local_store(tmp_path / "store"), identity,
                         journal_dir=template + "/j", dead_letter_dir=template + "/d")
    expected = tmp_path / "w" / NAMESPACE / "node-7-dp2-tp1-GPU-1a2b-4242"
    assert writer.journal.directory == expected / "j"
    assert writer.dead_letters.directory == expected / "d"
    assert writer.stats()["journal_dir"] == str(expected / "j")
    assert list(empty_cwd.iterdir()) == []


@pytest.mark.parametrize(("text", "problem"), [
    ("/x/{rank}", "unknown placeholder '{rank}'"),
    ("/x/{}", "unknown placeholder '{}'"),
    ("/x/{dp_rank:03d}", "unknown placeholder '{dp_rank:03d}'"),
    ("/x/{dp_rank", "unmatched '{'"),
    ("/x/dp_rank}", "unmatched '}'"),
    ("/x/{{dp_rank}}", "unmatched '{'"),
])
@pytest.mark.parametrize("key", ["journal_dir", "dead_letter_dir"])
def test_bad_placeholders_are_refused_at_load_naming_the_key(key, text, problem):
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"writer": {key: text}}, env={})
    message = str(info.value)
    assert f"writer.{key}" in message and problem in message and repr(text) in message
    with pytest.raises(ConfigError, match=f"writer.{key}"):
        load_config(env={f"FD_RR_WRITER__{key.upper()}": text})


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("host", "a/b", "not a safe path component"),
    ("host", "..", "not a safe path component"),
    ("host", "", "not a safe path component"),
    ("host", ".hidden", "not a safe path component"),
    ("device_id", "gpu 0", "not a safe path component"),
    ("device_id", -1, "must be a str or a non-negative int"),
    ("dp_rank", -1, "must be a non-negative int"),
    ("tp_rank", "0", "must be a non-negative int"),
    ("pid", True, "must be a non-negative int"),
])
def test_unsafe_expansion_values_are_refused(field, value, problem):
    with pytest.raises(ConfigError) as info:
        RankIdentity(**{field: value})
    assert field in str(info.value) and problem in str(info.value) and repr(value) in str(info.value)


def test_a_relative_path_is_resolved_once_at_load_and_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("INFO", logger="fd_routing_replay.config"):
        config = load_config(overrides={"writer": {"journal_dir": "spill/{dp_rank}"}}, env={})
    assert config.writer.journal_dir == str(tmp_path / "spill" / "{dp_rank}")
    assert any(str(tmp_path / "spill") in r.getMessage() for r in caplog.records)
    monkeypatch.chdir("/")
    assert WriterConfig(journal_dir=config.writer.journal_dir).journal_dir == config.writer.journal_dir


def test_other_stores_use_the_state_directory(tmp_path, empty_cwd, monkeypatch):
    writer_config = WriterConfig()
    memory = load_config(overrides={"store": {"type": "memory", "namespace": "ns1"}}, env={}).store
    identity = RankIdentity(dp_rank=1, tp_rank=0, device_id=3)
    env = {"FD_RR_STATE_DIR": str(tmp_path / "state"), "XDG_STATE_HOME": str(tmp_path / "xdg")}
    dirs = resolve_writer_directories(memory, writer_config, identity, env)
    assert dirs.journal == tmp_path / "state" / "ns1" / "journal" / "dp1-tp0-dev3"
    assert dirs.dead_letter == tmp_path / "state" / "ns1" / "dead_letter" / "dp1-tp0-dev3"
    del env["FD_RR_STATE_DIR"]
    assert state_dir(env) == tmp_path / "xdg" / "fd-routing-replay"
    assert state_dir({"XDG_STATE_HOME": "relative"}) == Path.home() / ".local/state/fd-routing-replay"
    monkeypatch.setenv("FD_RR_STATE_DIR", str(tmp_path / "state"))
    load_config()  # FD_RR_STATE_DIR is not mistaken for an unknown config key
    assert list(empty_cwd.iterdir()) == []


def test_a_memory_store_writer_creates_nothing_in_cwd(tmp_path, empty_cwd, writers, monkeypatch,
                                                      np_rng):
    monkeypatch.setenv("FD_RR_STATE_DIR", str(tmp_path / "state"))
    writer = open_writer(writers, {"type": "memory", "namespace": "nocwd"},
                         RankIdentity(device_id=0))
    assert writer.submit_put("m:0:0", make_record(np_rng, "m:0:0"))
    assert writer.flush(timeout=60)
    assert writer.journal.directory.is_relative_to(tmp_path / "state")
    assert list(empty_cwd.iterdir()) == []


def test_identity_fields_default_from_the_environment(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "node-3.cluster.local")
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "FLAGS_selected_gpus": "2"}
    rank = RankIdentity(dp_rank=1).resolved(env)
    assert (rank.dp_rank, rank.tp_rank, rank.device_id) == (1, 0, 6)  # physical id, as FastDeploy
    assert rank.pid == os.getpid() and rank.host == "node-3"
    monkeypatch.setattr(socket, "gethostname", lambda: "my host!")
    assert RankIdentity().resolved({}).host == "my_host_"
    assert RankIdentity().resolved({"FLAGS_selected_gpus": "3"}).device_id == 3
    assert RankIdentity().resolved({"CUDA_VISIBLE_DEVICES": "5"}).device_id == 5
    assert RankIdentity().resolved({}).device_id == 0
    uuid = RankIdentity().resolved({"CUDA_VISIBLE_DEVICES": "MIG-GPU-ab12/1/0"}).device_id
    assert uuid == "MIG-GPU-ab12_1_0"
    assert RankIdentity(device_id=9).resolved(env).device_id == 9  # given beats the environment


def test_local_store_listing_deleting_and_clearing_never_see_writer_state(tmp_path, empty_cwd,
                                                                         writers, np_rng):
    root = tmp_path / "store"
    writer = open_writer(writers, local_store(root), RankIdentity(device_id=0))
    assert writer.submit_put("keep:0:0", make_record(np_rng, "keep:0:0"))
    assert writer.flush(timeout=60)
    journal = writer.journal.directory
    (journal / "00000000000000000001.0.json").write_text("{}")  # as if a record were spilled
    store = LocalStore(root, NAMESPACE)
    assert store.list() == ["keep:0:0"]
    assert store.delete_prefix(["keep"]) == {"keep": 1}
    assert store.list() == []
    store.put("again:0:0", b"x")
    assert store.clear() == 1
    assert journal.is_dir() and (journal / "00000000000000000001.0.json").exists()
    assert (journal / ".lock").exists()
    # Other namespaces on the same root are siblings of .fdrr, never inside it.
    other = LocalStore(root, "other")
    other.put("x:0:0", b"x")
    assert other.list() == ["x:0:0"] and other.clear() == 1
    assert journal.is_dir()
    assert list(empty_cwd.iterdir()) == []
