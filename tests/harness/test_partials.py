"""Partial records (#25 part 4) end to end on the harness engine, both capture generations.

Long multi-turn rollouts run with ``partial_every_tokens``; after every engine step each
running request's stored partial record is held up against the engine's own bookkeeping
(at most ``N`` forwarded positions missing) and, at the end, against the model (the
fidelity check on its ``num_tokens`` positions).  Finished turns leave no partial behind
(the final supersedes it), aborted ones keep their last.  A crash test kills the engine
process with partials still queued for the store; a restarted writer replays its journal
and the store holds each running request's last partial, exact.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np

from fd_routing_replay.keys import partial_key, split_partial_key
from fd_routing_replay.reader import RoutingReader
from fd_routing_replay.store import open_store, register_store
from fd_routing_replay.store.local import LocalStore
from fd_routing_replay.writer import RoutingWriter
from fdrr_dev.harness.fidelity import FidelityReport, check_record
from fdrr_dev.harness.model import TinyMoEModel
from fdrr_dev.harness.rollouts import RolloutPlan
from fdrr_dev.harness.session import run_rollouts
from tests.harness.test_scenarios import FINISHED, GENERATIONS, assert_passed, config
from tests.writer.conftest import wait_until

REPO = Path(__file__).resolve().parents[2]
LONG = dict(num_rollouts=8, num_turns=2, max_tokens=(30, 60), user_tokens=(6, 20))


def partial_keys(store):
    return {key for key in store.list() if split_partial_key(key) is not None}


def observed_while_running(engine, reader, every, generation, seen, bound_checked, aborts):
    """After a step: every running request's partial holds all but < ``every`` of its
    forwarded positions (2.6: from its first output on); the first ``aborts`` requests seen
    with a partial are aborted."""
    for request in list(engine.running):
        partial = reader.get_partial(request.rollout_id)
        if partial is not None:
            n = partial.num_tokens
            seen.setdefault((request.rollout_id, n), (np.array(partial.ids), request.tokens[:n],
                                                      int(partial.fill_value)))
            assert partial.metadata["request_id"] == request.request_id
        if generation == "step" and not (request.prefill_done and request.outputs):
            continue              # 2.6 reports progress with outputs only: a prompt being prefilled has none
        have = 0 if partial is None else partial.num_tokens
        assert request.num_computed - have < every, (request.rollout_id, request.num_computed, have)
        bound_checked.append(request.rollout_id)
        if partial is not None and len(aborts) < 2 and request.rollout_id not in aborts:
            aborts.append(request.rollout_id)
            engine.abort(request.request_id)                 # takes effect at the next step


@GENERATIONS
def test_long_rollouts_keep_a_partial_within_n_positions_and_the_final_supersedes_it(seed, generation,
                                                                                      make_writer):
    every = 16
    url = f"memory://partials-{uuid.uuid4().hex[:8]}"
    store = open_store(url)
    reader = RoutingReader(store)
    seen: dict = {}
    bound_checked: list = []
    aborts: list = []
    plan = RolloutPlan(seed=seed % 1000, **LONG)
    # 22 blocks of 8 hold LONG's longest turn (16 + 2 x (20 + 60) = 176 tokens) and few more:
    # requests preempt one another (with 20, workloads 8 and 60 drew a turn that never fit)
    run = run_rollouts(plan, engine_config=config(generation, num_blocks=22, max_num_seqs=6),
                       writer=make_writer(url, partials=True), partial_every_tokens=every,
                       on_step=lambda engine: observed_while_running(engine, reader, every, generation,
                                                                     seen, bound_checked, aborts))
    assert bound_checked and run.engine.preemptions > 0    # 22 blocks: recomputed requests too
    # every partial ever stored was exact for its positions
    model = run.model_for_version(0)
    report = FidelityReport()
    for (rollout_id, n), (ids, tokens, fill) in seen.items():
        check_record(model, np.asarray(tokens, dtype=np.int64), ids, fill, report,
                     f"{rollout_id} partial of {n}")
    assert_passed(report)
    # finished turns: the final alone, partials gone; aborted turns: their last partial stays
    finished = {r.rollout_id for r in run.results if r.finish_reason in FINISHED}
    aborted = {r.rollout_id for r in run.results if r.finish_reason == "abort"}
    assert finished and aborted == set(aborts) and len(aborts) == 2
    had_partial = {rollout_id for rollout_id, _ in seen}
    assert partial_keys(store) == {partial_key(rid) for rid in aborted & had_partial}
    assert finished & had_partial, "no finished turn ever had a partial: N too large for the plan"
    for rollout_id in aborted & had_partial:
        last = max(n for rid, n in seen if rid == rollout_id)
        assert reader.get_partial(rollout_id).num_tokens == last
        assert reader.get(rollout_id) is None
    assert reader.list_partials() == sorted(aborted & had_partial)
    counters = run.counters
    assert counters["partials_submitted"] >= len(seen) and counters["partials_failed"] == 0


@GENERATIONS
def test_with_only_last_turn_nothing_but_the_last_turns_final_remains(seed, generation, tmp_path):
    root = tmp_path / "s"
    store_config = {"type": "local", "namespace": "harness", "local": {"root": str(root)}}
    writer = RoutingWriter(store_config, {"mode": "thread", "journal_dir": str(tmp_path / "j"),
                                          "dead_letter_dir": str(tmp_path / "d")},
                           only_last_turn=True, partials=True)
    plan = RolloutPlan(seed=seed % 1000, **dict(LONG, num_turns=3, num_rollouts=4))
    try:
        run = run_rollouts(plan, engine_config=config(generation), writer=writer, partial_every_tokens=8)
        assert writer.flush(60)
    finally:
        writer.close(60)
    assert run.counters["partials_submitted"] > 0
    stored = LocalStore(root, "harness").list()
    last_turns = {r.rollout_id for r in run.results if r.rollout_id.endswith(":2:0")}
    assert set(stored) == last_turns


# -- crash and restart ---------------------------------------------------------------------------

CHILD = """
import json, signal, sys
from fdrr_dev.harness.engine import EngineConfig
from fdrr_dev.harness.model import TinyMoEModel
from fdrr_dev.harness.rollouts import RolloutDriver, RolloutPlan
from fdrr_dev.harness.wiring import build_engine, capture_config
from fd_routing_replay.store import register_store
from fd_routing_replay.writer import RoutingWriter

