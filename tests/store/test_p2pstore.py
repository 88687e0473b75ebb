"""The P2PStore backend on the real client: TCP transport, Redis on loopback, and a second
process as writer (provider) or reader."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fd_routing_replay.codec import decode_record
from fd_routing_replay.errors import ConfigError, ProviderUnavailableError, TransientStoreError
from fd_routing_replay.store import open_store
from fd_routing_replay.store.p2pstore.keys import decode_component, encode_component, stored_key
from fd_routing_replay.store.p2pstore.store import FRAME
from fdrr_dev.testing.process import free_port
from tests.store.p2p_peer import Peer, record_ids
from tests.store_conformance import StoreConformance

pytestmark = [
    pytest.mark.p2pstore, pytest.mark.redis,
    # p2pstore 0.1.15 calls redis-py's deprecated setex; not ours to fix.
    pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning"),
]

MISSING = [name for name in ("p2pstore", "mooncake", "redis")
           if importlib.util.find_spec(name) is None]
needs_client = pytest.mark.skipif(
    bool(MISSING), reason=f"not installed: {', '.join(MISSING)} (pip install "
                          "'fd-routing-replay[p2pstore]'; needs Debian libibverbs1)")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def p2p_log_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("p2pstore-logs"))


def p2p_config(url: str, namespace: str, log_dir: str, **section) -> dict:
    return {"type": "p2pstore", "namespace": namespace,
            "p2pstore": {"metadata_server": url, "protocol": "tcp", "log_dir": log_dir,
                         **section}}


@pytest.fixture
def open_p2p(redis_server_clean, p2p_log_dir):
    """open_p2p(namespace, **section) -> store on the session Redis; all closed after."""
    if MISSING:
        pytest.skip(f"not installed: {', '.join(MISSING)}")
    stores = []

    def _open(namespace: str = "ns", **section):
        store = open_store(p2p_config(redis_server_clean.url, namespace, p2p_log_dir, **section))
        stores.append(store)
        return store

    yield _open
    for store in stores:
        store.close()


@pytest.fixture
def peers():
    started: list[Peer] = []
    yield started
    for peer in started:
        peer.stop()


class TestP2PStoreConformance(StoreConformance):
    @pytest.fixture
    def make_store(self, open_p2p):
        return open_p2p


# -- keys -------------------------------------------------------------------------------------

def test_key_encoding_is_injective_and_never_holds_88(rng):
    alphabet = "8%2538:_a"
    seen = {}
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        encoded = encode_component(text)
        assert "88" not in encoded and decode_component(encoded) == text
        assert seen.setdefault(encoded, text) == text
    assert stored_key("ns8", "exp_88888888:0:0") == "ns%38/exp_%38%38%38%38%38%38%38%38:0:0"


@needs_client
def test_88888888_ids_are_stored(open_p2p, redis_server_clean):
    store = open_p2p("ns88888888")
    keys = ["exp_88888888:0:0", "88888888_1:0:0", "a_1:88888888:0", "x%38_1:0:0"]
    for key in keys:
        store.put(key, key.encode() * 3)
    for key in keys:
        assert bytes(store.get(key)) == key.encode() * 3
    assert store.list() == sorted(keys)
    raw = [k.decode() for k in redis_server_clean.command("KEYS", "p2p:files:*")]
    assert len(raw) == len(keys) + 1 and not any("88888888" in k for k in raw)
    assert store.delete_prefix(["exp"]) == {"exp": 1}
    assert store.clear() == 3


# -- logs and the working directory --------------------------------------------------------

SCRIPT = """
import sys
from fd_routing_replay.store import open_store
store = open_store({{"type": "p2pstore", "namespace": "cwd",
                    "p2pstore": {{"metadata_server": "{url}", "protocol": "tcp"{log_dir}}}}})
