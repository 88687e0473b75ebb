"""fill_routed_experts on verl's own code (verl 0.9.1, installed --no-deps by `make`):
verl's DataProto, its nested-tensor engine input (left_right_2_no_padding), its VeOmni
replay controller, its Megatron R3 path (tests/trainers/verl_megatron_r3.py, in a process
of its own), and the config keys docs/trainer.md names."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from fd_routing_replay.codec import encode_record
from fd_routing_replay.errors import RecordError
from fd_routing_replay.trainers.verl_batch import fill_routed_experts

ROOT = Path(__file__).resolve().parents[2]

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        import verl
        from verl import DataProto
        from verl.utils.veomni.router_replay import VeOmniRouterReplay
        from verl.workers.utils.padding import left_right_2_no_padding

        from tests.trainers.verl_batches import (
            MOE_LAYERS,
            NUM_LAYERS,
            E,
            K,
            rollout_batch,
            sample_record,
        )
except ImportError as exc:                                      # pragma: no cover
    if os.environ.get("CI") == "true":
        raise RuntimeError("verl is not installed: `make verl-deps` installs it") from exc
    pytest.skip(f"verl 0.9.1 not installed ({exc}); `make verl-deps` installs it",
                allow_module_level=True)


def verl_placement(record, prompt, prompt_width, total):
    """verl's agent loop (_agent_loop_postprocess) placing an engine's routes: int16 rows
    from the first prompt token into zeros [total, L, K]; 0 where nothing was routed."""
    rows = record.ids.transpose(1, 0, 2).astype(np.int16)
    rows[(record.ids == record.fill_value).any(axis=2).T] = 0
    out = np.zeros((total, *rows.shape[1:]), dtype=np.int16)
    start = prompt_width - prompt
    end = min(start + len(rows), total)
    out[start:end] = rows[:end - start]
    return out


def test_version_is_the_one_the_adapter_is_checked_against():
    assert verl.__version__ == "0.9.1"


def test_fill_matches_verls_own_placement_and_survives_dataproto_ops(seed):
    gen = np.random.default_rng(seed)
    data, reader, records, lengths = rollout_batch(gen)
    out = fill_routed_experts(data, reader)
    routed = data.batch["routed_experts"]
    prompt_width, total = data.batch["prompts"].shape[1], data.batch["input_ids"].shape[1]
    assert routed.dtype == torch.int16 and routed.shape == (len(records), total, len(MOE_LAYERS), K)
    for i, (record, (p, _)) in enumerate(zip(records, lengths, strict=True)):
        assert (routed[i].numpy() == verl_placement(record, p, prompt_width, total)).all()
    assert out.routed_mask.sum() == sum(p + r - 1 for p, r in lengths) - 1   # one unrouted
    data.check_consistency()

    # verl's batch operations carry routed_experts with its rollout id.
    by_id = {rid: routed[i].clone() for i, rid in enumerate(data.non_tensor_batch["rollout_id"])}
    perm = torch.from_numpy(gen.permutation(len(records)))
    data.reorder(perm)                                  # what _balance_batch does
    other, other_reader, _, _ = rollout_batch(gen, 3, prefix="grpo_v")
    fill_routed_experts(other, other_reader)
    by_id.update({rid: other.batch["routed_experts"][i].clone()
                  for i, rid in enumerate(other.non_tensor_batch["rollout_id"])})
    merged = DataProto.concat([data, other])
    for part in merged.chunk(2):                        # dispatch to two data-parallel ranks
        for i, rid in enumerate(part.non_tensor_batch["rollout_id"]):
            assert torch.equal(part.batch["routed_experts"][i], by_id[rid])


def test_engine_input_keeps_each_samples_routes(seed):
    """left_right_2_no_padding (verl/workers/utils/padding.py) turns routed_experts into a
    jagged tensor with input_ids's offsets: row t of sample i routes its token t."""
    gen = np.random.default_rng(seed)
    data, reader, records, lengths = rollout_batch(gen)
    fill_routed_experts(data, reader)
    batch = left_right_2_no_padding(data.to_tensordict())
    routes, input_ids = batch["routed_experts"], batch["input_ids"]
    assert routes.is_nested and torch.equal(routes.offsets(), input_ids.offsets())
    for i, (sample, record) in enumerate(zip(routes.unbind(), records, strict=True)):
        p, r = lengths[i]
        assert sample.shape == (p + r, len(MOE_LAYERS), K)
        assert (sample[-1] == 0).all()                  # the last token was never forwarded
        ids = record.ids.transpose(1, 0, 2)
        routed = ~(ids == record.fill_value).any(axis=2)
        assert (sample[:-1].numpy()[routed] == ids[routed]).all()
        assert (sample[:-1].numpy()[~routed] == 0).all()


