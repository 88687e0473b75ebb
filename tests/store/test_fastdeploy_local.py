"""The local store in FastDeploy's own layout: exact paths, files paddle.load reads, FastDeploy's
R3 test utilities agreeing with what we wrote, boundary-safe prefix deletes and only_last_turn.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

from fd_routing_replay.codec import RoutingRecord, encode_record
from fd_routing_replay.codec.pdtensor import encode_pdtensor
from fd_routing_replay.errors import ConfigError, InvalidRolloutId, PermanentStoreError
from fd_routing_replay.keys import prefix_matches
from fd_routing_replay.store import open_store
from fd_routing_replay.store.instrumented import InstrumentedStore
from fd_routing_replay.store.local.fastdeploy import NAMESPACE_MARKER, FastDeployLocalStore
from fd_routing_replay.store.local.tree import LocalStore
from tests.store_conformance import BAD_KEYS

paddle = pytest.importorskip("paddle", reason="paddlepaddle (CPU) is the reference for .pdtensor")

FD_UTILS = (Path(__file__).resolve().parents[2] / ".." / "shared" / "fastdeploy" / "2.6" / "tests"
            / "rollout_routing_replay_test_utils.py").resolve()
MAX_LEN = 64


@pytest.fixture
def np_rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.fixture
def store(tmp_path) -> FastDeployLocalStore:
    return FastDeployLocalStore(tmp_path / "r3", "ns", max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def fd_utils():
    if not FD_UTILS.is_file():
        pytest.skip(f"FastDeploy's sources are not at {FD_UTILS.parents[2]} (../shared/fastdeploy)")
    spec = importlib.util.spec_from_file_location("rollout_routing_replay_test_utils", FD_UTILS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def routing(np_rng, dtype: str, layers: int, tokens: int, top_k: int = 8) -> np.ndarray:
    """Random routing; uint16 ids are above 256 so a bfloat16 reading cannot pass."""
    low, high = {"uint8": (0, 254), "uint16": (257, 65534), "uint32": (65536, 2**32 - 2)}[dtype]
    return np_rng.integers(low, high, size=(layers, tokens, top_k), endpoint=True).astype(dtype)


def fastdeploy_padded(ids: np.ndarray, max_model_len: int = MAX_LEN) -> np.ndarray:
    """FastDeploy's StoreProcess.pad_routing_indices (its -1 fill cast to the dtype)."""
    fill = np.iinfo(ids.dtype).max
    pad = np.full((*ids.shape[:-2], max_model_len - ids.shape[-2], ids.shape[-1]), fill, ids.dtype)
    return np.concatenate([ids, pad], axis=-2)


def rr_record(rollout_id: str, ids: np.ndarray, **kwargs) -> bytes:
    return encode_record(RoutingRecord(rollout_id, np.ascontiguousarray(ids),
                                       num_experts=int(np.iinfo(ids.dtype).max), **kwargs))


def put_per_layer(store, rollout_id: str, ids: np.ndarray) -> None:
    for layer in range(ids.shape[0]):
        store.put(f"{rollout_id}_{layer}", rr_record(rollout_id, ids[layer:layer + 1],
                                                     layers=(layer,)))


# -- the files ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["uint8", "uint16", "uint32"])
def test_fused_file_is_what_fastdeploy_writes(store, np_rng, tmp_path, dtype):
    ids = routing(np_rng, dtype, 3, 41)
    store.put("exp_a_7:gen1:0:0", rr_record("exp_a_7:gen1:0:0", ids))
    path = store.root / "exp_a_7:gen1:0:0" / "exp_a_7:gen1:0:0.pdtensor"
    assert sorted(os.listdir(store.root)) == [NAMESPACE_MARKER, "exp_a_7:gen1:0:0"]
    assert os.listdir(path.parent) == [path.name]
    reference = tmp_path / "paddle_save.pdtensor"
    paddle.save(fastdeploy_padded(ids), str(reference))
    assert path.read_bytes() == reference.read_bytes()
    loaded = paddle.load(str(path), return_numpy=True)
    assert loaded.shape == (3, MAX_LEN, 8) and loaded.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(loaded, fastdeploy_padded(ids))


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "uint32"])
def test_per_layer_files_are_what_fastdeploy_writes(store, np_rng, tmp_path, dtype):
    ids = routing(np_rng, dtype, 4, 23)
    put_per_layer(store, "exp_b:0:1", ids)
    directory = store.root / "exp_b:0:1"
    assert sorted(os.listdir(directory)) == [f"layer_{i}.pdtensor" for i in range(4)]
    for layer in range(4):
        reference = tmp_path / f"ref_{layer}.pdtensor"
        paddle.save(fastdeploy_padded(ids[layer]), str(reference))
        assert (directory / f"layer_{layer}.pdtensor").read_bytes() == reference.read_bytes()
        loaded = paddle.load(str(directory / f"layer_{layer}.pdtensor"), return_numpy=True)
        assert loaded.shape == (MAX_LEN, 8) and loaded.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(loaded, fastdeploy_padded(ids[layer]))


