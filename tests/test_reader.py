"""RoutingReader against real stores, with records made from random routing."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

from fd_routing_replay.codec import RoutingRecord, encode_record
from fd_routing_replay.errors import InvalidRolloutId, RecordError
from fd_routing_replay.reader import RoutingReader, pad_to, to_paddle, to_replay_list
from fd_routing_replay.store.local import LocalStore
from fd_routing_replay.store.memory import MemoryStore


def make_record(rng: np.random.Generator, rollout_id: str, num_experts: int = 300,
                shape: tuple[int, int, int] = (3, 17, 4)) -> RoutingRecord:
    dtype = np.uint8 if num_experts < 255 else np.uint16
    ids = rng.integers(0, num_experts, size=shape).astype(dtype)
    ids[:, -2:, :] = np.iinfo(dtype).max  # unrouted tail
    return RoutingRecord(rollout_id=rollout_id, ids=ids, num_experts=num_experts)


@pytest.fixture
def np_rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.fixture
def store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path, "reader")


def test_get_returns_exact_ids(store, np_rng):
    record = make_record(np_rng, "exp_1:0:0")
    store.put("exp_1:0:0", encode_record(record))
    got = RoutingReader(store).get("exp_1:0:0")
    assert got.rollout_id == "exp_1:0:0"
    np.testing.assert_array_equal(got.ids, record.ids)
    assert got.ids.dtype == np.uint16 and got.num_experts == 300


def test_missing_record_is_none_and_wait_times_out(store):
    reader = RoutingReader(store)
    assert reader.get("exp_1:0:0") is None
    with pytest.raises(TimeoutError, match="exp_1:0:0"):
        reader.wait("exp_1:0:0", timeout=0.05, poll_interval=0.01)


def test_wait_returns_once_written(store, np_rng):
    record = make_record(np_rng, "exp_2:1:0")
    reader = RoutingReader(store)
    written = threading.Event()

    def write_later() -> None:
        written.wait()
        store.put("exp_2:1:0", encode_record(record))

    thread = threading.Thread(target=write_later)
    thread.start()
    written.set()
    got = reader.wait("exp_2:1:0", timeout=30, poll_interval=0.005)
    thread.join()
    np.testing.assert_array_equal(got.ids, record.ids)


def test_get_many_keeps_order_and_reports_missing(store, np_rng):
    ids = ["exp_3:0:0", "exp_3:1:0", "exp_3:2:0"]
    records = {rid: make_record(np_rng, rid) for rid in ids[:2]}
    for rid, record in records.items():
        store.put(rid, encode_record(record))
    got = RoutingReader(store).get_many(ids)
    assert list(got) == ids and got["exp_3:2:0"] is None
    for rid, record in records.items():
        np.testing.assert_array_equal(got[rid].ids, record.ids)


def test_per_layer_records(store, np_rng):
    record = make_record(np_rng, "exp_4:0:0", shape=(1, 9, 4))
    store.put("exp_4:0:0_5", encode_record(record))
    np.testing.assert_array_equal(RoutingReader(store).get_layer("exp_4:0:0", 5).ids, record.ids)
    assert RoutingReader(store).get_layer("exp_4:0:0", 6) is None


def test_record_under_wrong_key_is_rejected(store, np_rng):
    store.put("exp_5:0:0", encode_record(make_record(np_rng, "exp_5:1:0")))
    with pytest.raises(RecordError, match="belongs to rollout 'exp_5:1:0'"):
        RoutingReader(store).get("exp_5:0:0")


def test_out_of_range_expert_ids_are_rejected(store, np_rng):
    record = make_record(np_rng, "exp_6:0:0", num_experts=300)
    record.ids[1, 3, 2] = 300  # == num_experts, not the fill
    store.put("exp_6:0:0", encode_record(record))
    with pytest.raises(RecordError, match="300"):
        RoutingReader(store).get("exp_6:0:0")


def test_corrupt_record_names_the_rollout(store, np_rng):
    data = bytearray(encode_record(make_record(np_rng, "exp_7:0:0")))
    data[-1] ^= 0xFF
    store.put("exp_7:0:0", data)
    with pytest.raises(RecordError, match="exp_7:0:0"):
        RoutingReader(store).get("exp_7:0:0")


def test_malformed_rollout_id_is_rejected(store):
    with pytest.raises(InvalidRolloutId):
        RoutingReader(store).get("../etc:0:0")


def test_reader_opens_a_store_from_a_url(tmp_path, np_rng):
    record = make_record(np_rng, "exp_8:0:0")
    LocalStore(tmp_path, "urlns").put("exp_8:0:0", encode_record(record))
    with RoutingReader(f"local://{tmp_path}", namespace="urlns") as reader:
        np.testing.assert_array_equal(reader.get("exp_8:0:0").ids, record.ids)


def test_reader_in_another_process(tmp_path, np_rng):
    record = make_record(np_rng, "exp_9:0:0")
    LocalStore(tmp_path, "xproc").put("exp_9:0:0", encode_record(record))
    script = (
        "import sys, numpy as np\n"
        "from fd_routing_replay.reader import RoutingReader\n"
        f"r = RoutingReader('local://{tmp_path}', namespace='xproc').get('exp_9:0:0')\n"
        "sys.stdout.write(r.ids.tobytes().hex())\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout
    assert bytes.fromhex(out) == record.ids.tobytes()


def test_pad_to_and_conversions(np_rng):
    record = make_record(np_rng, "exp_10:0:0", num_experts=64, shape=(2, 5, 3))
    padded = pad_to(record.ids, 8)
    assert padded.shape == (2, 8, 3)
    np.testing.assert_array_equal(padded[:, :5], record.ids)
    assert (padded[:, 5:] == 255).all()
    with pytest.raises(ValueError, match="shorter"):
        pad_to(record.ids, 4)
    tensor = to_paddle(record.ids)
    np.testing.assert_array_equal(tensor.numpy(), record.ids.astype(np.int64))
    layers = to_replay_list(record)
    assert len(layers) == 2 and layers[0].shape == (5, 3) and layers[0].dtype == np.int64
    expected = record.ids.astype(np.int64)
    expected[record.ids == 255] = -1
    np.testing.assert_array_equal(np.stack(layers), expected)


def test_memory_store_reader(np_rng):
    store = MemoryStore("reader-mem", "ns")
    record = make_record(np_rng, "exp_11:0:0")
    store.put("exp_11:0:0", encode_record(record))
    np.testing.assert_array_equal(RoutingReader(store).get("exp_11:0:0").ids, record.ids)


# -- FastDeploy's local layout (fastdeploy-raw .pdtensor files) ------------------------------------

def _fd_routing(np_rng, layers: int, tokens: int, dtype=np.uint16) -> np.ndarray:
    high = 254 if dtype == np.uint8 else 65534
    return np_rng.integers(257 if dtype != np.uint8 else 0, high, size=(layers, tokens, 4),
                           endpoint=True).astype(dtype)


def _fd_put_layers(store, rollout_id: str, ids: np.ndarray, layers=None) -> None:
    for layer in layers if layers is not None else range(ids.shape[0]):
        num_experts = int(np.iinfo(ids.dtype).max)
        record = RoutingRecord(rollout_id, np.ascontiguousarray(ids[layer:layer + 1]),
                               num_experts)
        store.put(f"{rollout_id}_{layer}", encode_record(record))


@pytest.fixture
def fd_store(tmp_path):
    from fd_routing_replay.store.local.fastdeploy import FastDeployLocalStore

    return FastDeployLocalStore(tmp_path / "fd", "reader", max_model_len=32)


def test_fastdeploy_fused_file_is_read_trimmed(fd_store, np_rng):
    ids = _fd_routing(np_rng, 3, 19)
    ids[:, 5] = 65535  # an inner token without routing stays
    fd_store.put("fd_1:0:0", encode_record(RoutingRecord("fd_1:0:0", ids, 60000)))
    got = RoutingReader(fd_store).get("fd_1:0:0")
    np.testing.assert_array_equal(got.ids, ids)
    assert got.ids.dtype == np.uint16 and got.fill_value == 65535
    assert got.metadata == {"format": "fastdeploy-raw", "num_tokens": 19, "max_model_len": 32}


def test_fastdeploy_per_layer_rollout_is_assembled(fd_store, np_rng):
    ids = _fd_routing(np_rng, 4, 7, np.uint8)
    _fd_put_layers(fd_store, "fd_2:0:0", ids)
    reader = RoutingReader(fd_store)
    got = reader.get("fd_2:0:0")
    assert got.ids.shape == (4, 7, 4) and got.ids.flags.c_contiguous
    np.testing.assert_array_equal(got.ids, ids)
    assert got.metadata["num_layers"] == 4 and got.metadata["format"] == "fastdeploy-raw"
    assert got.layer_map == (0, 1, 2, 3)
    np.testing.assert_array_equal(reader.get_layer("fd_2:0:0", 2).ids, ids[2:3])


def test_per_layer_rollout_waits_for_all_layers_with_num_layers(fd_store, np_rng):
    ids = _fd_routing(np_rng, 4, 6)
    _fd_put_layers(fd_store, "fd_3:0:0", ids, layers=[0, 1, 3])
    assert RoutingReader(fd_store, num_layers=4).get("fd_3:0:0") is None
    with pytest.raises(RecordError, match=r"layers \[2\] of 0..3 are missing"):
        RoutingReader(fd_store).get("fd_3:0:0")
    reader = RoutingReader(fd_store, num_layers=4)
    thread = threading.Timer(0.05, lambda: _fd_put_layers(fd_store, "fd_3:0:0", ids, layers=[2]))
    thread.start()
    got = reader.wait("fd_3:0:0", timeout=30, poll_interval=0.005)
    thread.join()
    np.testing.assert_array_equal(got.ids, ids)
    with pytest.raises(RecordError, match="layer 3 stored, but num_layers is 3"):
        RoutingReader(fd_store, num_layers=3).get("fd_3:0:0")
    _fd_put_layers(fd_store, "fd_3:1:0", ids, layers=[1, 2])
    assert RoutingReader(fd_store).get("fd_3:1:0") is None  # layer 0 not there yet


def test_files_written_by_fastdeploy_itself_are_read(tmp_path, np_rng):
    paddle = pytest.importorskip("paddle", reason="paddle.save writes FastDeploy's files")
    ids = _fd_routing(np_rng, 2, 9)
    padded = np.full((2, 16, 4), 65535, np.uint16)
    padded[:, :9] = ids
    (tmp_path / "fd_4:0:0").mkdir()
    paddle.save(padded, str(tmp_path / "fd_4:0:0" / "fd_4:0:0.pdtensor"))
    (tmp_path / "fd_5:0:0").mkdir()
    for layer in range(2):
        paddle.save(padded[layer], str(tmp_path / "fd_5:0:0" / f"layer_{layer}.pdtensor"))
    with RoutingReader(f"local://{tmp_path}?layout=fastdeploy") as reader:
        np.testing.assert_array_equal(reader.get("fd_4:0:0").ids, ids)
        np.testing.assert_array_equal(reader.get("fd_5:0:0").ids, ids)


def test_corrupt_pdtensor_names_the_rollout(fd_store, np_rng):
    fd_store.put("fd_6:0:0", encode_record(RoutingRecord("fd_6:0:0", _fd_routing(np_rng, 1, 3),
                                                         60000)))
    path = fd_store.path_of("fd_6:0:0")
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(RecordError, match="fd_6:0:0"):
        RoutingReader(fd_store).get("fd_6:0:0")


def test_rr_v1_per_layer_records_are_assembled_with_their_layer_map(store, np_rng):
    ids = make_record(np_rng, "exp_12:0:0", shape=(3, 8, 4)).ids
    for row, global_layer in enumerate((3, 4, 7)):
        record = RoutingRecord("exp_12:0:0", np.ascontiguousarray(ids[row:row + 1]), 300,
                               metadata={"layer": row}, layers=(global_layer,))
        store.put(f"exp_12:0:0_{row}", encode_record(record))
    got = RoutingReader(store).get("exp_12:0:0")
    np.testing.assert_array_equal(got.ids, ids)
    assert got.layer_map == (3, 4, 7) and "layer" not in got.metadata
    store.put("exp_12:0:0_1", encode_record(RoutingRecord(
        "exp_12:0:0", np.ascontiguousarray(ids[1:2, :5]), 300, layers=(4,))))
    with pytest.raises(RecordError, match="layers must agree"):
        RoutingReader(store).get("exp_12:0:0")


def test_raw_fastdeploy_values_are_read_with_their_geometry(rng):
    """FastDeploy's P2PStore values carry no header: the reader takes the geometry."""
    import numpy as np

    from fd_routing_replay.errors import RecordError
    from fd_routing_replay.reader import RawGeometry, RoutingReader
    from fd_routing_replay.store import open_store

    gen = np.random.default_rng(rng.randrange(2**32))
    store = open_store("memory://raw-geometry-test")
    ids = gen.integers(0, 300, size=(3, 11, 4)).astype(np.uint16)       # ids > 256: no bf16 mix-up
    padded = np.full((3, 32, 4), np.iinfo(np.uint16).max, dtype=np.uint16)
    padded[:, :11] = ids
    store.put("exp_9:0:0", padded.tobytes())                             # fused, FastDeploy's bytes
    for layer in range(3):
        store.put(f"exp_9:0:1_{layer}", np.ascontiguousarray(padded[layer]).tobytes())
    with pytest.raises(RecordError, match="raw geometry"):
        RoutingReader(store).get("exp_9:0:0")
    raw = RawGeometry.parse("top_k=4,dtype=uint16,num_layers=3,num_experts=300")
    reader = RoutingReader(store, raw_geometry=raw)
    np.testing.assert_array_equal(reader.get("exp_9:0:0").ids, ids)
    np.testing.assert_array_equal(reader.get("exp_9:0:1").ids, ids)      # per layer, assembled
    with pytest.raises(RecordError, match="not a multiple"):
        RoutingReader(store, raw_geometry=RawGeometry(top_k=5, dtype="uint16", num_layers=3)).get("exp_9:0:0")
    with pytest.raises(ValueError, match="top_k and dtype are required"):
        RawGeometry.parse("num_layers=3")
