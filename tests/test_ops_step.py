"""The library's bound entry points against the NumPy oracles (tests/ops_oracle.py) on seeded
random inputs and edge cases: the step recorder (record, offload, fill) and pack_request;
and every bound entry point refusing malformed arguments with an OpsError naming the
argument, before anything is written."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fd_routing_replay import ops
from fd_routing_replay.errors import OpsError
from fd_routing_replay.ops.dtypes import PD_ROUTING
from tests import ops_oracle as oracle
from tests.test_ops import DTYPES, EXPERTS, as_tensor, host, random_table


@pytest.fixture
def nprng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def random_ids(rng, num_tokens, top_k, experts, id_dtype, bad=True) -> np.ndarray:
    ids = rng.integers(0, experts, size=(num_tokens, top_k))
    if bad and num_tokens:
        mask = rng.random(ids.shape) < 0.05
        ids[mask] = rng.choice([-1, -9, experts, experts + 3], size=int(mask.sum()))
    return ids.astype(id_dtype)


def staging(buffer: paddle.Tensor, extra_bytes: int = 0) -> dict[str, np.ndarray]:
    shape = tuple(buffer.shape)
    return dict(host_rows=np.zeros(shape, PD_ROUTING.get(buffer.dtype)),
                host_counters=np.zeros(shape[1] + 1, np.int64), host_extra=np.zeros(extra_bytes, np.uint8))


# ----------------------------------------------------------------------------- the oracles

def test_the_record_oracle_matches_a_loop(nprng) -> None:
    buffer = random_table(nprng, np.uint16, (6, 2, 3))
    naive = buffer.copy()
    ids = random_ids(nprng, 4, 3, 40000, np.int64)
    errors = oracle.record_rows(buffer, ids, 1, 40000)
    loop_errors = 0
    for t in range(4):
        for k in range(3):
            ok = 0 <= ids[t, k] < 40000
            naive[t, 1, k] = ids[t, k] if ok else 65535
            loop_errors += not ok
    np.testing.assert_array_equal(buffer, naive)
    assert errors == loop_errors


def test_the_pack_oracle_matches_a_loop(nprng) -> None:
    cache = random_table(nprng, np.uint8, (24, 3, 2))
    row = nprng.permutation(6)[:4]
    got = oracle.pack_request(cache, row, 3, 14, 4)
    for t, p in enumerate(range(3, 14)):
        for layer in range(3):
            np.testing.assert_array_equal(got[layer, t], cache[row[p // 4] * 4 + p % 4, layer])


# ----------------------------------------------------------------------------- the recorder

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_recorder_matches_the_oracle(nprng, dtype, id_dtype) -> None:
    capacity, layers, top_k = 16, 5, int(nprng.choice([1, 2, 3, 4, 6, 8, 5]))
    experts = EXPERTS[dtype]
    layer_rows = [3, -1, 0, 4, 1, 2]                 # FastDeploy layer index -> our row; 1 is dense
    expected = random_table(nprng, dtype, (capacity, layers, top_k))
    buffer, counters = as_tensor(expected.copy()), paddle.zeros([layers + 1], "int64")
    expected_counters = np.zeros(layers + 1, np.int64)
    stage = staging(buffer)
    recorder = ops.bind_step_recorder(buffer, counters, num_experts=experts, layer_rows=layer_rows, **stage)
    busy_steps = 0
    for _step in range(3):
        num_tokens = int(nprng.choice([0, 1, capacity, nprng.integers(1, capacity)]))
        busy_steps += num_tokens > 0
        for fd_layer in nprng.permutation([0, 2, 3, 4, 5]):
            ids = random_ids(nprng, num_tokens, top_k, experts, id_dtype)
            recorder.record(as_tensor(ids), int(fd_layer), num_tokens)
            row = layer_rows[fd_layer]
            expected_counters[0] += oracle.record_rows(expected, ids, row, experts)
            expected_counters[1 + row] += num_tokens > 0
        recorder.offload(num_tokens)
        recorder.wait()
        np.testing.assert_array_equal(stage["host_rows"][:num_tokens], expected[:num_tokens])
        np.testing.assert_array_equal(stage["host_counters"], expected_counters)
    np.testing.assert_array_equal(host(buffer), expected)
    np.testing.assert_array_equal(counters.numpy(), expected_counters)
    assert counters.numpy()[1:].sum() == 5 * busy_steps       # an empty step counts nothing


def test_recorder_writes_only_its_layer_and_rows(nprng) -> None:
    initial = random_table(nprng, np.uint8, (8, 3, 4))
    buffer = as_tensor(initial.copy())
    counters = paddle.zeros([4], "int64")
    recorder = ops.bind_step_recorder(buffer, counters, num_experts=200, **staging(buffer))
    ids = np.array([[1, 2, 3, 4], [5, 6, 7, 199], [0, 200, -1, 9]], np.int64)
    recorder.record(as_tensor(ids), 1, 3)
    expected = initial.copy()
    expected[:3, 1] = [[1, 2, 3, 4], [5, 6, 7, 199], [0, 255, 255, 9]]
    np.testing.assert_array_equal(host(buffer), expected)
    np.testing.assert_array_equal(counters.numpy(), [2, 0, 1, 0])


def test_offload_copies_the_first_tokens_of_extra_and_fill_refills(nprng) -> None:
    buffer = ops.new_step_buffer(6, 2, 2, 16)
    counters = paddle.zeros([3], "int64")
    stage = staging(buffer, extra_bytes=6 * 8)
    recorder = ops.bind_step_recorder(buffer, counters, num_experts=16, **stage)
    ids = nprng.integers(0, 16, (4, 2))
    recorder.record(as_tensor(ids), 0, 4)
    recorder.record(as_tensor(ids[::-1].copy()), 1, 4)
    slots = paddle.to_tensor(np.array([9, 3, 7, 1, 55, 66], np.int64))    # FastDeploy's buffer is larger
    recorder.offload(4, slots)
    recorder.wait()
    np.testing.assert_array_equal(stage["host_extra"][:32].view(np.int64), [9, 3, 7, 1])
    assert not stage["host_extra"][32:].any()
    np.testing.assert_array_equal(stage["host_rows"][:4, 0], ids)
    np.testing.assert_array_equal(stage["host_rows"][:4, 1], ids[::-1])
    np.testing.assert_array_equal(stage["host_counters"], [0, 1, 1])
    recorder.fill()
    assert (host(buffer) == 255).all()


def test_an_empty_step_writes_and_counts_nothing() -> None:
    buffer = ops.new_step_buffer(4, 2, 2, 16)
    counters = paddle.zeros([3], "int64")
    recorder = ops.bind_step_recorder(buffer, counters, num_experts=16, **staging(buffer))
    recorder.record(as_tensor(np.zeros((0, 2), np.int64)), 0, 0)
    recorder.offload(0)
    assert (host(buffer) == 255).all() and not counters.numpy().any()


def test_record_refuses_without_writing() -> None:
    buffer = ops.new_step_buffer(4, 2, 2, 16)
    counters = paddle.zeros([3], "int64")
    stage = staging(buffer, extra_bytes=8)
    recorder = ops.bind_step_recorder(buffer, counters, num_experts=16, layer_rows=[1, -1, 0], **stage)
    ids = as_tensor(np.ones((3, 2), np.int64))
    strided = as_tensor(np.ones((3, 4), np.int64))[:, :2]
    for call, needle in [
        (lambda: recorder.record(ids, 0, 2), "3 routed rows for 2 tokens"),
        (lambda: recorder.record(as_tensor(np.ones((5, 2), np.int64)), 0), "exceed the step buffer's 4 rows"),
        (lambda: recorder.record(ids, 1), "MoE layer 1 is not in the layer map"),      # a dense layer
        (lambda: recorder.record(ids, 3), "MoE layer 3 is not in the layer map"),      # past the map
        (lambda: recorder.record(as_tensor(np.ones((3, 3), np.int64)), 0), r"top_k = 2, got \[3, 3\]"),
        (lambda: recorder.record(as_tensor(np.ones(3, np.int64)), 0), r"topk_ids must be \[num_tokens, top_k\]"),
        (lambda: recorder.record(ids.astype("float32"), 0), "topk_ids must be int32 or int64, got float32"),
        (lambda: recorder.record(np.ones((3, 2), np.int64), 0), "topk_ids must be a paddle.Tensor"),
        (lambda: recorder.record(strided, 0), "topk_ids must be contiguous"),
        (lambda: recorder.offload(5), "offload of 5 rows from a step buffer of 4"),
        (lambda: recorder.offload(-1), "offload of -1 rows"),
        (lambda: recorder.offload(2, np.zeros(2, np.int64)), "extra must be a paddle.Tensor"),
        (lambda: recorder.offload(2, paddle.zeros([4], "int64")), "extra has 16 bytes .* host_extra holds 8"),
    ]:
        with pytest.raises(OpsError, match=needle):
            call()
    assert (host(buffer) == 255).all() and not counters.numpy().any()
    assert not stage["host_rows"].any() and not stage["host_extra"].any()


def _bind_arguments() -> dict:
    buffer = ops.new_step_buffer(4, 2, 3, 16)
    return dict(buffer=buffer, counters=paddle.zeros([3], "int64"), num_experts=16, layer_rows=None,
                **staging(buffer, extra_bytes=8))


BAD_BIND = [
    ("buffer", lambda a: a["buffer"].reshape([4, 6]), r"buffer must be 3-D .* got shape \[4, 6\]"),
    ("buffer", lambda a: np.full((4, 2, 3), 255, np.uint8), "buffer must be a paddle.Tensor, got a uint8 array"),
    ("buffer", lambda a: paddle.zeros([4, 2, 3], "float32"), "buffer must be uint8, uint16 or uint32 .* float32"),
    ("buffer", lambda a: paddle.empty([4, 2, 3], dtype=paddle.bfloat16), "got bfloat16: Paddle's dtype string"),
    ("buffer", lambda a: ops.new_step_buffer(4, 4, 3, 16)[:, :2], "buffer must be contiguous"),
    ("counters", lambda a: paddle.zeros([2], "int64"), r"counters must be .* \[1 \+ num_layers\] = \[3\]"),
    ("counters", lambda a: paddle.zeros([3], "int32"), "counters must be a contiguous int64 tensor"),
    ("counters", lambda a: np.zeros(3, np.int64), "counters must be a paddle.Tensor"),
    ("num_experts", lambda a: 16.0, "num_experts must be an integer, got a float"),
    ("num_experts", lambda a: True, "num_experts must be an integer"),
    ("num_experts", lambda a: 0, "num_experts=0 does not fit"),
    ("num_experts", lambda a: 256, "num_experts=256 does not fit the buffer's dtype: 1 to 255"),
    ("layer_rows", lambda a: [0, 2], r"layer_rows\[1\] = 2 is outside the buffer's 2 layers"),
    ("layer_rows", lambda a: [0, 1.0], r"layer_rows\[1\] must be an integer"),
    ("layer_rows", lambda a: 3, "layer_rows must be None or a sequence of ints"),
    ("host_rows", lambda a: np.zeros((4, 2, 3), np.uint16), "host_rows must be a C-contiguous writeable 3-D uint8"),
    ("host_rows", lambda a: np.zeros((4, 2, 4), np.uint8), r"host_rows must have the buffer's shape \[4, 2, 3\]"),
    ("host_rows", lambda a: np.zeros((4, 3, 2), np.uint8).transpose(0, 2, 1), "non-contiguous"),
    ("host_rows", lambda a: np.zeros((4, 2, 3), np.uint8).view(np.int8), "host_rows must be"),
    ("host_counters", lambda a: np.zeros(2, np.int64), r"host_counters must be int64 \[1 \+ num_layers\] = \[3\]"),
    ("host_counters", lambda a: np.zeros(3, np.float64), "host_counters must be a C-contiguous writeable 1-D int64"),
    ("host_extra", lambda a: np.zeros((2, 4), np.uint8), "host_extra must be a C-contiguous writeable 1-D uint8"),
    ("host_extra", lambda a: [0] * 8, "host_extra must be .* got a list"),
]


@pytest.mark.parametrize(("name", "make_bad", "needle"), BAD_BIND)
def test_bind_step_recorder_refuses_malformed_arguments(name, make_bad, needle) -> None:
    arguments = _bind_arguments()
    arguments[name] = make_bad(arguments)
    with pytest.raises(OpsError, match=needle):
        ops.bind_step_recorder(arguments.pop("buffer"), arguments.pop("counters"), **arguments)


def test_bind_step_recorder_refuses_read_only_staging() -> None:
    arguments = _bind_arguments()
    arguments["host_rows"].setflags(write=False)
    with pytest.raises(OpsError, match="host_rows must be a C-contiguous writeable .* read-only uint8"):
        ops.bind_step_recorder(arguments.pop("buffer"), arguments.pop("counters"), **arguments)


# ----------------------------------------------------------------------------- pack_request

@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_request_matches_the_oracle(nprng, dtype) -> None:
    """Every start, a ragged last block, int32/int64 rows, 1-9 ids a row (the fixed-size and
    the general copies), into a new array or a given one."""
    pack = ops.request_packer()
    block_size, blocks = 4, 12
    for top_k in (8, 1, 3, nprng.integers(1, 10)):
        cache = random_table(nprng, dtype, (blocks * block_size, 5, int(top_k)))
        for row_dtype in (np.int32, np.int64):
            row = nprng.permutation(blocks)[:7].astype(row_dtype)
            for length in (0, 1, 4, 13, 28):
                for start in sorted({0, length // 2, length}):
                    want = oracle.pack_request(cache, row, start, length, block_size)
                    got = pack(cache, row, start, length, block_size)
                    assert got.dtype == cache.dtype and got.flags.c_contiguous
                    np.testing.assert_array_equal(got, want)
                    out = np.full(want.shape, 7, dtype)
                    assert pack(cache, row, start, length, block_size, out) is out
                    np.testing.assert_array_equal(out, want)


def test_pack_request_of_a_large_request_is_exact(nprng) -> None:
    """Over 1 MiB (the copy releases the GIL): 5000 tokens x 60 layers x top-8."""
    cache = random_table(nprng, np.uint8, (8192, 60, 8))
    row = nprng.permutation(128).astype(np.int64)
    np.testing.assert_array_equal(ops.request_packer()(cache, row, 17, 5017, 64),
                                  oracle.pack_request(cache, row, 17, 5017, 64))


def _pack_arguments() -> dict:
    cache = np.arange(16 * 2 * 3, dtype=np.uint8).reshape(16, 2, 3)
    return dict(cache=cache, block_row=np.array([2, 0, 3], np.int64), start=1, length=9, block_size=4,
                out=np.full((2, 8, 3), 7, np.uint8))


BAD_PACK = [
    ("block_row", lambda a: np.array([2.0, 0.0, 3.0]), "block_row must be a C-contiguous 1-D int32/int64 "
                                                        r"numpy array, got a float64 array of shape \(3,\)"),
    ("block_row", lambda a: np.array([[2, 0, 3]]), r"block_row .* got an int64 array of shape \(1, 3\)"),
    ("block_row", lambda a: np.array([2, 0, 3], np.uint64), "block_row must be"),
    ("block_row", lambda a: [2, 0, 3], "block_row must be .* got a list"),
    ("block_row", lambda a: np.array([2, -1, 3]), "block_row: 4 of 8 positions have no KV block"),
    ("block_row", lambda a: np.array([2, 0]), "block_row: 9 positions need 3 blocks; the block table has 2"),
    ("block_row", lambda a: np.array([2, 0, 4]), "block_row: position 8 maps to KV slot 16, outside"),
    ("start", lambda a: -1, "start must be >= 0, got -1"),
    ("start", lambda a: 1.0, "start must be an integer, got a float"),
    ("length", lambda a: 0, "length must be >= start, got length=0, start=1"),
    ("block_size", lambda a: 0, "block_size must be positive, got 0"),
    ("cache", lambda a: a["cache"].astype(np.int16), "cache must be a C-contiguous 3-D uint8/uint16/uint32"),
    ("cache", lambda a: a["cache"][:, :, ::-1], "cache must be .* non-contiguous"),
    ("cache", lambda a: a["cache"][0], "cache must be .* 3-D"),
    ("cache", lambda a: paddle.to_tensor(a["cache"]), "cache must be .* got a"),
    ("out", lambda a: np.zeros((2, 8, 3), np.uint16), "out must be a C-contiguous writeable 3-D uint8"),
    ("out", lambda a: np.zeros((2, 9, 3), np.uint8), r"out must be of shape \[2, 8, 3\]"),
    ("out", lambda a: np.zeros((2, 16, 3), np.uint8)[:, ::2], "out must be .* non-contiguous"),
    ("out", lambda a: np.zeros((2, 8, 3), np.uint8).tobytes(), "out must be .* got a bytes"),
]


@pytest.mark.parametrize(("name", "make_bad", "needle"), BAD_PACK)
def test_pack_request_refuses_malformed_arguments_before_writing(name, make_bad, needle) -> None:
    arguments = _pack_arguments()
    out = arguments["out"]
    arguments[name] = make_bad(arguments)
    with pytest.raises(OpsError, match=needle):
        ops.request_packer()(**arguments)
    assert (out == 7).all()


def test_pack_request_refuses_a_read_only_out() -> None:
    arguments = _pack_arguments()
    arguments["out"].setflags(write=False)
    with pytest.raises(OpsError, match="out must be a C-contiguous writeable .* read-only"):
        ops.request_packer()(**arguments)


# ----------------------------------------------------------------------------- flush, ledger

def _flush_arguments() -> dict:
    return dict(cache=np.full((16, 4, 2), 255, np.uint8), staging=np.zeros((8, 3, 2), np.uint8),
                extra=np.zeros(64, np.uint8), host_counters=np.zeros(4, np.int64), seen=np.zeros(4, np.int64),
                delta=np.zeros(4, np.int64), columns=np.array([1, 2, 3], np.int64))


BAD_FLUSH = [
    ("cache", lambda a: a["cache"][:, :, 0], "cache must be a C-contiguous writeable 3-D uint8/uint16/uint32"),
    ("cache", lambda a: a["cache"].astype(np.float32), r"cache .* got a float32 array of shape \(16, 4, 2\)"),
    ("staging", lambda a: a["staging"].astype(np.uint16), "staging must have the cache's dtype"),
    ("staging", lambda a: np.zeros((8, 3, 4), np.uint8), r"staging must have the cache's top_k \(2\)"),
    ("staging", lambda a: np.zeros((0, 3, 2), np.uint8), "staging must have at least one row"),
    ("extra", lambda a: np.zeros(64, np.int8), "extra must be a C-contiguous 1-D uint8"),
    ("host_counters", lambda a: np.zeros(3, np.int64), r"host_counters must be int64 \[1 \+ L\] = \[4\]"),
    ("seen", lambda a: np.zeros(5, np.int64), r"seen must be int64 \[4\] like host_counters"),
    ("delta", lambda a: np.zeros(4, np.int32), "delta must be a C-contiguous writeable 1-D int64"),
    ("columns", lambda a: np.array([1, 2, 4]), r"columns\[2\] = 4 is outside the cache's 4 rows"),
    ("columns", lambda a: np.array([1, 2]), "columns must hold one cache row per staged layer"),
    ("columns", lambda a: np.array([1.0, 2.0, 3.0]), "columns must be a C-contiguous 1-D int64"),
    ("columns", lambda a: None, "columns must name the cache row of each staged layer"),
]


@pytest.mark.parametrize(("name", "make_bad", "needle"), BAD_FLUSH)
def test_bind_step_flush_refuses_malformed_arguments(name, make_bad, needle) -> None:
    arguments = _flush_arguments()
    arguments[name] = make_bad(arguments)
    with pytest.raises(OpsError, match=needle):
        ops.bind_step_flush(**arguments)


def test_flush_refuses_a_step_that_does_not_fit() -> None:
    arguments = _flush_arguments()
    flush = ops.bind_step_flush(**arguments)
    for call, needle in [(lambda: flush.flush(9, 8, False), "num_tokens=9 does not fit the staging"),
                         (lambda: flush.flush(4, 3, False), "slots_itemsize has item size 3"),
                         (lambda: flush.flush(-1, 8, False), "num_tokens=-1")]:
        with pytest.raises(OpsError, match=needle):
            call()
    assert (arguments["cache"] == 255).all() and not arguments["seen"].any()


def _ledger_arguments() -> dict:
    return dict(registered=np.zeros(3, bool), forwarded=np.zeros(3, np.int64), damaged=np.zeros(3, bool),
                tokens=np.zeros((4, 16), np.int64), slots=np.zeros((5, 3), np.int64),
                finished=np.zeros((2, 3), np.int64), block_table=np.zeros((3, 4), np.int32), block_size=4,
                max_model_len=16, cache=np.full((48, 2, 2), 255, np.uint8), staging=np.zeros((16, 2, 2), np.uint8),
                host_counters=np.zeros(3, np.int64), seen=np.zeros(3, np.int64), delta=np.zeros(3, np.int64))


BAD_LEDGER = [
    ("registered", lambda a: np.zeros(3, np.uint8), "registered must be a C-contiguous 1-D bool"),
    ("forwarded", lambda a: np.zeros(3, np.int32), "forwarded must be a C-contiguous writeable 1-D int64"),
    ("forwarded", lambda a: np.zeros(4, np.int64), r"forwarded must be int64 \[3\] like registered"),
    ("damaged", lambda a: np.zeros(2, bool), r"damaged must be bool \[3\]"),
    ("tokens", lambda a: np.zeros((3, 16), np.int64), r"tokens must be int64 \[4, T\]"),
    ("slots", lambda a: np.zeros((5, 4), np.int64), r"slots must be int64 \[5, 3\]"),
    ("finished", lambda a: np.zeros(3, np.int64), "finished must be a C-contiguous writeable 2-D int64"),
    ("block_table", lambda a: np.zeros((3, 4), np.float32), "block_table must be a C-contiguous 2-D int32/int64"),
    ("block_table", lambda a: np.zeros(12, np.int64), "block_table must be .* 2-D"),
    ("block_size", lambda a: 0, "block_size must be positive, got 0"),
    ("max_model_len", lambda a: -1, "max_model_len must be positive"),
    ("cache", lambda a: np.zeros((48, 2, 2), np.int64), "cache must be a C-contiguous writeable uint8/uint16/uint32"),
    ("staging", lambda a: np.zeros((16, 2, 3), np.uint8), "staging rows must have the cache's row size"),
    ("host_counters", lambda a: np.zeros(4, np.int64), r"host_counters must be int64 \[1 \+ L\] for the staging's"),
    ("seen", lambda a: np.zeros(3, np.float64), "seen must be a C-contiguous writeable 1-D int64"),
]


@pytest.mark.parametrize(("name", "make_bad", "needle"), BAD_LEDGER)
def test_bind_step_ledger_refuses_malformed_arguments(name, make_bad, needle) -> None:
    arguments = _ledger_arguments()
    arguments[name] = make_bad(arguments)
    with pytest.raises(OpsError, match=needle):
        ops.bind_step_ledger(**arguments)


def test_the_well_formed_arguments_bind() -> None:
    """The baselines of the refusal tests above are accepted (so each refusal is its change's)."""
    arguments = _bind_arguments()
    assert ops.bind_step_recorder(arguments.pop("buffer"), arguments.pop("counters"), **arguments).pinned is False
    assert ops.bind_step_flush(**_flush_arguments()).flush(0, 8, False) == (0, 0, 3, 0)
    assert ops.bind_step_ledger(**_ledger_arguments()).capacity == 16
    arguments = _pack_arguments()
    out = ops.request_packer()(**arguments)
    np.testing.assert_array_equal(out, oracle.pack_request(arguments["cache"], arguments["block_row"], 1, 9, 4))