@pytest.mark.parametrize("tokens", [0, MAX_LEN], ids=["no-tokens", "exactly-max_model_len"])
def test_padding_edges(store, np_rng, tokens):
    ids = routing(np_rng, "uint8", 2, tokens)
    store.put("edge:0:0", rr_record("edge:0:0", ids))
    loaded = paddle.load(str(store.path_of("edge:0:0")), return_numpy=True)
    assert loaded.shape == (2, MAX_LEN, 8)
    np.testing.assert_array_equal(loaded[:, :tokens], ids)
    assert (loaded[:, tokens:] == 255).all()
    with pytest.raises(PermanentStoreError, match=f"{MAX_LEN + 1} tokens do not fit"):
        store.put("edge:1:0", rr_record("edge:1:0", routing(np_rng, "uint8", 2, MAX_LEN + 1)))


def test_without_max_model_len_records_are_written_at_their_length(tmp_path, np_rng):
    store = FastDeployLocalStore(tmp_path, "ns")
    ids = routing(np_rng, "uint8", 2, 9)
    ids[:, -1] = 250
    store.put("len:0:0", encode_record(RoutingRecord("len:0:0", ids, 200, fill_value=250)))
    loaded = paddle.load(str(store.path_of("len:0:0")), return_numpy=True)
    expected = ids.copy()
    expected[ids == 250] = 255  # the record's fill becomes FastDeploy's
    np.testing.assert_array_equal(loaded, expected)


def test_pdtensor_values_are_stored_verbatim_and_checked(store, np_rng, tmp_path):
    ids = fastdeploy_padded(routing(np_rng, "uint16", 2, 10))
    reference = tmp_path / "fd.pdtensor"
    paddle.save(ids, str(reference))  # a file FastDeploy itself wrote
    store.put("copy:0:0", reference.read_bytes())
    assert store.get("copy:0:0") == reference.read_bytes()
    with pytest.raises(PermanentStoreError, match="3 dimensions; expected 2"):
        store.put("copy:0:0_1", reference.read_bytes())  # a layer file must be 2-D
    with pytest.raises(PermanentStoreError, match="not allowed"):
        store.put("copy:1:0", reference.read_bytes().replace(b"\x8c\x05dtype", b"\x8c\x05range"))
    assert store.list("copy") == ["copy:0:0"]


def test_raw_bytes_and_mismatched_records_are_refused(store, np_rng):
    ids = routing(np_rng, "uint8", 2, 5)
    with pytest.raises(PermanentStoreError, match="neither an rr-v1 record nor a .pdtensor"):
        store.put("raw:0:0", ids.tobytes())
    with pytest.raises(PermanentStoreError, match="belongs to rollout 'other:0:0'"):
        store.put("raw:0:0", rr_record("other:0:0", ids))
    with pytest.raises(PermanentStoreError, match="per-layer key holds one layer"):
        store.put("raw:0:0_0", rr_record("raw:0:0", ids))
    assert store.list() == [] and not (store.root / "raw:0:0").exists()
    assert store.converts_records() and InstrumentedStore(store).converts_records()
    assert not LocalStore(store.root / "tree").converts_records()


# -- FastDeploy's own test utilities on our files -------------------------------------------------