register_store("faulty", "tests.writer.faulty_store:open_faulty_store")
spec = json.loads(sys.argv[1])
writer = RoutingWriter(spec["store"], spec["writer"], partials=True)
model = TinyMoEModel()
# eos_bias: requests run to max_tokens (80+), so they are all still running at step 40
# (with the default bias every request of workload 479 had ended by then)
engine = build_engine(model, EngineConfig(generation=spec["generation"], eos_bias=-5.0), writer=writer,
                      config=capture_config(partial_every_tokens=spec["every"]))
plan = RolloutPlan(num_rollouts=6, num_turns=1, max_tokens=(80, 120), seed=spec["seed"])
driver = RolloutDriver(plan, model.config.vocab_size, model.config.eos_token_id)
driver.start(engine)
for _ in range(spec["steps"]):
    for request in engine.step():
        driver.on_done(request)
if spec["generation"] == "step":
    progress = dict(engine.routing.routing.handoff.progress)
else:
    progress = dict(engine.runner.managers[0].handoff.progress)
state = {"running": [{"rollout_id": r.rollout_id, "request_id": r.request_id, "tokens": r.tokens,
                      "num_computed": r.num_computed, "prefill_done": r.prefill_done,
                      "last": progress.get(r.request_id, 0)} for r in engine.running],
         "finished": [r.rollout_id for r in driver.results]}
with open(spec["state"], "w") as handle:
    json.dump(state, handle)
signal.pause()
"""


@GENERATIONS
def test_an_engine_crash_loses_at_most_n_positions_once_the_writer_replays_its_journal(seed, tmp_path,
                                                                                       generation):
    register_store("faulty", "tests.writer.faulty_store:open_faulty_store")
    every, gate, state_file = 12, tmp_path / "gate", tmp_path / "state.json"
    store = {"type": "faulty", "namespace": "crash", "local": {"root": str(tmp_path / "store")},
             "options": {"gate": str(gate)}}
    writer_config = {"mode": "process", "journal_dir": str(tmp_path / "journal"),
                     "dead_letter_dir": str(tmp_path / "dead"), "capacity_bytes": 8 << 20}
    spec = {"store": store, "writer": writer_config, "generation": generation, "every": every,
            "seed": seed % 1000, "steps": 40, "state": str(state_file)}
    gate.touch()                     # the store hangs: partials wait in the writer's ring
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(CHILD))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    child = subprocess.Popen([sys.executable, str(script), json.dumps(spec)], env=env, cwd=str(tmp_path))
    try:
        wait_until(lambda: state_file.exists() and state_file.read_text().endswith("}") or child.poll(),
                   "the engine to run its steps", timeout=300)
        assert child.poll() is None, "the engine process died on its own"
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
    state = json.loads(state_file.read_text())
    assert state["running"], "no request was running at the crash"
    gate.unlink()
    restarted = RoutingWriter(store, writer_config, partials=True)   # replays the journal
    try:
        assert restarted.flush(60)
    finally:
        restarted.close(60)
    reader = RoutingReader(LocalStore(tmp_path / "store", "crash"))
    model, report, checked = TinyMoEModel(), FidelityReport(), 0
    for request in state["running"]:
        partial = reader.get_partial(request["rollout_id"])
        if request["last"] == 0:
            assert partial is None
            continue
        assert partial.num_tokens == request["last"]          # the newest one submitted, not an older
        assert partial.metadata["request_id"] == request["request_id"]
        if generation == "table" or request["prefill_done"]:
            assert request["num_computed"] - partial.num_tokens < every
        check_record(model, np.asarray(request["tokens"][:partial.num_tokens], dtype=np.int64),
                     np.asarray(partial.ids), int(partial.fill_value), report, request["rollout_id"])
        checked += 1
    assert checked > 0
    assert_passed(report)
    for rollout_id in state["finished"]:          # finished before the crash: final only, once replayed
        assert reader.get_partial(rollout_id) is None
