"""The P2PStore backend in FastDeploy's layout, on the real client (TCP transport, Redis on
loopback): a consumer that reads with P2PStore's own ``get``, as a FastDeploy user's
trainer does, must see exactly what FastDeploy's ``RoutingStoreRDMA`` would have put."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fd_routing_replay.codec import RoutingRecord, decode_fastdeploy_raw, encode_record
from fd_routing_replay.errors import ConfigError, PermanentStoreError
from fd_routing_replay.store import open_store
from fdrr_dev.testing.process import free_port

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
FASTDEPLOY_SOURCES = Path(__file__).resolve().parents[3] / "shared" / "fastdeploy"
OWNER_KEY = "rr:p2p:fastdeploy-namespace"


# -- FastDeploy's side, written from its sources (test_reference_matches_fastdeploy pins it) --

def fastdeploy_padded(ids: np.ndarray, max_model_len: int) -> np.ndarray:
    """StoreProcess.pad_routing_indices: concatenate rows of ``-1`` (cast) up to max_model_len."""
    fill = np.array(-1).astype(ids.dtype)
    pad = np.full((*ids.shape[:-2], max_model_len - ids.shape[-2], ids.shape[-1]), fill,
                  dtype=ids.dtype)
    return np.concatenate([ids, pad], axis=-2)


async def fastdeploy_put(client: Any, routing_key: str, routing_indices: np.ndarray) -> bool:
    """RoutingStoreRDMA.put: fused arrays go as bytes, per-layer arrays as the ndarray."""
    if len(routing_indices.shape) == 3:
        return await client.put(routing_key, routing_indices.tobytes())
    return await client.put(routing_key, routing_indices)


@pytest.mark.parametrize("version", ["2.5", "2.6"])
def test_reference_matches_fastdeploy(version):
    """The two helpers above are what FastDeploy's code does (fails when it changes)."""
    path = {"2.5": "fastdeploy/model_executor/layers/moe/routing_indices_cache.py",
            "2.6": "fastdeploy/cache_manager/routing_store.py"}[version]
    source_file = FASTDEPLOY_SOURCES / version / path
    if not source_file.exists():
        pytest.skip(f"FastDeploy {version} sources not found at {source_file}")
    source = source_file.read_text()
    methods = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    # unparsed: comments and formatting do not matter
                    methods[f"{node.name}.{item.name}"] = "".join(ast.unparse(item).split())
    put = methods["RoutingStoreRDMA.put"]
    assert "iflen(routing_indices.shape)==3:routing_bytes=routing_indices.tobytes()" \
           "result=awaitself.p2p_client.put(routing_key,routing_bytes)else:" \
           "result=awaitself.p2p_client.put(routing_key,routing_indices)" in put
    pad = methods["StoreProcess.pad_routing_indices"]
    assert pad.count("fill_value=-1,") == 2 and "axis=0)" in pad and "axis=1)" in pad
    submit = methods["StoreWrapper.submit_put_task"]
    assert "rdma_rollout_key=f'{rollout_id}_{layer_idx}'" in submit
    assert "rdma_rollout_key=rollout_id" in submit


# -- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def p2p_log_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("p2pstore-logs"))


@pytest.fixture
def fd_url(redis_server_clean, p2p_log_dir):
    """fd_url(db=0, **options) -> a p2pstore:// URL in FastDeploy's layout."""
    def _url(db: int = 0, **options: Any) -> str:
        query = "&".join(f"{k}={v}" for k, v in {"protocol": "tcp", "log_dir": p2p_log_dir,
                                                 "layout": "fastdeploy", **options}.items())
        return f"p2pstore://{redis_server_clean.address}/{db}?{query}"
    return _url


@pytest.fixture
def open_fd(fd_url):
    """open_fd(namespace, db=0, **options) -> store; all closed after the test."""
    if MISSING:
        pytest.skip(f"not installed: {', '.join(MISSING)}")
    stores = []

    def _open(namespace: str = "fd", db: int = 0, **options: Any):
        store = open_store(fd_url(db, **options), namespace)
        stores.append(store)
        return store

    yield _open
    for store in stores:
        store.close()