def test_fastdeploy_utilities_read_our_per_layer_files(store, np_rng, tmp_path, fd_utils):
    tokens, layers = 37, 3
    ids = routing(np_rng, "uint8", layers, tokens)
    put_per_layer(store, "r3_chat:0:0", ids)
    rollout_dir = store.root / "r3_chat:0:0"
    assert len(os.listdir(rollout_dir)) == layers  # FastDeploy's completeness check
    assert fd_utils.wait_for_file(str(rollout_dir), timeout=1, moe_layer_num=layers)
    for layer in range(layers):
        baseline = tmp_path / f"baseline_{layer}.pdtensor"
        paddle.save(fastdeploy_padded(ids[layer]), str(baseline))  # FastDeploy's own write
        expected = paddle.load(str(baseline))
        actual = paddle.load(str(rollout_dir / f"layer_{layer}.pdtensor"))
        assert float(fd_utils.calculate_routing_ratio(expected, actual)) == 1.0
        assert fd_utils.get_real_routing_length(actual) == tokens
    # a negative control: layer 0 with one token routed elsewhere, against layer 0's file
    other = fastdeploy_padded(ids[0]).copy()
    other[3] = (other[3] + 1) % 255
    layer_0 = paddle.load(str(rollout_dir / "layer_0.pdtensor"))
    assert float(fd_utils.calculate_routing_ratio(paddle.to_tensor(fastdeploy_padded(ids[0])),
                                                  layer_0)) == 1.0
    assert float(fd_utils.calculate_routing_ratio(paddle.to_tensor(other), layer_0)) < 1.0


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_fastdeploy_utilities_on_wide_dtypes_via_numpy(store, np_rng, tmp_path, fd_utils, dtype):
    """paddle.load makes uint16 files bfloat16 tensors and cannot load uint32 ones as tensors
    (FastDeploy's own files too), so a trainer loads them as NumPy and maps the fill to -1."""
    tokens = 29
    ids = routing(np_rng, dtype, 2, tokens)
    store.put("wide:0:0", rr_record("wide:0:0", ids))
    baseline = tmp_path / "baseline.pdtensor"
    paddle.save(fastdeploy_padded(ids), str(baseline))

    def as_trainer_reads(path: Path, layer: int):
        array = paddle.load(str(path), return_numpy=True)[layer].astype(np.int64)
        array[array == np.iinfo(dtype).max] = -1
        return paddle.to_tensor(array)

    for layer in range(2):
        expected = as_trainer_reads(baseline, layer)
        actual = as_trainer_reads(store.path_of("wide:0:0"), layer)
        assert float(fd_utils.calculate_routing_ratio(expected, actual)) == 1.0
        assert fd_utils.get_real_routing_length(actual) == tokens
        np.testing.assert_array_equal(actual.numpy()[:tokens], ids[layer].astype(np.int64))


def test_fastdeploy_utilities_see_no_padding_at_max_model_len(store, np_rng, fd_utils):
    ids = routing(np_rng, "uint8", 1, MAX_LEN)
    put_per_layer(store, "full:0:0", ids)
    actual = paddle.load(str(store.path_of("full:0:0_0")))
    assert fd_utils.get_real_routing_length(actual) == -1  # FastDeploy: no fill row at all
    np.testing.assert_array_equal(actual.numpy(), ids[0])


# -- keys, listing, deletes -------------------------------------------------------------------------

def test_keys_must_be_rollout_ids_or_layer_keys(store):
    value = encode_pdtensor(np.zeros((1, 2, 2), np.uint8))
    for bad in ["x:1", "exp_1", "exp:0:01", "exp:0:0_01", "exp:0:0_x", *BAD_KEYS]:
        with pytest.raises(InvalidRolloutId):
            store.put(bad, value)
        with pytest.raises(InvalidRolloutId):
            store.get(bad)
        with pytest.raises(InvalidRolloutId):
            store.delete([bad])
    for bad in ["", "a/b", "..", "a b"]:
        with pytest.raises(InvalidRolloutId):
            store.delete_prefix([bad])


def test_names_longer_than_the_file_system_allows_are_refused(store):
    rollout_id = "a" * 247 + ":0:0"  # 251 bytes: the directory fits, the fused file does not
    value = encode_pdtensor(np.zeros((1, 2, 2), np.uint8))
    with pytest.raises(PermanentStoreError, match="255"):
        store.put(rollout_id, value)
    store.put(f"{rollout_id}_0", encode_pdtensor(np.zeros((2, 2), np.uint8)))
    assert store.list() == [f"{rollout_id}_0"]


def fill_keys(store, keys: list[str]) -> None:
    for key in keys:
        layer = key.rpartition("_")[2]
        value = (encode_pdtensor(np.zeros((2, 2), np.uint8)) if ":" not in layer
                 else encode_pdtensor(np.zeros((1, 2, 2), np.uint8)))
        store.put(key, value)