store.put("k_1:0:0", b"v" * 100)
assert bytes(store.get("k_1:0:0")) == b"v" * 100
store.delete(["k_1:0:0"])
store.close()
print("done")
"""


@needs_client
@pytest.mark.parametrize("configured", [True, False], ids=["log_dir", "default"])
def test_nothing_written_to_cwd_and_stdout_clean(redis_server_clean, tmp_path, configured):
    cwd, tmp, logs = tmp_path / "cwd", tmp_path / "tmp", tmp_path / "logs"
    cwd.mkdir()
    tmp.mkdir()
    log_dir = f', "log_dir": "{logs}"' if configured else ""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("P2P", "POD_"))}
    env.update(PYTHONPATH=ROOT, TMPDIR=str(tmp))
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(url=redis_server_clean.url,
                                                                 log_dir=log_dir)],
                            cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "done\n"  # P2PStore's own prints went to our log, not stdout
    assert list(cwd.iterdir()) == []
    expected = logs if configured else tmp / f"fd-routing-replay-{os.getuid()}" / "p2pstore-logs"
    written = list((expected / "p2pstorelog").rglob("*.log"))
    assert written, f"no P2PStore log under {expected}"


# -- cross-process: writer in another process, reader here -----------------------------------

@needs_client
def test_reader_in_another_process_reads_what_the_writer_put(open_p2p, redis_server_clean,
                                                              p2p_log_dir, peers, seed):
    config = p2p_config(redis_server_clean.url, "xproc", p2p_log_dir)
    writer = Peer(config)
    peers.append(writer)
    keys = [f"exp_{i}:{g}:0:0" for i in (1, 10) for g in range(3)]
    shape, experts = [6, 33, 4], 64
    assert writer.call("put_records", seed=seed, keys=keys, shape=shape, experts=experts) == 6
    held = writer.call("provider_bytes")
    reader = open_p2p("xproc")
    assert reader.list() == sorted(keys) and reader.provider_bytes() == 0
    for index, key in enumerate(keys):
        record = decode_record(reader.get(key))
        assert record.rollout_id == key
        assert (record.ids == record_ids(seed, index, shape, experts)).all()
    # The reader deletes; the provider frees the memory when the pub/sub event arrives.
    assert reader.delete_prefix(["exp_1"]) == {"exp_1": 3}
    assert reader.list() == sorted(k for k in keys if k.startswith("exp_10"))
    deadline = time.monotonic() + 20
    while writer.call("provider_bytes") > held / 2 + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert writer.call("provider_bytes") * 2 == held
    # And the writer reads back what is left through its own transport.
    value = reader.get("exp_10:0:0:0")
    assert writer.call("get", key="exp_10:0:0:0") == hashlib.sha256(value).hexdigest()


@needs_client
def test_killed_provider_gives_a_clear_error_fast(open_p2p, redis_server_clean, p2p_log_dir,
                                                  peers):
    writer = Peer(p2p_config(redis_server_clean.url, "gone", p2p_log_dir))
    peers.append(writer)
    writer.call("put_records", seed=1, keys=["r_1:0:0"], shape=[2, 3, 2], experts=8)
    warm = open_p2p("gone")
    assert warm.get("r_1:0:0") is not None  # this reader now trusts the provider for a while
    provider = json.loads(redis_server_clean.command("GET", "p2p:files:gone/r_1:0:0"))["host"]
    os.kill(writer.pid, signal.SIGKILL)
    writer.process.wait(10)
    fresh = open_p2p("gone")  # e.g. the trainer, after the engine crashed
    start = time.monotonic()
    with pytest.raises(ProviderUnavailableError) as caught:
        fresh.get("r_1:0:0")
    elapsed = time.monotonic() - start
    assert isinstance(caught.value, TransientStoreError)
    assert caught.value.provider == provider and provider in str(caught.value)
    assert "does not answer" in str(caught.value) and "'r_1:0:0'" in str(caught.value)
    print(f"provider gone: error after {elapsed * 1000:.1f} ms")  # P2PStore alone: ~3.5 s
    # Within the trust interval P2PStore's own retries run first; still an error, not None.
    warm.probe_interval_s = 3600.0
    with pytest.raises(ProviderUnavailableError, match="does not answer"):
        warm.get("r_1:0:0")
    assert fresh.exists("r_1:0:0") and fresh.list() == ["r_1:0:0"]
    assert fresh.delete(["r_1:0:0"]) == 1 and fresh.list() == []


@needs_client
def test_closed_provider_takes_its_records_along(open_p2p, redis_server_clean, p2p_log_dir,
                                                 peers):
    writer = Peer(p2p_config(redis_server_clean.url, "closing", p2p_log_dir))
    peers.append(writer)
    writer.call("put_records", seed=2, keys=["c_1:0:0", "c_2:0:0"], shape=[1, 2, 2], experts=4)
    reader = open_p2p("closing")
    reader.put("mine_1:0:0", b"reader's own")
    assert reader.list() == ["c_1:0:0", "c_2:0:0", "mine_1:0:0"]
    writer.call("close")
    assert reader.get("c_1:0:0") is None
    assert reader.list() == ["mine_1:0:0"]
    assert bytes(reader.get("mine_1:0:0")) == b"reader's own"


@needs_client
def test_unregistered_or_restarted_provider_is_named(open_p2p, redis_server_clean):
    store = open_p2p("unreg")
    store.put("u_1:0:0", b"x")
    provider = json.loads(redis_server_clean.command("GET", "p2p:files:unreg/u_1:0:0"))["host"]
    registration = redis_server_clean.command("GET", f"p2p:providers:{provider}")
    # Another process now serves this address (a restart on a fixed port).
    redis_server_clean.command("SET", f"p2p:providers:{provider}",
                               json.dumps({"state": "active", "client_id": "0therone"}))
    with pytest.raises(ProviderUnavailableError, match="restarted .*replaced by 0therone"):
        store.get("u_1:0:0")
    redis_server_clean.command("DEL", f"p2p:providers:{provider}")  # e.g. its TTL expired
    with pytest.raises(ProviderUnavailableError, match="no longer registered"):
        store.get("u_1:0:0")
    redis_server_clean.command("SET", f"p2p:providers:{provider}", registration)
    assert bytes(store.get("u_1:0:0")) == b"x"


# -- memory held by the provider -----------------------------------------------------------------

@needs_client
def test_provider_bytes_track_puts_overwrites_and_deletes(open_p2p, rng):
    store = open_p2p("mem")
    sizes = {f"m_{i}:0:0": rng.randint(0, 5000) for i in range(20)}
    for key, size in sizes.items():
        store.put(key, rng.randbytes(size))
    expected = sum(size + len(FRAME) for size in sizes.values())
    assert store.provider_bytes() == expected
    store.put("m_0:0:0", b"abc")  # overwrite replaces, never adds
    expected += 3 - sizes["m_0:0:0"]
    assert store.provider_bytes() == expected
    assert store.provided_keys() == sorted(sizes)
    store.delete(["m_1:0:0"])
    expected -= sizes["m_1:0:0"] + len(FRAME)
    assert store.provider_bytes() == expected
    store.clear()
    assert store.provider_bytes() == 0


@needs_client
def test_reclaim_orphans_frees_payloads_whose_delete_event_was_lost(open_p2p,
                                                                    redis_server_clean):
    store = open_p2p("orphan")
    store.put("o_1:0:0", b"a" * 1000)
    store.put("o_2:0:0", b"b" * 10)
    # Delete the metadata behind P2PStore's back: no pub/sub event, the payload leaks.
    redis_server_clean.command("DEL", "p2p:files:orphan/o_1:0:0")
    assert store.provider_bytes() == 1010 + 2 * len(FRAME)
    assert store.reclaim_orphans() == 1000 + len(FRAME)
    assert store.provider_bytes() == 10 + len(FRAME)
    assert store.reclaim_orphans() == 0


# -- deletes go through our index and exact-key batches ----------------------------------------

def command_calls(server) -> dict[str, int]:
    stats = server.info("commandstats")
    return {name[len("cmdstat_"):]: int(value.split("calls=")[1].split(",")[0])
            for name, value in stats.items() if name.startswith("cmdstat_")}


@needs_client
def test_prefix_deletes_never_list_every_key(open_p2p, redis_server_clean):
    store = open_p2p("idx", max_delete_batch=7)
    other = open_p2p("other")
    keys = [f"exp_epoch_3:{d}:{g}:0:0" for d in range(5) for g in range(4)]
    for key in keys:
        store.put(key, b"v")
    other.put("exp_epoch_3:0:0:0:0", b"keep")
    # Someone else's P2PStore record in the same Redis must survive our clear().
    redis_server_clean.command("SET", "p2p:files:foreign", '{"host": "h:1", "metadata": {}}')
    redis_server_clean.command("SADD", "p2p:files:index", "foreign")
    before = command_calls(redis_server_clean)
    assert store.delete_prefix(["exp_epoch_3:1", "exp_epoch_3:2:1"]) == \
        {"exp_epoch_3:1": 4, "exp_epoch_3:2:1": 1}
    assert store.clear() == 15
    after = command_calls(redis_server_clean)
    for listing in ("smembers", "scan", "sscan", "keys"):
        assert after.get(listing, 0) == before.get(listing, 0), listing
    # Exact-key batches of at most 7: the two prefixes' 4 + 1 keys in one (prefixes share
    # round trips), then 15 keys in 7 + 7 + 1.
    assert after["evalsha"] - before["evalsha"] == 1 + 3
    assert store.list() == [] and other.list() == ["exp_epoch_3:0:0:0:0"]
    assert redis_server_clean.command("EXISTS", "p2p:files:foreign") == 1


@needs_client
def test_fsck_hooks_see_payloads_of_the_namespace_only(open_p2p):
    from fd_routing_replay.store.index.fsck import fsck

    store, other = open_p2p("fsck"), open_p2p("fsck8")
    store.put("a_1:0:0", b"1")
    store.put("b_8:0:0", b"2")
    other.put("a_1:0:0", b"3")
    assert sorted(store.iter_payload_keys()) == ["a_1:0:0", "b_8:0:0"]
    assert store.payloads_exist(["a_1:0:0", "zz_1:0:0"]) == [True, False]
    store.index.remove(["b_8:0:0"])  # a crash between payload and index
    report = fsck(store, repair=True)
    assert report.unindexed == ["b_8:0:0"] and report.repaired
    assert store.list() == ["a_1:0:0", "b_8:0:0"]


# -- configuration and failures ---------------------------------------------------------------------

def test_redis_cluster_metadata_server_is_rejected():
    with pytest.raises(ConfigError, match="redis\\+sentinel"):
        open_store({"type": "p2pstore",
                    "p2pstore": {"metadata_server": "redis+cluster://127.0.0.1:7000"}})


@needs_client
def test_url_form(redis_server_clean, p2p_log_dir):
    url = f"p2pstore://{redis_server_clean.address}/0?protocol=tcp&log_dir={p2p_log_dir}"
    with open_store(url, "urlform") as store:
        store.put("u_1:0:0", b"x")
        assert store.list() == ["u_1:0:0"] and "tcp 127.0.0.1:" in store.describe()
    with pytest.raises(ConfigError, match=r"store.url p2pstore://127.0.0.1…: unknown option\(s\) bogus; known: metadata_server, protocol"):
        open_store(f"p2pstore://{redis_server_clean.address}/0?bogus=1")


@needs_client
def test_unreachable_metadata_server_is_transient(p2p_log_dir):
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(TransientStoreError, match="unreachable"):
        open_store(p2p_config(url, "down", p2p_log_dir))


@needs_client
def test_closed_store_refuses_and_releases_its_port(open_p2p):
    import socket

    store = open_p2p("closed")
    host, port = store.transport.split()[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5):
        pass  # the TCP transport listens while the store is open
    store.close()
    with pytest.raises(Exception, match="closed"):
        store.put("a_1:0:0", b"x")
    # P2PStore's own close leaves its listener open; ours shuts it.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=5).close()


@pytest.fixture
def sentinel(redis_server_clean, tmp_path):
    """A Redis Sentinel on loopback watching the session server as ``mymaster``."""
    import redis

    port = free_port()
    config = tmp_path / "sentinel.conf"  # Sentinel rewrites its config file
    config.write_text(f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
                      f"sentinel monitor mymaster 127.0.0.1 {redis_server_clean.port} 1\n")
    process = subprocess.Popen([redis_server_clean.binary, str(config), "--sentinel"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                if redis.Redis(port=port, socket_timeout=1).sentinel_master("mymaster"):
                    break
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        yield f"redis+sentinel://127.0.0.1:{port}/mymaster/0"
    finally:
        process.terminate()
        process.wait(10)


@needs_client
def test_metadata_server_behind_sentinel(sentinel, p2p_log_dir, capsys):
    from fd_routing_replay.cli import main

    with open_store(p2p_config(sentinel, "sent", p2p_log_dir)) as store:
        store.put("s_1:0:0", b"via sentinel")
        assert store.list() == ["s_1:0:0"] and bytes(store.get("s_1:0:0")) == b"via sentinel"
        assert "redis+sentinel://127.0.0.1:" in store.describe()
        assert store.delete_prefix(["s_1"]) == {"s_1": 1}
    config = p2p_config(sentinel, "sent", p2p_log_dir)
    path = os.path.join(p2p_log_dir, "sentinel.json")
    with open(path, "w") as handle:
        json.dump({"store": config}, handle)
    assert main(["doctor", "--config", path]) == 0
    assert "[ OK ] redis      redis+sentinel://127.0.0.1:" in capsys.readouterr().out


@needs_client
def test_rdma_config_on_a_node_without_nic_uses_tcp(open_p2p, caplog):
    from fd_routing_replay.rdma import list_devices

    if not list_devices().tcp_only:  # pragma: no cover - a node with an active RDMA port
        pytest.skip("this node has a usable RDMA NIC; the fallback cannot happen here")
    with caplog.at_level("WARNING", logger="fd_routing_replay.store.p2pstore"):
        store = open_p2p("rdmacfg", protocol="rdma", device="auto")
    assert store.transport.startswith("tcp 127.0.0.1:")
    assert "using its TCP transport instead of RDMA" in caplog.text and "TCP only" in caplog.text
    store.put("r_1:0:0", b"over tcp")
    assert bytes(store.get("r_1:0:0")) == b"over tcp"


def test_trusted_device_sets_and_restores_the_env(monkeypatch):
    from fd_routing_replay.store.p2pstore.runtime import trusted_device

    monkeypatch.delenv("P2P_RDMA_DEVICE", raising=False)
    with trusted_device("rdma", "mlx5_2"):
        assert os.environ["P2P_RDMA_DEVICE"] == "mlx5_2"
    assert "P2P_RDMA_DEVICE" not in os.environ
    for protocol, device in (("tcp", "mlx5_2"), ("rdma", "")):
        with trusted_device(protocol, device):
            assert "P2P_RDMA_DEVICE" not in os.environ
    monkeypatch.setenv("P2P_RDMA_DEVICE", "mlx5_9")  # the user's choice wins
    with trusted_device("rdma", "mlx5_2"):
        assert os.environ["P2P_RDMA_DEVICE"] == "mlx5_9"
    assert os.environ["P2P_RDMA_DEVICE"] == "mlx5_9"