def test_veomni_replays_the_records_and_routes_the_rest_natively(seed):
    """verl's VeOmni controller (verl/utils/veomni/router_replay.py) gets one target per
    router, in fire order, and routes rows without a recorded route (the all-zero rows:
    last tokens, unrouted positions, a sample without a record) natively."""
    gen = np.random.default_rng(seed)
    data, reader, records, lengths = rollout_batch(gen)
    reader.store.delete([records[3].rollout_id])        # a rollout the writer lost
    out = fill_routed_experts(data, reader, engine="veomni", allow_missing=True)
    assert not out.routed_mask[3].any()
    batch = left_right_2_no_padding(data.to_tensordict())
    targets = batch["routed_experts"].values().to(torch.int64)      # as the engine hands them
    replay = VeOmniRouterReplay()
    replay.begin_replay()
    replay.begin_microbatch(targets=list(targets.unbind(dim=1)))
    routers = [torch.nn.Linear(4, E) for _ in MOE_LAYERS]           # one module per MoE layer
    offsets = np.cumsum([0] + [p + r for p, r in lengths])
    for row, router in enumerate(routers):
        scores = torch.from_numpy(gen.standard_normal((offsets[-1], E)).astype(np.float32))
        native = torch.topk(scores, K, dim=1).indices
        chosen = replay.on_router_forward(router, scores, native)
        for i, record in enumerate(records):
            for t in range(lengths[i][0] + lengths[i][1]):
                got = chosen[offsets[i] + t].tolist()
                ids = record.ids[row, t] if t < record.num_tokens else None
                if i != 3 and ids is not None and (ids != record.fill_value).all():
                    assert got == ids.tolist(), (row, i, t)
                else:
                    assert got == native[offsets[i] + t].tolist(), (row, i, t)
    assert replay.num_fired == replay.num_targets == len(MOE_LAYERS)   # transformer_impl.py:942


def test_a_decoder_layer_axis_breaks_veomnis_layer_count_check(seed):
    """Why the adapter refuses num_layers for VeOmni: with a slot per decoder layer, verl's
    controller is armed with 5 targets while 3 routers fire — the counts verl's VeOmni
    engine compares after each forward (transformer_impl.py:942) — and router i takes
    the slot of decoder layer i, not of its own MoE layer."""
    gen = np.random.default_rng(seed)
    data, reader, records, _ = rollout_batch(gen, 2)
    with pytest.raises(ValueError, match="VeOmni engine 5 layer slots but only 3 routers"):
        fill_routed_experts(data, reader, num_layers=NUM_LAYERS, engine="veomni")
    with pytest.raises(ValueError, match="engine='megatron'"):
        fill_routed_experts(data, reader, num_layers=NUM_LAYERS)
    fill_routed_experts(data, reader, num_layers=NUM_LAYERS, engine="megatron")
    targets = left_right_2_no_padding(data.to_tensordict())["routed_experts"].values()
    replay = VeOmniRouterReplay()
    replay.begin_replay()
    replay.begin_microbatch(targets=list(targets.to(torch.int64).unbind(dim=1)))
    scores = torch.from_numpy(gen.standard_normal((len(targets), E)).astype(np.float32))
    native = torch.topk(scores, K).indices
    routers = [torch.nn.Linear(4, E) for _ in MOE_LAYERS]          # alive: verl keys them by id
    chosen = [replay.on_router_forward(router, scores, native) for router in routers]
    assert (replay.num_fired, replay.num_targets) == (len(MOE_LAYERS), NUM_LAYERS)
    # MoE layer 1's router took dense layer 0's empty slot: nothing of its record replayed.
    assert torch.equal(chosen[0], native)
    assert not torch.equal(chosen[0][:records[0].num_tokens],
                           torch.from_numpy(records[0].ids[0].astype(np.int64)))