def test_prefix_delete_is_boundary_safe_and_takes_whole_rollouts(store):
    keys = ["exp:1:0:0", "exp:1:1:0_0", "exp:1:1:0_1", "exp:1:1:0_2", "exp:1_5:0:0",
            "exp:10:0:0", "exp:10:0:0_3", "exp_1:0:0", "other:1:0:0"]
    fill_keys(store, keys)
    assert store.list() == sorted(keys)
    assert store.list("exp:1") == ["exp:1:0:0", "exp:1:1:0_0", "exp:1:1:0_1", "exp:1:1:0_2",
                                   "exp:1_5:0:0"]
    assert store.list("exp:1:1:0_1") == ["exp:1:1:0_1"]
    assert store.delete_prefix(["exp:1"]) == {"exp:1": 5}
    assert store.list() == ["exp:10:0:0", "exp:10:0:0_3", "exp_1:0:0", "other:1:0:0"]
    assert not (store.root / "exp:1:1:0").exists()
    assert store.delete_prefix(["exp:10:0:0_"]) == {"exp:10:0:0_": 1}  # layers only
    assert store.list() == ["exp:10:0:0", "exp_1:0:0", "other:1:0:0"]
    assert store.delete_prefix(["exp"]) == {"exp": 2}
    assert store.list() == ["other:1:0:0"]


def test_prefix_operations_match_the_reference_on_random_keys(store, rng):
    keys: set[str] = set()
    while len(keys) < 80:
        base = rng.choice(["exp", "exp_a", "exp_ab", "e1"]) + "_" + rng.choice(["1", "10", "2"])
        rollout = f"{base}:{rng.randint(0, 12)}:{rng.randint(0, 2)}"
        keys.add(f"{rollout}_{rng.randint(0, 11)}" if rng.random() < 0.4 else rollout)
    keys_sorted = sorted(keys)
    fill_keys(store, keys_sorted)
    remaining = set(keys_sorted)
    prefixes = sorted({k[:rng.randint(1, len(k))] for k in rng.sample(keys_sorted, 15)})
    for prefix in prefixes:
        if prefix.endswith(".") or prefix.startswith("."):
            continue
        expected = {k for k in remaining if prefix_matches(k, prefix)}
        assert store.list(prefix) == sorted(expected), prefix
        assert store.delete_prefix([prefix]) == {prefix: len(expected)}, prefix
        remaining -= expected
        assert store.list() == sorted(remaining)


def test_delete_of_a_rollout_id_removes_its_directory(store, np_rng):
    put_per_layer(store, "del:0:0", routing(np_rng, "uint8", 3, 4))
    store.put("del:1:0", rr_record("del:1:0", routing(np_rng, "uint8", 3, 4)))
    assert not store.exists("del:0:0") and store.exists("del:0:0_2")
    assert store.delete(["del:0:0_1"]) == 1
    assert store.list("del:0:0") == ["del:0:0_0", "del:0:0_2"]
    (store.root / "del:0:0" / ".tmp-leftover").write_bytes(b"x")  # a crashed writer's temp
    assert store.delete(["del:0:0", "del:9:0"]) == 2
    assert not (store.root / "del:0:0").exists()
    assert store.delete(["del:1:0_0"]) == 0 and store.delete(["del:1:0"]) == 1
    assert sorted(os.listdir(store.root)) == [NAMESPACE_MARKER]


def test_clear_keeps_what_is_not_a_rollout(store, np_rng):
    store.put("c:0:0", rr_record("c:0:0", routing(np_rng, "uint8", 1, 3)))
    (store.root / ".journal").mkdir()
    (store.root / "routing_replay").mkdir()  # e.g. a tree-layout namespace
    (store.root / "notes.txt").write_text("keep")
    (store.root / "c:0:0" / "README").write_text("not ours")
    assert store.clear() == 1
    assert sorted(os.listdir(store.root)) == [NAMESPACE_MARKER, ".journal", "c:0:0",
                                              "notes.txt", "routing_replay"]
    assert store.list() == []


