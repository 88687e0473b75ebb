"""The token-major step buffer ops: record_rows (Paddle op) and the bound StepRecorder,
both against the numpy reference on random inputs and edge cases."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fd_routing_replay import ops
from fd_routing_replay.errors import OpsError
from fd_routing_replay.ops import reference as ref
from fd_routing_replay.ops.dtypes import NP_ROUTING, PD_ROUTING
from fd_routing_replay.ops.step import ReferenceStepRecorder
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


def staging(buffer: paddle.Tensor, extra_bytes: int = 0):
    shape = tuple(buffer.shape)
    dtype = PD_ROUTING.get(buffer.dtype)
    return dict(host_rows=np.zeros(shape, dtype), host_counters=np.zeros(shape[1] + 1, np.int64),
                host_extra=np.zeros(extra_bytes, np.uint8))


def recorders(buffer, counters, experts, layer_rows=None, extra_bytes=0):
    """The compiled (bound) recorder, and the reference twin on a copy of the same state."""
    twin_buffer = as_tensor(host(buffer).copy())
    twin_counters = paddle.to_tensor(counters.numpy())
    bound_staging, twin_staging = staging(buffer, extra_bytes), staging(buffer, extra_bytes)
    bound = ops.bind_step_recorder(buffer, counters, num_experts=experts, layer_rows=layer_rows,
                                   **bound_staging)
    twin = ReferenceStepRecorder(twin_buffer, twin_counters, experts, list(layer_rows or []),
                                 twin_staging["host_rows"], twin_staging["host_counters"],
                                 twin_staging["host_extra"])
    return (bound, buffer, counters, bound_staging), (twin, twin_buffer, twin_counters, twin_staging)


def test_the_bound_entry_points_are_in_use() -> None:
    if ops.ops_backend() != "compiled":
        pytest.skip("the reference backend has no bound entry points")
    assert ops.bound_backend() == "bound", ops.bound_backend()


def test_new_step_buffer_is_filled_real_dtype() -> None:
    for dtype in DTYPES:
        buffer = ops.new_step_buffer(5, 3, 4, EXPERTS[dtype])
        assert buffer.dtype == NP_ROUTING[np.dtype(dtype)] and list(buffer.shape) == [5, 3, 4]
        assert (host(buffer) == np.iinfo(dtype).max).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_record_rows_op_matches_reference(nprng, dtype, id_dtype) -> None:
    capacity, layers, top_k = 12, 4, int(nprng.choice([1, 3, 6, 8]))
    experts = EXPERTS[dtype]
    initial = random_table(nprng, dtype, (capacity, layers, top_k))
    buffer, expected = as_tensor(initial.copy()), initial.copy()
    counters = paddle.zeros([layers + 1], "int64")
    expected_counters = np.zeros(layers + 1, np.int64)
    for layer in nprng.permutation(layers):
        num_tokens = int(nprng.choice([0, 1, capacity, nprng.integers(1, capacity)]))
        ids = random_ids(nprng, num_tokens, top_k, experts, id_dtype)
        ops.record_rows(buffer, as_tensor(ids), int(layer), counters, num_experts=experts)
        expected_counters[0] += ref.record_rows_np(expected, ids, int(layer), experts)
        expected_counters[1 + layer] += num_tokens > 0
    np.testing.assert_array_equal(host(buffer), expected)
    np.testing.assert_array_equal(counters.numpy(), expected_counters)


def test_record_rows_reference_matches_a_loop(nprng) -> None:
    buffer = random_table(nprng, np.uint16, (6, 2, 3))
    naive = buffer.copy()
    ids = random_ids(nprng, 4, 3, 40000, np.int64)
    errors = ref.record_rows_np(buffer, ids, 1, 40000)
    loop_errors = 0
    for t in range(4):
        for k in range(3):
            ok = 0 <= ids[t, k] < 40000
            naive[t, 1, k] = ids[t, k] if ok else 65535
            loop_errors += not ok
    np.testing.assert_array_equal(buffer, naive)
    assert errors == loop_errors


def test_record_rows_op_rejects_bad_arguments() -> None:
    buffer = ops.new_step_buffer(4, 2, 2, 16)
    counters = paddle.zeros([3], "int64")
    ids = as_tensor(np.zeros((2, 2), np.int64))
    cases = [
        (lambda: ops.record_rows(buffer, as_tensor(np.zeros((5, 2), np.int64)), 0, counters), "holds 4"),
        (lambda: ops.record_rows(buffer, as_tensor(np.zeros((2, 3), np.int64)), 0, counters), "top_k"),
        (lambda: ops.record_rows(buffer, ids, 2, counters), "layer"),
        (lambda: ops.record_rows(buffer, ids, 0, paddle.zeros([2], "int64")), "counters"),
        (lambda: ops.record_rows(buffer, ids.astype("float32"), 0, counters), "int32 or int64"),
        (lambda: ops.record_rows(buffer, ids, 0, counters, num_experts=300), "num_experts"),
    ]
    for call, needle in cases:
        with pytest.raises(OpsError, match=needle):
            call()
    assert (host(buffer) == 255).all() and not counters.numpy().any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_bound_recorder_matches_its_reference_twin(nprng, dtype, id_dtype) -> None:
    capacity, layers, top_k = 16, 5, int(nprng.choice([2, 4, 6, 8, 5]))
    experts = EXPERTS[dtype]
    layer_rows = [3, -1, 0, 4, 1, 2]                 # FastDeploy layer index -> our row; 1 is dense
    initial = random_table(nprng, dtype, (capacity, layers, top_k))
    (bound, buffer, counters, stage), (twin, twin_buffer, twin_counters, twin_stage) = recorders(
        as_tensor(initial), paddle.zeros([layers + 1], "int64"), experts, layer_rows)
    busy_steps = 0
    for _step in range(3):
        num_tokens = int(nprng.integers(0, capacity + 1))
        busy_steps += num_tokens > 0
        for fd_layer in (0, 2, 3, 4, 5):
            ids = as_tensor(random_ids(nprng, num_tokens, top_k, experts, id_dtype))
            bound.record(ids, fd_layer, num_tokens)
            twin.record(ids, fd_layer, num_tokens)
        bound.offload(num_tokens)
        twin.offload(num_tokens)
        bound.wait()
        np.testing.assert_array_equal(stage["host_rows"][:num_tokens], twin_stage["host_rows"][:num_tokens])
        np.testing.assert_array_equal(stage["host_rows"][:num_tokens], host(buffer)[:num_tokens])
        np.testing.assert_array_equal(stage["host_counters"], twin_stage["host_counters"])
    np.testing.assert_array_equal(host(buffer), host(twin_buffer))
    np.testing.assert_array_equal(counters.numpy(), twin_counters.numpy())
    assert counters.numpy()[1:].sum() == 5 * busy_steps       # an empty step counts nothing


def test_bound_recorder_writes_only_its_layer_and_rows(nprng) -> None:
    initial = random_table(nprng, np.uint8, (8, 3, 4))
    buffer = as_tensor(initial.copy())
    counters = paddle.zeros([4], "int64")
    bound = ops.bind_step_recorder(buffer, counters, num_experts=200, **staging(buffer))
    ids = np.array([[1, 2, 3, 4], [5, 6, 7, 199], [0, 200, -1, 9]], np.int64)
    bound.record(as_tensor(ids), 1, 3)
    expected = initial.copy()
    expected[:3, 1] = [[1, 2, 3, 4], [5, 6, 7, 199], [0, 255, 255, 9]]
    np.testing.assert_array_equal(host(buffer), expected)
    np.testing.assert_array_equal(counters.numpy(), [2, 0, 1, 0])


def test_bound_recorder_refuses_without_writing(nprng) -> None:
    buffer = ops.new_step_buffer(4, 2, 2, 16)
    counters = paddle.zeros([3], "int64")
    bound = ops.bind_step_recorder(buffer, counters, num_experts=16, layer_rows=[1, -1, 0], **staging(buffer))
    ids = as_tensor(np.ones((3, 2), np.int64))
    for call, needle in [
        (lambda: bound.record(ids, 0, 2), "routed rows"),               # row count mismatch
        (lambda: bound.record(as_tensor(np.ones((5, 2), np.int64)), 0), "exceed the step buffer"),
        (lambda: bound.record(ids, 1), "layer map"),                    # a dense layer
        (lambda: bound.record(ids, 3), "layer map"),                    # past the map
        (lambda: bound.record(as_tensor(np.ones((3, 3), np.int64)), 0), "top_k"),
        (lambda: bound.record(ids.astype("float32"), 0), "int32 or int64"),
        (lambda: bound.record(np.ones((3, 2), np.int64), 0), "paddle.Tensor"),
        (lambda: bound.offload(5), "offload"),
    ]:
        with pytest.raises((RuntimeError, OpsError), match=needle):
            call()
    assert (host(buffer) == 255).all() and not counters.numpy().any()


def test_bind_validates_once(nprng) -> None:
    buffer = ops.new_step_buffer(4, 2, 2, 16)
    good = staging(buffer)
    with pytest.raises(OpsError, match="counters"):
        ops.bind_step_recorder(buffer, paddle.zeros([2], "int64"), num_experts=16, **good)
    with pytest.raises(OpsError, match="host_rows"):
        ops.bind_step_recorder(buffer, paddle.zeros([3], "int64"), num_experts=16,
                               **dict(good, host_rows=np.zeros((4, 2, 3), np.uint8)))
    with pytest.raises((RuntimeError, OpsError), match="layer map row"):
        ops.bind_step_recorder(buffer, paddle.zeros([3], "int64"), num_experts=16, layer_rows=[0, 2], **good)


def test_offload_copies_the_first_tokens_of_extra(nprng) -> None:
    buffer = ops.new_step_buffer(6, 2, 2, 16)
    counters = paddle.zeros([3], "int64")
    stage = staging(buffer, extra_bytes=6 * 8)
    bound = ops.bind_step_recorder(buffer, counters, num_experts=16, **stage)
    ids = nprng.integers(0, 16, (4, 2))
    bound.record(as_tensor(ids), 0, 4)
    bound.record(as_tensor(ids[::-1].copy()), 1, 4)
    slots = paddle.to_tensor(np.array([9, 3, 7, 1, 55, 66], np.int64))    # FastDeploy's buffer is larger
    bound.offload(4, slots)
    bound.wait()
    np.testing.assert_array_equal(stage["host_extra"][:32].view(np.int64), [9, 3, 7, 1])
    assert not stage["host_extra"][32:].any()
    np.testing.assert_array_equal(stage["host_rows"][:4, 0], ids)
    np.testing.assert_array_equal(stage["host_rows"][:4, 1], ids[::-1])
    np.testing.assert_array_equal(stage["host_counters"], [0, 1, 1])
    bound.fill()
    assert (host(buffer) == 255).all()


def test_empty_step_writes_and_counts_nothing() -> None:
    buffer = ops.new_step_buffer(4, 2, 2, 16)
    counters = paddle.zeros([3], "int64")
    bound = ops.bind_step_recorder(buffer, counters, num_experts=16, **staging(buffer))
    bound.record(as_tensor(np.zeros((0, 2), np.int64)), 0, 0)
    bound.offload(0)
    assert (host(buffer) == 255).all() and not counters.numpy().any()


def _rows_step(buffer, ids_a, ids_b, counters, experts):
    ops.record_rows(buffer, ids_a, 0, counters, num_experts=experts)
    ops.record_rows(buffer, ids_b, 2, counters, num_experts=experts)
    return buffer


@pytest.mark.timeout(180, method="thread")
@pytest.mark.parametrize("full_graph", [False, True], ids=["sot", "ast"])
def test_record_rows_op_inside_to_static(nprng, full_graph) -> None:
    """The registered op is what static graphs use: traced, it gives the eager result."""
    if ops.ops_backend() != "compiled":
        pytest.skip("static graphs need the compiled ops")
    initial = random_table(nprng, np.uint8, (10, 3, 4))
    ids_a = random_ids(nprng, 7, 4, 200, np.int64)
    ids_b = random_ids(nprng, 10, 4, 200, np.int64)
    buffer, counters = as_tensor(initial.copy()), paddle.zeros([4], "int64")
    static_step = paddle.jit.to_static(_rows_step, full_graph=full_graph)
    try:
        static_step(buffer, as_tensor(ids_a), as_tensor(ids_b), counters, 200)
    except Exception as exc:  # pytest's traceback printer can crash on Paddle's traced frames
        pytest.fail(f"to_static step failed: {type(exc).__name__}: {exc}", pytrace=False)
    expected = initial.copy()
    bad = ref.record_rows_np(expected, ids_a, 0, 200) + ref.record_rows_np(expected, ids_b, 2, 200)
    np.testing.assert_array_equal(host(buffer), expected)
    np.testing.assert_array_equal(counters.numpy(), [bad, 1, 0, 1])


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
def test_count_unrouted_matches_numpy(seed, dtype):
    """Tokens with the fill in some layer: the compiled pass against NumPy, with rows
    unrouted in one layer only, in every layer, at the edges, and no token at all."""
    rng = np.random.default_rng(seed)
    fill = int(np.iinfo(dtype).max)
    for layers, tokens, top_k in ((1, 1, 1), (3, 50, 4), (7, 333, 8), (2, 0, 2)):
        ids = rng.integers(0, 300, (layers, tokens, top_k)).astype(dtype)
        if tokens:
            for _ in range(rng.integers(0, tokens)):
                ids[rng.integers(layers), rng.integers(tokens), rng.integers(top_k)] = fill
            ids[:, -1, 0] = fill                                    # the last token, every layer
        want = int(np.count_nonzero((ids == fill).any(axis=(0, 2)))) if tokens else 0
        assert ops.count_unrouted(ids, fill) == want
        assert ops.count_unrouted(np.ascontiguousarray(ids[:, ::-1]), fill) == want


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
def test_pack_request_matches_slots_then_pack(seed, dtype):
    """A request's rows straight from its block-table row against request_slots + the
    NumPy pack: every start, ragged last block, int32/int64 rows; refusals name the problem."""
    from fd_routing_replay.capture.slots import request_slots

    pack = ops.request_packer()
    if pack is None:
        pytest.skip("the compiled ops library is not loaded (FD_RR_OPS=reference)")
    rng = np.random.default_rng(seed)
    block_size, blocks = 4, 12
    cache = rng.integers(0, 300, (blocks * block_size, 5, 3)).astype(dtype)
    for row_dtype in (np.int32, np.int64):
        row = rng.permutation(blocks)[:7].astype(row_dtype)
        for length in (0, 1, 4, 13, 28):
            for start in sorted({0, length // 2, length}):
                want = ref.pack_routing_np(cache, request_slots(row, length, block_size)[start:])
                got = pack(cache, row, start, length, block_size)
                assert got.dtype == cache.dtype and got.flags.c_contiguous
                np.testing.assert_array_equal(got, want)
    row = np.array([3, -1, 5], np.int64)
    with pytest.raises(ValueError, match="4 of 8 positions have no KV block"):
        pack(cache, row, 0, 8, block_size)
    with pytest.raises(ValueError, match="13 positions need 4 blocks; the block table has 3"):
        pack(cache, row, 0, 13, block_size)
    with pytest.raises(ValueError, match="outside the slot cache"):
        pack(cache, np.array([blocks + 1], np.int64), 0, 2, block_size)