class Consumer:
    """A bare P2PStore client, as a FastDeploy user's trainer (or FastDeploy itself) has."""

    def __init__(self, metadata_server: str, log_dir: str) -> None:
        from fd_routing_replay.store.p2pstore.runtime import (
            AsyncBridge,
            LogWriter,
            import_p2pstore,
            resolve_log_dir,
        )

        module = import_p2pstore(resolve_log_dir(log_dir))
        self.bridge = AsyncBridge(name="consumer")
        with contextlib.redirect_stdout(LogWriter()):
            self.client = module.P2PClient(module.P2PConfig(
                metadata_server=metadata_server, protocol="tcp",
                local_host=f"127.0.0.1:{free_port()}"))

    def get(self, key: str) -> Any:
        return self.bridge.run(self.client.get(key), 60)

    def fastdeploy_put(self, key: str, routing_indices: np.ndarray) -> bool:
        return self.bridge.run(fastdeploy_put(self.client, key, routing_indices), 60)

    def close(self) -> None:
        from fd_routing_replay.store.p2pstore.runtime import LogWriter, close_tcp_listeners

        with contextlib.redirect_stdout(LogWriter()):
            self.client.close()
        close_tcp_listeners(self.client)
        self.bridge.close()


@pytest.fixture
def consumer(redis_server_clean, p2p_log_dir):
    if MISSING:
        pytest.skip(f"not installed: {', '.join(MISSING)}")
    client = Consumer(redis_server_clean.url, p2p_log_dir)
    yield client
    client.close()


def metadata(server, key: str) -> dict | None:
    """P2PStore's metadata of ``key``, or None when it has none."""
    raw = server.command("GET", f"p2p:files:{key}")
    return json.loads(raw) if raw else None


def value_fields(server, key: str) -> dict:
    """What a consumer's get depends on: the value's type, size, shape and dtype."""
    meta = metadata(server, key)["metadata"]
    return {name: meta.get(name) for name in ("object_type", "data_size", "tensor_shape",
                                               "tensor_dtype")}


def p2p_keys(server) -> list[str]:
    return sorted(k.decode()[len("p2p:files:"):] for k in server.command("KEYS", "p2p:files:*")
                  if k != b"p2p:files:index")


@pytest.fixture
def np_rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


def record(rollout_id: str, ids: np.ndarray, experts: int, **fields: Any) -> bytes:
    return encode_record(RoutingRecord(rollout_id, np.ascontiguousarray(ids), experts, **fields))


# -- values are FastDeploy's ----------------------------------------------------------------------

@needs_client
@pytest.mark.parametrize("fill", [None, 16], ids=["dtype-max-fill", "record-fill-16"])
def test_fused_key_holds_fastdeploy_bytes(open_fd, consumer, redis_server_clean, np_rng, fill):
    layers, tokens, top_k, experts, max_model_len = 3, 37, 4, 16, 64
    ids = np_rng.integers(0, experts, (layers, tokens, top_k), dtype=np.uint8)
    no_routing = 255 if fill is None else fill
    ids[1, 5, 2] = ids[0, 7, :] = no_routing  # slots without routing inside the tokens
    store = open_fd("fd", max_model_len=max_model_len)
    store.put("exp_a:7:0:0", record("exp_a:7:0:0", ids, experts, fill_value=fill))

    fastdeploy_ids = np.where(ids == no_routing, np.uint8(255), ids)  # FastDeploy's fill
    expected = fastdeploy_padded(fastdeploy_ids, max_model_len)
    value = consumer.get("exp_a:7:0:0")  # the trainer's read: P2PStore's own get, bare key
    assert type(value) is bytes and value == expected.tobytes()
    # FastDeploy's own put of that array: P2PStore describes both values the same way.
    assert consumer.fastdeploy_put("ref_1:0:0", expected)
    assert value_fields(redis_server_clean, "exp_a:7:0:0") == \
        value_fields(redis_server_clean, "ref_1:0:0") == \
        {"object_type": "object", "data_size": expected.nbytes, "tensor_shape": [],
         "tensor_dtype": None}
    assert p2p_keys(redis_server_clean) == ["exp_a:7:0:0", "ref_1:0:0"]  # no namespace
    # Our get: the same bytes; reading them takes the geometry from elsewhere.
    assert bytes(store.get("exp_a:7:0:0")) == value
    decoded = decode_fastdeploy_raw(store.get("exp_a:7:0:0"), layers, max_model_len, top_k,
                                    np.uint8)
    assert decoded.shape == (layers, tokens, top_k) and (decoded == fastdeploy_ids).all()
    assert store.list() == ["exp_a:7:0:0"] and store.exists("exp_a:7:0:0")
    assert store.provider_bytes() == expected.nbytes