def test_one_root_serves_one_namespace(store, tmp_path, np_rng):
    store.put("ns:0:0", rr_record("ns:0:0", routing(np_rng, "uint8", 1, 3)))
    other = FastDeployLocalStore(store.root, "another")
    assert other.get("ns:0:0") is not None  # reading is namespace-agnostic (no such level)
    for write in (lambda: other.put("ns:1:0", rr_record("ns:1:0", routing(np_rng, "uint8", 1, 3))),
                  lambda: other.delete(["ns:0:0"]), lambda: other.delete_prefix(["ns"]),
                  other.clear):
        with pytest.raises(PermanentStoreError, match="namespace 'ns'"):
            write()
    assert store.list() == ["ns:0:0"]
    fastdeploy_dir = tmp_path / "written_by_fastdeploy"
    (fastdeploy_dir / "fd:0:0").mkdir(parents=True)
    paddle.save(np.zeros((2, 4), np.uint8), str(fastdeploy_dir / "fd:0:0" / "layer_0.pdtensor"))
    unclaimed = FastDeployLocalStore(fastdeploy_dir, "any")
    assert unclaimed.list() == ["fd:0:0_0"] and unclaimed.delete(["fd:0:0"]) == 1


# -- opening, writers, only_last_turn --------------------------------------------------------------

def test_opened_by_url(tmp_path, np_rng):
    opened = open_store(f"local://{tmp_path}?layout=fastdeploy&max_model_len=16", "ns",
                        instrument=False)
    assert isinstance(opened, FastDeployLocalStore) and opened.max_model_len == 16
    assert "fastdeploy layout" in opened.describe()
    assert isinstance(open_store(f"local://{tmp_path}", "ns", instrument=False), LocalStore)
    # The URL's options are the section's keys, checked as declared (one validation for both).
    configured = open_store({"type": "local", "namespace": "ns", "local": {
        "root": str(tmp_path), "layout": "fastdeploy", "max_model_len": 16}}, instrument=False)
    assert isinstance(configured, FastDeployLocalStore) and configured.max_model_len == 16
    for bad, message in (("?layout=flat", r"store.local.layout: invalid value 'flat'"),
                         ("?layout=fastdeploy&max_model_len=0", r"store.local.max_model_len: must be >= 1"),
                         ("?layout=fastdeploy&max_model_len=x", r"store.local.max_model_len: invalid integer 'x'"),
                         ("?max_model_len=8", "max_model_len only applies to layout fastdeploy"),
                         ("?colour=red", r"unknown option\(s\) colour; known: root, fsync, layout, max_model_len")):
        with pytest.raises(ConfigError, match=message):
            open_store(f"local://{tmp_path}{bad}", "ns")


def test_only_last_turn_removes_the_previous_turns_directory(store, tmp_path, np_rng, make_writer):
    writer = make_writer(f"local://{tmp_path / 'r3'}?layout=fastdeploy&max_model_len={MAX_LEN}", "ns",
                         only_last_turn=True)
    ids = routing(np_rng, "uint8", 3, 6)
    for turn in range(3):
        rollout = f"mt_1:g0:{turn}:0"
        for layer in range(3):
            meta = {"layer": layer, "num_layers": 3}
            writer.submit_put(f"{rollout}_{layer}", RoutingRecord(rollout, ids[layer:layer + 1].copy(),
                                                                  200, metadata=meta, layers=(layer,)))
    assert store.list() == [f"mt_1:g0:2:0_{layer}" for layer in range(3)]
    assert sorted(os.listdir(store.root)) == [NAMESPACE_MARKER, "mt_1:g0:2:0"]


def test_background_writer_with_rr_v1_records(tmp_path, np_rng):
    from fd_routing_replay.writer import RoutingWriter

    url = f"local://{tmp_path / 'r3'}?layout=fastdeploy&max_model_len={MAX_LEN}"
    writer = RoutingWriter({"url": url, "namespace": "bg"},
                           {"mode": "thread", "journal_dir": str(tmp_path / "journal"),
                            "dead_letter_dir": str(tmp_path / "dead")}, only_last_turn=True)
    ids = routing(np_rng, "uint16", 2, 11)
    try:
        for turn in range(2):
            rollout = f"bg_7:{turn}:0"
            writer.submit_put(rollout, RoutingRecord(rollout, ids, 60000))
        assert writer.flush(timeout=60)
    finally:
        writer.close()
    directory = tmp_path / "r3"
    assert sorted(os.listdir(directory)) == [NAMESPACE_MARKER, "bg_7:1:0"]
    loaded = paddle.load(str(directory / "bg_7:1:0" / "bg_7:1:0.pdtensor"), return_numpy=True)
    np.testing.assert_array_equal(loaded, fastdeploy_padded(ids))
