"""Prefix omission on FastDeploy 2.6's engine path after the previous turn was deleted.

Turn 0 goes through FastDeploy's own ``FusedMoE.forward``, ``post_process_normal`` and
token processor (:mod:`test_capture`'s drivers); the engine's writer then deletes it (an
RL framework retiring the rollout through the engine's writer) and turn 1 finishes on the
engine.  The engine must hand turn 1 over whole — a tail after the deleted turn would be
dead-lettered and the turn's record missing from the store.
"""

from __future__ import annotations

import numpy as np
import pytest

fdctx = pytest.importorskip("fdctx", reason="FastDeploy is not importable (see conftest)")

from test_capture import STEP, UUID, finish_on_engine, run_request  # noqa: E402

from fd_routing_replay import RoutingReader, open_store  # noqa: E402


@pytest.mark.skipif(not STEP, reason="prefix omission runs on FastDeploy 2.6's engine side")
@pytest.mark.parametrize("delete", ["submit_delete", "submit_delete_prefix"])
def test_a_deleted_previous_turn_is_not_omitted_on_the_engine(env, monkeypatch, delete):
    from fd_routing_replay.capture.slots import request_slots

    monkeypatch.setenv("FD_RR_CAPTURE__PREFIX_OMISSION", "true")
    prompt_len, new_tokens = 21, 5
    fd_config, runner, engine, rid, _, blocks = run_request(env, monkeypatch, prompt_len=prompt_len,
                                                            new_tokens=new_tokens, seed=7)
    finish_on_engine(runner, engine, rid, prompt_len, new_tokens, blocks)
    writer = engine.routing.writer
    assert engine.flush(60)
    store = open_store(f"local://{env / 'store'}")
    assert RoutingReader(store).get("exp_1:7:0:0") is not None
    assert writer.durable_prefix("exp_1:7:1:0") is not None       # turn 0 is offered ...
    target = "exp_1:7:0:0" if delete == "submit_delete" else "exp_1:7:0"
    getattr(writer, delete)(target)                               # ... until it is deleted
    assert engine.flush(60)
    assert RoutingReader(store).get("exp_1:7:0:0") is None

    turn0_tokens = list(range(1000, 1000 + prompt_len)) + list(range(new_tokens))
    tokens1 = turn0_tokens + [5, 6, 7] + list(range(2000, 2030))   # tool output, new turn
    num_tokens = len(tokens1) - 1
    rng = np.random.default_rng(13)
    block_size = fd_config.cache_config.block_size
    table = rng.permutation(64)[: num_tokens // block_size + 1].astype("int64")
    slots = request_slots(table, num_tokens, block_size)
    rows = rng.integers(0, fd_config.model_config.moe_num_experts,
                        size=(num_tokens,) + engine.host.array.shape[1:])
    engine.host.array[slots] = rows.astype(engine.host.array.dtype)
    engine.routing.finish(f"chatcmpl-exp_1:7:1:0-{UUID}_0", table, num_tokens, token_ids=tokens1)
    assert engine.flush(60)

    assert engine.stats()["prefix_omitted"] == 0 and engine.stats()["prefix_fallbacks"] == 1
    assert writer.stats()["dead_lettered"] == 0
    record1 = RoutingReader(store).get("exp_1:7:1:0")
    assert record1 is not None, "turn 1's record is missing from the store"
    np.testing.assert_array_equal(record1.ids, rows.transpose(1, 0, 2))   # handed over whole
    record1.check_tokens(tokens1)
    engine.close()
    runner.routing_replay_manager.close()