@needs_client
def test_per_layer_keys_hold_fastdeploy_arrays(open_fd, consumer, redis_server_clean, np_rng):
    layers, tokens, top_k, experts, max_model_len = 4, 21, 3, 300, 40  # uint16, ids > 256
    ids = np_rng.integers(0, experts, (layers, tokens, top_k), dtype=np.uint16)
    ids[:, 0, :] = np.arange(257, 257 + top_k)
    store = open_fd("fd", max_model_len=max_model_len)
    rollout = "exp_b_3:2:0:1"
    for layer in range(layers):
        store.put(f"{rollout}_{layer}", record(rollout, ids[layer:layer + 1], experts,
                                               metadata={"layer": layer, "num_layers": layers}))
    assert store.list(rollout) == [f"{rollout}_{layer}" for layer in range(layers)]
    # As FastDeploy's own per-layer puts do, the ndarray put sets P2PStore's store-wide
    # cache layout (read only by its persistence_dir / cache_all readers).
    assert json.loads(redis_server_clean.command("GET", "p2p:cache_meta"))["shape"] == \
        [max_model_len, top_k]
    for layer in range(layers):
        expected = fastdeploy_padded(ids[layer], max_model_len)
        value = consumer.get(f"{rollout}_{layer}")
        assert isinstance(value, np.ndarray) and value.dtype == np.uint16
        assert value.shape == (max_model_len, top_k) and value.tobytes() == expected.tobytes()
        assert bytes(store.get(f"{rollout}_{layer}")) == expected.tobytes()
    reference = fastdeploy_padded(ids[0], max_model_len)
    assert consumer.fastdeploy_put("ref_1:0:0_0", reference)
    assert value_fields(redis_server_clean, f"{rollout}_0") == \
        value_fields(redis_server_clean, "ref_1:0:0_0") == \
        {"object_type": "numpy", "data_size": reference.nbytes,
         "tensor_shape": [max_model_len, top_k], "tensor_dtype": "uint16"}
    # A per-layer key takes exactly one layer.
    with pytest.raises(PermanentStoreError, match="one layer; the record has 2"):
        store.put(f"{rollout}_9", record(rollout, ids[:2], experts))
    assert not store.exists(f"{rollout}_9")


@needs_client
def test_writer_hands_records_and_only_last_turn_deletes_bare_keys(fd_url, consumer,
                                                                    redis_server_clean,
                                                                    tmp_path, np_rng):
    from fd_routing_replay.writer import RoutingWriter

    if MISSING:
        pytest.skip(f"not installed: {', '.join(MISSING)}")
    shape, experts, max_model_len = (2, 9, 2), 8, 16
    ids = {key: np_rng.integers(0, experts, shape, dtype=np.uint8)
           for key in ("exp_a:7:0:0", "exp_a:70:0:0", "exp_a:7:1:0", "exp_a:7:0:1")}
    writer = RoutingWriter({"url": fd_url(max_model_len=max_model_len), "namespace": "wr"},
                           {"mode": "thread", "journal_dir": str(tmp_path / "journal"),
                            "dead_letter_dir": str(tmp_path / "dead")},
                           only_last_turn=True, record_format="fastdeploy-raw")
    try:
        for key in ("exp_a:7:0:0", "exp_a:70:0:0", "exp_a:7:0:1"):
            writer.submit_put(key, RoutingRecord(key, ids[key], experts))
        assert writer.flush(60)
        for key in ("exp_a:7:0:0", "exp_a:70:0:0", "exp_a:7:0:1"):
            assert consumer.get(key) == fastdeploy_padded(ids[key], max_model_len).tobytes()
        writer.submit_put("exp_a:7:1:0", RoutingRecord("exp_a:7:1:0", ids["exp_a:7:1:0"],
                                                       experts))
        assert writer.flush(60)
        # Turn 1 of segment 0 is durable: turn 0 of segment 0 is gone, nothing else.
        assert p2p_keys(redis_server_clean) == sorted(["exp_a:7:0:1", "exp_a:7:1:0",
                                                       "exp_a:70:0:0"])
        assert consumer.get("exp_a:7:0:0") is None
        assert consumer.get("exp_a:7:1:0") == \
            fastdeploy_padded(ids["exp_a:7:1:0"], max_model_len).tobytes()
        assert writer.stats()["dead_lettered"] == 0
    finally:
        writer.close(30)


