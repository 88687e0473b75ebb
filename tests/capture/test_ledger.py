"""The compiled per-step ledger (the manager's only per-step path) against the NumPy oracle
(tests/capture/step_oracle.py), on random step sequences.

The manager (through FastDeploy's call order, the real hook and the custom ops) and the
oracle see the same steps; after every step their host slot caches, unmapped-token counts
and records must be identical.  The sequences are deliberately unkind: positions past
``max_model_len``, unassigned KV blocks, unregistered slots that forward, finishes during
prefill chunks, stop flags, preemptions and slot reuse, steps larger than the step buffer,
device block tables, and speculative decoding with accepted tokens, EOS and length limits.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fd_routing_replay import ops
from fd_routing_replay.capture.slots import CaptureGeometry, HostInts
from tests.capture.step_oracle import OracleCapture
from tests.capture.steps import Driver, ListWriter, rid

SLOTS = 5


class DeviceTable:
    """A block table that is not a host tensor (a GPU's, as the manager sees it): the manager
    must read it through its mirror, once per step."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.shape = array.shape
        self.place = type("Place", (), {"is_cpu_place": staticmethod(lambda: False)})()
        self.reads = 0

    def numpy(self) -> np.ndarray:
        self.reads += 1
        return self.array.copy()

    def __getitem__(self, index):
        return self.array[index]

    def __setitem__(self, index, value):
        self.array[index] = np.asarray(value)


def twin(seed: int, geometry: CaptureGeometry, *, device_table: bool = False) -> tuple[Driver, OracleCapture]:
    driver = Driver(geometry, seed, writer=ListWriter())
    if device_table:
        table = DeviceTable(driver.block_tables)
        driver.share_inputs["block_tables"] = table
        driver.managers = [type(driver.manager)(geometry, block_table=table, writer=driver.writer,
                                                share_inputs=driver.share_inputs)]
    oracle = OracleCapture(max_num_seqs=geometry.max_num_seqs, max_model_len=geometry.max_model_len,
                           block_size=geometry.block_size, num_slots=geometry.total_block_num * geometry.block_size,
                           num_layers=geometry.num_moe_layers, top_k=geometry.top_k, fill=255)
    return driver, oracle


def assert_same(driver: Driver, oracle: OracleCapture) -> None:
    manager = driver.manager
    np.testing.assert_array_equal(manager.host_cache.array, oracle.cache)
    assert manager.counters["unmapped_positions"] == oracle.unmapped
    assert sorted(driver.writer.items) == sorted(oracle.records)
    for key, record in driver.writer.items.items():
        np.testing.assert_array_equal(record.ids, oracle.records[key], err_msg=key)


def random_calls(gen, users: list[int]) -> list[tuple[str, tuple]]:
    calls = []
    for _ in range(int(gen.integers(0, 4))):
        slot = int(gen.integers(0, SLOTS))
        kind = gen.choice(["register", "register", "clear", "blocks"])
        if kind == "register":
            users[0] += 1
            calls.append(("register", (slot, rid(f"exp_{users[0] % 7}:0:{users[0]}:0"))))
        elif kind == "clear":
            calls.append(("clear", (slot,)))
        else:
            blocks = gen.permutation(40)[: gen.integers(1, 7)].tolist()
            if gen.random() < 0.15:
                blocks[gen.integers(0, len(blocks))] = -1         # an unassigned block
            calls.append(("blocks", (slot, blocks)))
    return calls


def apply(driver: Driver, oracle: OracleCapture, calls) -> None:
    for name, args in calls:
        if name == "register":
            driver.manager.register_request(batch_id=args[0], request_id=args[1])
            oracle.register(args[0], args[1].split("-")[1])
        elif name == "clear":
            driver.manager.clear_request(batch_id=args[0])
            oracle.clear(args[0])
        else:
            driver.set_blocks(*args)


def run_steps(seed: int, driver: Driver, oracle: OracleCapture, *, steps: int = 60,
              speculative: int = 0) -> None:
    gen = np.random.default_rng(seed)
    geometry = driver.geometry
    rows = geometry.step_tokens
    users = [0]
    for step in range(steps):
        driver.rng = np.random.default_rng([seed, step])
        apply(driver, oracle, random_calls(gen, users))
        entries = {int(s): (int(gen.integers(0, 26)), int(gen.integers(1, 5 + speculative)))
                   for s in gen.choice(SLOTS, size=gen.integers(1, 6), replace=True)}
        finished = {int(s) for s in gen.choice(SLOTS, size=gen.integers(0, 3))}
        stopped = {int(s) for s in gen.choice(SLOTS, size=gen.integers(0, 2))}
        encoder = {s for s in entries if gen.random() < 0.5}
        extra = {"prompt_lens": paddle.to_tensor(gen.integers(0, 20, (SLOTS, 1)).astype(np.int64))}
        spec = {}
        if speculative:
            spec = {"accept_num": gen.integers(0, speculative + 2, SLOTS).astype(np.int32),
                    "step_idx": gen.integers(0, 30, SLOTS).astype(np.int64),
                    "max_dec_len": gen.integers(10, 40, SLOTS).astype(np.int64),
                    "accept_tokens": gen.integers(0, 6, (SLOTS, speculative + 1)).astype(np.int64),
                    "eos_token_id": np.array([2, 5], np.int64)}
            extra.update({name: paddle.to_tensor(value) for name, value in spec.items()})
        skipped = {int(layer) for layer in range(geometry.num_moe_layers) if gen.random() < 0.03}
        driver.step(entries, finished=finished, stopped=stopped, encoder=encoder, extra=extra, skip_layers=skipped)
        n = SLOTS
        this_time, decoder, enc = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
        for slot, (start, count) in entries.items():
            decoder[slot], this_time[slot] = start, count
            if slot in encoder:
                enc[slot] = count
        total = int(this_time.sum())
        oracle.step(driver.block_tables, decoder, this_time, driver.last_drawn, encoder=enc,
                    staged_rows=min(total, rows), hook_failed=total > rows and total > 0,
                    missing_layers=skipped if total <= rows else range(geometry.num_moe_layers),
                    finished=np.isin(np.arange(n), list(finished)), stop=np.isin(np.arange(n), list(stopped)),
                    prompt_lens=extra["prompt_lens"], accept_num=spec.get("accept_num"),
                    step_idx=spec.get("step_idx"), max_dec_len=spec.get("max_dec_len"),
                    accept_tokens=spec.get("accept_tokens"), eos=spec.get("eos_token_id"))
        assert_same(driver, oracle)
    assert driver.manager.counters["steps"] == steps and driver.manager.counters["errors"] == 0


def geometry(batched_tokens: int = 0, speculative: int = 0) -> CaptureGeometry:
    return CaptureGeometry(max_num_seqs=SLOTS, max_model_len=24, num_moe_layers=3, top_k=2, num_experts=8,
                           block_size=4, total_block_num=40, max_num_batched_tokens=batched_tokens,
                           num_speculative_tokens=speculative)


@pytest.mark.parametrize("batched_tokens", [0, 6])
def test_the_ledger_matches_the_oracle_on_random_steps(seed, batched_tokens):
    driver, oracle = twin(seed, geometry(batched_tokens))
    run_steps(seed, driver, oracle)
    assert driver.manager.counters["tokens_offloaded"] > 0 and oracle.finished > 0, \
        "the sequence exercised nothing"


def test_a_device_block_table_is_read_through_the_mirror_once_per_step(seed):
    driver, oracle = twin(seed, geometry(), device_table=True)
    run_steps(seed, driver, oracle, steps=30)
    assert driver.share_inputs["block_tables"].reads == 30


@pytest.mark.parametrize("speculative", [1, 3])
def test_speculative_decoding_keeps_accepted_tokens_and_cuts_at_eos_and_length(seed, speculative):
    driver, oracle = twin(seed, geometry(speculative=speculative))
    run_steps(seed, driver, oracle, speculative=speculative)


def test_a_step_larger_than_the_scratch_grows_it(seed):
    """The token scratch starts at one token per sequence; a prefill chunk outgrows it."""
    driver, oracle = twin(seed, CaptureGeometry(max_num_seqs=3, max_model_len=64, num_moe_layers=2, top_k=2,
                                                num_experts=8, block_size=4, total_block_num=24))
    ledger = driver.manager.ledger
    before = ledger.capacity
    driver.set_blocks(0, [1, 2, 3, 4])
    driver.manager.register_request(batch_id=0, request_id=rid("exp_1:0:0:0"))
    rows = driver.step({0: (0, 13)}, encoder={0}, finished={0})
    assert ledger.capacity > before >= 3
    np.testing.assert_array_equal(driver.writer.items["exp_1:0:0:0"].ids,
                                  np.stack([rows[(0, p)] for p in range(13)], axis=1))


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
    driver = Driver(CaptureGeometry(max_num_seqs=2, max_model_len=8, num_moe_layers=1, top_k=2,
                                    num_experts=4, block_size=4, total_block_num=4), 0, writer=ListWriter())
    ledger = driver.manager.ledger
    with pytest.raises(ValueError, match="forwarded"):
        ops.bind_step_ledger(registered=np.zeros(2, bool), forwarded=np.zeros(2, np.int32),
                             damaged=np.zeros(2, bool), tokens=ledger.tokens, slots=ledger.slots,
                             finished=ledger.finished_scratch, block_table=None, block_size=4,
                             max_model_len=8, cache=None, staging=None, host_counters=None,
                             seen=None, delta=None)
    with pytest.raises(ValueError, match="finished"):
        ops.bind_step_ledger(registered=np.zeros(2, bool), forwarded=np.zeros(2, np.int64),
                             damaged=np.zeros(2, bool), tokens=ledger.tokens, slots=ledger.slots,
                             finished=np.zeros(2, np.int64), block_table=None, block_size=4,
                             max_model_len=8, cache=None, staging=None, host_counters=None,
                             seen=None, delta=None)
    with pytest.raises(ValueError, match="seq_lens_this_time"):
        ledger.bound.plan(0, 4, 0, 0, 3, 5, 0, 0, 0)                 # item size 3