def test_megatron_r3_replays_the_records(seed):
    """verl's Megatron R3 path, from the DataProto to Megatron-Core's TopKRouter as verl
    patches it, for a model with dense layers: one slot per MoE layer (MoE ordinal) and,
    with engine='megatron', one per decoder layer (absolute)."""
    done = subprocess.run([sys.executable, "-m", "tests.trainers.verl_megatron_r3", str(seed)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().endswith("verl megatron r3 ok")


def test_missing_short_and_foreign_records_are_named(seed):
    gen = np.random.default_rng(seed)
    data, reader, records, lengths = rollout_batch(gen, 4, store_records=False)
    with pytest.raises(LookupError, match=r"4 of 4 rollouts have no routing record: 'grpo_u0:"):
        fill_routed_experts(data, reader)
    with pytest.raises(TimeoutError, match="4 of 4 routing records not in"):
        fill_routed_experts(data, reader, timeout=0.01)
    with pytest.raises(ValueError, match="no record in the batch"):
        fill_routed_experts(data, reader, allow_missing=True)
    assert "routed_experts" not in data.batch.keys()

    data, reader, records, lengths = rollout_batch(gen, 3)
    ids = list(data.non_tensor_batch["rollout_id"])
    with pytest.raises(ValueError, match="samples 0 and 2 share rollout id"):
        fill_routed_experts(data, reader, rollout_ids=[ids[0], ids[1], ids[0]])
    with pytest.raises(ValueError, match="2 rollout ids for a batch of 3"):
        fill_routed_experts(data, reader, rollout_ids=ids[:2])
    with pytest.raises(ValueError, match=r"no 'rid' column .*'rollout_id', 'uid'"):
        fill_routed_experts(data, reader, id_key="rid")
    # Sample 0 given sample 1's record: another length, or the same length but other tokens.
    swapped = [ids[1], ids[0], ids[2]]
    if lengths[0] != lengths[1] and sum(lengths[0]) != sum(lengths[1]):
        with pytest.raises(ValueError, match=rf"sample 0: record '{ids[1]}' has \d+ routed "
                                             rf"positions but the sample has {sum(lengths[0])}"):
            fill_routed_experts(data, reader, rollout_ids=swapped)
    with pytest.raises(RecordError, match="tokens hash mismatch"):
        fill_routed_experts(data, reader, rollout_ids=swapped, exact_length=False)


def test_fit_lengths_as_verls_agent_loop_does(seed):
    """exact_length=False: a record longer than its sample (a response verl truncated) is
    placed as far as the batch reaches, a shorter one (a trajectory ending in tool tokens)
    leaves the sample's last positions unrouted."""
    gen = np.random.default_rng(seed)
    data, reader, records, lengths = rollout_batch(gen, 2)
    width = data.batch["prompts"].shape[1]
    mask = data.batch["attention_mask"].clone()
    (p0, r0), (p1, r1) = lengths
    mask[0, width + r0 - 1] = 0                                   # sample 0 loses its last token
    data.batch["attention_mask"] = mask
    tokens1 = data.batch["input_ids"][1][mask[1].bool()].numpy()
    shorter = sample_record(gen, records[1].rollout_id, tokens1[:-2])   # 2 rows fewer
    reader.store.put(shorter.rollout_id, encode_record(shorter))
    with pytest.raises(ValueError, match=f"sample 0: .* has {p0 + r0 - 1} routed positions"):
        fill_routed_experts(data, reader)
    out = fill_routed_experts(data, reader, exact_length=False)
    assert out.routed_mask[0, width - p0:width + r0 - 1].all()
    placed = data.batch["routed_experts"][0, width - p0:width + r0 - 1].numpy()
    assert (placed == records[0].ids.transpose(1, 0, 2)).all()
    assert out.routed_mask[1].sum() == p1 + r1 - 3
    assert (data.batch["routed_experts"][1, width + r1 - 3:] == 0).all()


def test_a_batch_that_is_not_verls_layout_is_refused(seed):
    gen = np.random.default_rng(seed)
    data, reader, _, _ = rollout_batch(gen, 2)
    mask = data.batch["attention_mask"].clone()
    mask[1, data.batch["prompts"].shape[1]] = 0       # sample 1's response starts with a hole
    data.batch["attention_mask"] = mask
    with pytest.raises(ValueError, match="sample 1: attention mask is not a left-padded prompt"):
        fill_routed_experts(data, reader)
    data.batch.pop("prompts")
    with pytest.raises(ValueError, match=r"data.batch lacks \['prompts'\]"):
        fill_routed_experts(data, reader)


# -- what the adapter and docs/trainer.md take from verl's sources ----------------------------------


def test_verls_agent_loop_is_what_the_tests_reproduce():
    """The agent loop's module imports more than these tests install (datasets, hydra), so
    what they reproduce of it is pinned to its source: the int16 cast and the placement
    from the first prompt token (verl_placement), extra fields becoming non_tensor_batch
    columns (the rollout_id column), and the request ids verl_rollout_id takes."""
    loop = _verl_file("experimental/agent_loop/agent_loop.py").read_text()
    for line in ('experts_tensor = experts_tensor.to(torch.int16)',
                 'start_pos = prompt_output["input_ids"].shape[1] - len(output.prompt_ids)',
                 'end_pos = min(start_pos + length, total_length)',
                 'routed_experts[:, start_pos:end_pos] = experts_tensor.unsqueeze(0)',
                 'temp_arr[:] = [input.extra_fields.get(key) for input in inputs]',
                 'non_tensor_batch.update(extra_fields)'):
        assert line in loop, f"verl's agent loop changed: {line!r} is gone"
    tools = _verl_file("experimental/agent_loop/tool_agent_loop.py").read_text()
    assert 'return f"det-{priority}" if full_determinism else uuid4().hex' in tools
    single = _verl_file("experimental/agent_loop/single_turn_agent_loop.py").read_text()
    assert 'f"det-{priority}" if getattr(self.rollout_config, "full_determinism", False) ' \
           'else uuid4().hex' in single




def _verl_file(relative: str) -> Path:
    return Path(verl.__file__).parent / relative


def _config_keys(path: Path) -> set[str]:
    import yaml

    def walk(node, prefix):
        if isinstance(node, dict):
            for key, value in node.items():
                yield f"{prefix}{key}"
                yield from walk(value, f"{prefix}{key}.")

    return set(walk(yaml.safe_load(path.read_text()), ""))


def test_the_documented_verl_config_keys_exist_in_verl():
    from verl.workers.config import EngineRouterReplayConfig

    section = (ROOT / "docs" / "trainer.md").read_text().split("\n## verl", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(actor_rollout_ref\.[a-z_.]+)(?:=[^`]*)?`", section))
    assert {"actor_rollout_ref.actor.megatron.router_replay.mode",
            "actor_rollout_ref.actor.veomni.router_replay.mode",
            "actor_rollout_ref.rollout.agent.agent_loop_manager_class"} <= documented
    configs = [_verl_file(f"trainer/config/_generated_ppo_{engine}_trainer.yaml")
               for engine in ("megatron", "veomni")]
    known = set().union(*map(_config_keys, configs))
    # Read with .get() rather than declared in the YAML (ray_trainer.py, main_ppo.py).
    trainer = _verl_file("trainer/ppo/ray_trainer.py").read_text()
    assert '.get("agent", {}).get("agent_loop_manager_class")' in trainer
    known.add("actor_rollout_ref.rollout.agent.agent_loop_manager_class")
    old = "actor_rollout_ref.actor.router_replay.mode"
    assert old not in known, "verl brought the old key back: update docs/trainer.md"
    assert sorted(documented - known - {old}) == []
    assert EngineRouterReplayConfig(mode="R3").mode == "R3"
    with pytest.raises(ValueError, match="Invalid router_replay mode"):
        EngineRouterReplayConfig(mode="R4")