# -- deletes stay boundary-safe on bare keys -------------------------------------------------

@needs_client
def test_delete_prefix_is_boundary_safe(open_fd, consumer, redis_server_clean, np_rng):
    store = open_fd("fd", max_model_len=8)
    ids = np_rng.integers(0, 4, (1, 3, 2), dtype=np.uint8)
    fused = ["b:1:0:0", "b:1:1:0", "b:10:0:0", "b:1:0:0:2:0"]
    layered = ["b:1:0:0_0", "b:1:0:0_1", "b:10:0:0_0"]
    for key in fused:
        store.put(key, record(key, ids, 4))
    for key in layered:
        rollout = key.rsplit("_", 1)[0]
        store.put(key, record(rollout, ids, 4))
    assert p2p_keys(redis_server_clean) == sorted(fused + layered)
    assert store.delete_prefix(["b:1:0:0_"]) == {"b:1:0:0_": 2}
    assert store.delete_prefix(["b:1:1"]) == {"b:1:1": 1}
    assert store.delete_prefix(["b:1"]) == {"b:1": 2}  # b:1:0:0 and b:1:0:0:2:0
    assert p2p_keys(redis_server_clean) == ["b:10:0:0", "b:10:0:0_0"]
    assert store.list() == ["b:10:0:0", "b:10:0:0_0"]
    assert consumer.get("b:1:0:0") is None
    assert consumer.get("b:10:0:0") == fastdeploy_padded(ids, 8).tobytes()
    assert store.delete(["b:10:0:0_0", "b:10:0:0_0", "b:9:0:0"]) == 1
    assert store.clear() == 1 and p2p_keys(redis_server_clean) == []


# -- refusals: nothing written, the key named ----------------------------------------------

@needs_client
@pytest.mark.parametrize("key", ["exp_88888888:0:0", "88888888_1:0:0_3", "a:1288888888:0"])
def test_keys_p2pstore_would_drop_are_refused(open_fd, redis_server_clean, key):
    store = open_fd("fd88888888")  # a namespace may hold them: it is not in the keys
    rollout = key.rsplit("_", 1)[0] if key.endswith("_3") else key
    with pytest.raises(PermanentStoreError, match=f"refusing key '{key}'.*88888888"):
        store.put(key, record(rollout, np.zeros((1, 2, 2), np.uint8), 4))
    assert p2p_keys(redis_server_clean) == [] and store.list() == []
    assert store.provider_bytes() == 0
    assert redis_server_clean.command("EXISTS", OWNER_KEY) == 0


@needs_client
def test_seven_eights_are_stored(open_fd, consumer):
    store = open_fd("fd", max_model_len=4)
    ids = np.full((1, 2, 2), 3, np.uint8)
    store.put("exp_8888888:0:0", record("exp_8888888:0:0", ids, 4))
    assert consumer.get("exp_8888888:0:0") == fastdeploy_padded(ids, 4).tobytes()


@needs_client
def test_values_that_are_not_convertible_are_refused(open_fd, redis_server_clean):
    store = open_fd("fd", max_model_len=8)
    ids = np.zeros((2, 9, 2), np.uint8)
    with pytest.raises(PermanentStoreError, match="'t_1:0:0'.*9 tokens, more than "
                                                  "max_model_len 8"):
        store.put("t_1:0:0", record("t_1:0:0", ids, 4))
    with pytest.raises(PermanentStoreError, match="not an rr-v1 record"):
        store.put("t_1:0:0", bytes(fastdeploy_padded(ids[:, :8], 8)))
    with pytest.raises(PermanentStoreError, match="belongs to rollout 'u_1:0:0'"):
        store.put("t_1:0:0", record("u_1:0:0", ids[:, :8], 4))
    with pytest.raises(PermanentStoreError, match="rollout id .* or a per-layer key"):
        store.put("plainkey", record("plainkey", ids[:, :8], 4))
    unpadded = open_fd("fd")  # no max_model_len: an empty record has nothing to send
    with pytest.raises(PermanentStoreError, match="empty"):
        unpadded.put("t_2:0:0", record("t_2:0:0", ids[:, :0], 4))
    assert p2p_keys(redis_server_clean) == [] and store.list() == []


