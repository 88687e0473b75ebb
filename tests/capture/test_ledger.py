"""The compiled per-step ledger against the manager's NumPy path, on random step sequences.

Two managers see exactly the same calls (same seed, same routing drawn): one with the
compiled ``StepLedger`` (capture/ledger.py), one with it switched off, which takes the
manager's NumPy path -- the reference.  After every step their host slot caches,
per-slot state, counters and records must be identical.  The sequences are deliberately
unkind: positions past ``max_model_len``, unassigned KV blocks, unregistered slots that
forward, finishes during prefill chunks, stop flags, preemptions and slot reuse.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fd_routing_replay import ops
from fd_routing_replay.capture.ledger import HostInts
from fd_routing_replay.capture.manager import CaptureGeometry
from tests.capture.steps import Driver, ListSink, rid

pytestmark = pytest.mark.skipif(ops.bound_backend() is None,
                                reason="the compiled ops library is not loaded (FD_RR_OPS=reference)")

COUNTERS = ("registered", "re_registered", "slot_conflicts", "cleared", "records_submitted",
            "records_failed", "records_incomplete", "tokens_offloaded", "steps", "errors",
            "unmapped_positions", "missing_layer_steps")


def twins(seed: int, geometry: CaptureGeometry) -> tuple[Driver, Driver]:
    fast = Driver(geometry, seed, sink=ListSink())
    reference = Driver(geometry, seed, sink=ListSink())
    assert fast.manager.ledger is not None
    reference.manager.ledger = None           # the NumPy path
    return fast, reference


def assert_same(fast: Driver, reference: Driver) -> None:
    a, b = fast.manager, reference.manager
    np.testing.assert_array_equal(a.host_cache.array, b.host_cache.array)
    np.testing.assert_array_equal(a._forwarded, b._forwarded)
    np.testing.assert_array_equal(a._damaged, b._damaged)
    np.testing.assert_array_equal(a._registered, b._registered)
    assert {k: a.counters[k] for k in COUNTERS} == {k: b.counters[k] for k in COUNTERS}
    assert sorted(fast.sink.items) == sorted(reference.sink.items)
    for key, record in fast.sink.items.items():
        np.testing.assert_array_equal(record.ids, reference.sink.items[key].ids)


@pytest.mark.parametrize("batched_tokens", [0, 6])
def test_ledger_matches_the_numpy_path_on_random_steps(seed, batched_tokens):
    gen = np.random.default_rng(seed)
    geometry = CaptureGeometry(max_num_seqs=5, max_model_len=24, num_moe_layers=3, top_k=2,
                               num_experts=8, block_size=4, total_block_num=40,
                               max_num_batched_tokens=batched_tokens)
    fast, reference = twins(seed, geometry)
    users = 0
    for step in range(60):
        for driver in (fast, reference):
            driver.rng = np.random.default_rng([seed, step])   # both draw the same routing
        ops_this_step = gen.integers(0, 4)
        calls: list[tuple[str, tuple]] = []
        for _ in range(ops_this_step):
            slot = int(gen.integers(0, 5))
            kind = gen.choice(["register", "register", "clear", "blocks"])
            if kind == "register":
                users += 1
                calls.append(("register", (slot, rid(f"exp_{users % 7}:0:{users}:0"))))
            elif kind == "clear":
                calls.append(("clear", (slot,)))
            else:
                blocks = gen.permutation(40)[: gen.integers(1, 7)].tolist()
                if gen.random() < 0.15:
                    blocks[gen.integers(0, len(blocks))] = -1         # an unassigned block
                calls.append(("blocks", (slot, blocks)))
        entries = {int(s): (int(gen.integers(0, 26)), int(gen.integers(1, 5)))
                   for s in gen.choice(5, size=gen.integers(1, 6), replace=True)}
        finished = {int(s) for s in gen.choice(5, size=gen.integers(0, 3))}
        stopped = {int(s) for s in gen.choice(5, size=gen.integers(0, 2))}
        encoder = {s for s in entries if gen.random() < 0.5}
        prompt_lens = paddle.to_tensor(gen.integers(0, 20, (5, 1)).astype(np.int64))
        for driver in (fast, reference):
            for name, args in calls:
                if name == "register":
                    driver.manager.register_request(batch_id=args[0], request_id=args[1])
                elif name == "clear":
                    driver.manager.clear_request(batch_id=args[0])
                else:
                    driver.set_blocks(*args)
            driver.step(entries, finished=finished, stopped=stopped, encoder=encoder,
                        extra={"prompt_lens": prompt_lens})
        assert_same(fast, reference)
    assert fast.manager.counters["steps"] > 0 and fast.manager.counters["errors"] == 0


def test_a_step_larger_than_the_scratch_takes_the_numpy_path(seed):
    geometry = CaptureGeometry(max_num_seqs=3, max_model_len=32, num_moe_layers=2, top_k=2,
                               num_experts=8, block_size=4, total_block_num=24,
                               max_num_batched_tokens=4)
    fast, reference = twins(seed, geometry)
    for driver in (fast, reference):
        driver.set_blocks(0, [1, 2, 3])
        driver.manager.register_request(batch_id=0, request_id=rid("exp_1:0:0:0"))
        driver.step({0: (0, 3)}, encoder={0})                    # fits: the ledger plans it
    assert fast.manager.pending_update_positions.ledger is fast.manager.ledger
    for driver in (fast, reference):
        driver.step({0: (3, 6)}, encoder={0}, finished={0})     # 6 tokens > 4 rows of scratch
    assert fast.manager.pending_update_positions.ledger is None
    assert_same(fast, reference)
    assert fast.sink.items == {}                                  # damaged: rows past the buffer


def test_host_ints_reads_tensors_in_place_and_follows_a_moved_buffer():
    inputs = HostInts()
    tensor = paddle.to_tensor(np.array([[3], [4]], dtype=np.int32))
    address, itemsize, length = inputs("x", tensor)
    assert (address, itemsize, length) == (tensor.data_ptr(), 4, 2)
    assert inputs("x", tensor)[0] == tensor.data_ptr()
    replacement = paddle.to_tensor(np.arange(5, dtype=np.int64))
    assert inputs("x", replacement) == (replacement.data_ptr(), 8, 5)
    array = np.array([True, False, True])
    assert inputs("y", array) == (array.ctypes.data, 1, 3)
    address, itemsize, length = inputs("z", [1, 2, 3])              # copied, kept alive
    assert itemsize == 8 and length == 3
    assert np.ctypeslib.as_array((np.ctypeslib.ctypes.c_int64 * 3).from_address(address)).tolist() == [1, 2, 3]
    assert inputs("w", None) == (0, 0, 0)


def test_the_ledger_refuses_arrays_of_the_wrong_kind():
    geometry = CaptureGeometry(max_num_seqs=2, max_model_len=8, num_moe_layers=1, top_k=2,
                               num_experts=4, block_size=4, total_block_num=4)
    driver = Driver(geometry, 0, sink=ListSink())
    ledger = driver.manager.ledger
    with pytest.raises(ValueError, match="forwarded"):
        ops.bind_step_ledger(registered=np.zeros(2, bool), forwarded=np.zeros(2, np.int32),
                             damaged=np.zeros(2, bool), tokens=ledger.tokens, slots=ledger.slots,
                             finished=ledger.finished_slots, block_table=None, block_size=4,
                             max_model_len=8, cache=None, staging=None, host_counters=None,
                             seen=None, delta=None)
    with pytest.raises(ValueError, match="seq_lens_this_time"):
        ledger.bound.plan(0, 4, 0, 0, 3, 5, 0, 0, 0)                 # item size 3