@needs_client
def test_without_max_model_len_records_are_stored_as_they_come(open_fd, consumer, np_rng):
    store = open_fd("fd")
    ids = np_rng.integers(0, 4, (2, 5, 2), dtype=np.uint8)
    store.put("p_1:0:0", record("p_1:0:0", ids, 4))
    assert consumer.get("p_1:0:0") == ids.tobytes()
    assert "layout=fastdeploy" in store.describe() and "max_model_len" not in store.describe()


# -- one namespace per bare key space ---------------------------------------------------------

@needs_client
def test_a_second_namespace_is_refused(open_fd, redis_server_clean):
    ids = np.zeros((1, 2, 2), np.uint8)
    first = open_fd("first")
    first.put("n_1:0:0", record("n_1:0:0", ids, 4))
    assert redis_server_clean.command("GET", OWNER_KEY) == b"first"
    second = open_fd("second")
    with pytest.raises(PermanentStoreError, match="belong to namespace 'first'"):
        second.put("n_2:0:0", record("n_2:0:0", ids, 4))
    for call in (lambda: second.delete(["n_1:0:0"]), lambda: second.delete_prefix(["n_1"]),
                 second.clear):
        with pytest.raises(PermanentStoreError, match="belong to namespace 'first'"):
            call()
    assert p2p_keys(redis_server_clean) == ["n_1:0:0"]
    # Another process of the same namespace shares the space; another database is another space.
    again = open_fd("first")
    again.put("n_3:0:0", record("n_3:0:0", ids, 4))
    assert again.list() == ["n_1:0:0", "n_3:0:0"]
    elsewhere = open_fd("second", db=1)
    elsewhere.put("n_2:0:0", record("n_2:0:0", ids, 4))
    assert elsewhere.list() == ["n_2:0:0"] and first.list() == ["n_1:0:0", "n_3:0:0"]
    # Closing a provider unregisters its bare keys and drops them from the index.
    again.close()
    assert first.list() == ["n_1:0:0"] and p2p_keys(redis_server_clean) == ["n_1:0:0"]


@needs_client
def test_tree_and_fastdeploy_layouts_share_a_server(open_fd, redis_server_clean, p2p_log_dir):
    from fd_routing_replay.store.index.fsck import fsck

    fd = open_fd("fd", max_model_len=4)
    with open_store({"type": "p2pstore", "namespace": "tree",
                     "p2pstore": {"metadata_server": redis_server_clean.url, "protocol": "tcp",
                                  "log_dir": p2p_log_dir}}) as tree:
        tree.put("a_1:0:0", b"framed")
        fd.put("b_1:0:0", record("b_1:0:0", np.zeros((1, 2, 2), np.uint8), 4))
        assert list(fd.iter_payload_keys()) == ["b_1:0:0"]
        assert list(tree.iter_payload_keys()) == ["a_1:0:0"]
        assert fd.provided_keys() == ["b_1:0:0"]
        report = fsck(fd)
        assert report.consistent and report.indexed == report.payloads == 1
        assert p2p_keys(redis_server_clean) == ["b_1:0:0", "tree/a_1:0:0"]


# -- configuration ----------------------------------------------------------------------------

@pytest.mark.parametrize("query, message", [
    ("layout=bogus", r"store.p2pstore.layout: invalid value 'bogus'; allowed: 'tree', 'fastdeploy' \(from store.url"),
    ("max_model_len=8", "max_model_len only applies to layout fastdeploy"),
    ("layout=fastdeploy&max_model_len=0", r"store.p2pstore.max_model_len: must be >= 1, got 0 \(from store.url"),
    ("layout=fastdeploy&max_model_len=x", r"store.p2pstore.max_model_len: invalid integer 'x'"),
])
def test_layout_options_are_checked(query, message):
    with pytest.raises(ConfigError, match=message):
        open_store(f"p2pstore://127.0.0.1:1/0?protocol=tcp&{query}")


@needs_client
def test_converts_records_and_tree_is_the_default(open_fd, redis_server_clean, p2p_log_dir):
    assert open_fd("fd").converts_records()
    url = f"p2pstore://{redis_server_clean.address}/0?protocol=tcp&log_dir={p2p_log_dir}"
    with open_store(url, "tree") as tree:
        assert not tree.converts_records() and "layout" not in tree.describe()
