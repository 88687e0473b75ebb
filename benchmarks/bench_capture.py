"""Capture cost: harness step time with capture on vs off, and the per-step host work.

Claims (issues 5 and 24):

1. **Step overhead.**  The harness engine's step time (``insert_tasks_v1`` +
   ``execute_model``: forward, sampling, post-processing) with routing capture on vs
   off: two engines on the same seeds and the same schedule step in lockstep
   (:mod:`fdrr_dev.harness.lockstep`), each pair of steps gives one on/off ratio,
   and the figure is the median over all paired steps of all runs, with each run's own
   median next to it.  Capture on = the MoE hook in every layer, the compiled per-step
   bookkeeping (positions, KV slots, the offload and scatter, the finish check) and each
   finished request's rows, gathered on the engine's thread straight into the ring of a
   process-mode writer (production's), which builds the record and writes it to an
   in-memory store.  Off = the no-op twin.  Two model sizes: the tiny
   test model (a few-ms step, where any fixed per-step cost looks large) and a wider one.
2. **Per-step offload.**  One decode step's rows moved from the device step buffer to the
   host slot cache for 64 and 256 running sequences (27 MoE layers x top-8, uint8): our
   path vs a per-sequence loop like the reference's over its request-major table.
3. **Per-step host work.**  Each of FastDeploy's per-step calls in isolation at 16, 64 and
   256 running sequences, with the compiled ledger (the only implementation; the NumPy
   bookkeeping it replaced, measured in earlier runs, is in docs/benchmarks.md).

FastDeploy 2.6's own per-step path and finish-time assembly, side by side with ours:
benchmarks/bench_capture_fd26.py.

    python benchmarks/bench_capture.py            # full
    python benchmarks/bench_capture.py --quick    # smaller workload, one run
"""

from __future__ import annotations

import argparse
import sys
import uuid
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
warnings.filterwarnings("ignore", message=".*ccache.*")
from _common import fmt_seconds, markdown_table, median_seconds  # noqa: E402

from fd_routing_replay.capture.fd25 import CaptureGeometry, RoutingReplayManager  # noqa: E402
from fdrr_dev.harness.engine import EngineConfig  # noqa: E402
from fdrr_dev.harness.lockstep import PairedTiming, run_lockstep  # noqa: E402
from fdrr_dev.harness.model import TinyMoEConfig  # noqa: E402
from fdrr_dev.harness.paddle_runtime import paddle  # noqa: E402
from fdrr_dev.harness.rollouts import RolloutPlan  # noqa: E402
from fdrr_dev.harness.wiring import inline_writer  # noqa: E402

WIDE = TinyMoEConfig(hidden_size=128, num_heads=4, num_layers=6, num_experts=16, top_k=4,
                     expert_intermediate_size=128, dense_intermediate_size=512, vocab_size=96)


# ---------------------------------------------------------------------------- 1. steps
def step_times(model_config: TinyMoEConfig, plan: RolloutPlan, repeats: int) -> dict[str, object]:
    """Capture-on and capture-off engines in lockstep (:mod:`fdrr_dev.harness.lockstep`),
    ``repeats`` times; medians over all paired steps, and each repeat's own figure.  Records
    go through a process-mode writer (production's) to an in-memory store."""
    timing = PairedTiming()
    steps = 0
    per_run = []
    for _ in range(repeats):
        with inline_writer(f"memory://bench-{uuid.uuid4().hex[:12]}", mode="process") as writer:
            run, one = run_lockstep(plan, engine_config=EngineConfig(), model_config=model_config,
                                    writer=writer)
        timing.extend(one)
        per_run.append(one.paired_overhead)
        steps = run.engine.steps
    return {"off": timing.median_off, "on": timing.median_on, "ratio": 1 + timing.paired_overhead,
            "total": 1 + timing.total_overhead, "steps": steps, "runs": per_run}


# ---------------------------------------------------------------------------- 2. offload
LAYERS, TOP_K, EXPERTS, MAX_LEN, BLOCK = 27, 8, 64, 1024, 64


def reference_offload(table, host_cache, block_table, seq_lens_decoder, seq_lens_this_time,
                      max_num_seqs: int) -> None:
    """A per-sequence loop like the reference's: positions, slots, gather and copy per sequence."""
    starts = seq_lens_decoder.numpy().reshape(-1)
    counts = seq_lens_this_time.numpy().reshape(-1)
    positions = []
    for b in range(max_num_seqs):
        if seq_lens_this_time[b] == 0:
            positions.append([])
            continue
        positions.append(np.repeat(starts[b], counts[b]) + np.arange(counts[b]))
    slots = []
    for b, pos in enumerate(positions):
        if len(pos) == 0:
            slots.append([])
            continue
        blocks = block_table[b, pos // BLOCK]
        slots.append(np.array(blocks) * BLOCK + pos % BLOCK)
    for b, pos in enumerate(positions):
        if len(pos) > 0 and len(slots[b]) > 0:
            rows = table[b, pos.tolist(), :, :].contiguous().cpu()
            host_cache[slots[b].reshape(-1).tolist(), :, :] = rows


def offload_case(num_seqs: int, repeats: int, rng: np.random.Generator) -> tuple[float, float]:
    """One decode step of ``num_seqs`` sequences: ours (positions + slot mapping + one copy of
    the step buffer's rows + one scatter) vs the reference loop over its request-major table."""
    blocks_per_seq = MAX_LEN // BLOCK
    geometry = CaptureGeometry(max_num_seqs=num_seqs, max_model_len=MAX_LEN, num_moe_layers=LAYERS,
                               top_k=TOP_K, num_experts=EXPERTS, block_size=BLOCK,
                               total_block_num=num_seqs * blocks_per_seq, max_num_batched_tokens=num_seqs)
    block_np = rng.permutation(num_seqs * blocks_per_seq).reshape(num_seqs, blocks_per_seq).astype(np.int32)
    block_table = paddle.to_tensor(block_np)
    manager = RoutingReplayManager(geometry, block_table=block_table, writer=None)
    for b in range(num_seqs):
        manager.register_request(batch_id=b, request_id=f"chatcmpl-exp_{b}:0:0:0-{uuid.uuid4()}")
    decoder_np = rng.integers(0, MAX_LEN - 1, (num_seqs, 1)).astype(np.int32)
    decoder = paddle.to_tensor(decoder_np)
    this_time = paddle.to_tensor(np.ones((num_seqs, 1), dtype=np.int32))
    # The reference's table [max_num_seqs, max_len, L, K] and our step buffer hold the same step.
    table_np = rng.integers(0, EXPERTS, (num_seqs, MAX_LEN, LAYERS, TOP_K), dtype=np.uint8)
    table = paddle.to_tensor(table_np)
    np.from_dlpack(manager.get_routing_table())[:num_seqs] = table_np[np.arange(num_seqs), decoder_np[:, 0]]

    def ours() -> None:
        positions = manager.get_token_positions(seq_lens_decoder=decoder, seq_lens_this_time=this_time)
        mapping = manager.compute_slot_mapping(positions=positions)
        manager.update_host_cache(positions=positions, slot_mapping=mapping)

    reference_cache = paddle.to_tensor(np.full((num_seqs * MAX_LEN, LAYERS, TOP_K), 255, np.uint8))

    def reference() -> None:
        reference_offload(table, reference_cache, block_table, decoder, this_time, num_seqs)

    def forward() -> None:     # untimed: what the step's MoE layers leave in the device counters
        np.from_dlpack(manager.step.counters)[1:] += 1

    forward()
    ours()
    reference()
    # both paths must move the same rows
    got = manager.host_cache.array
    want = reference_cache.numpy()
    written = (want != 255).any(axis=(1, 2))
    if not np.array_equal(got[written], want[written]) or (got != 255).any(axis=(1, 2)).sum() != written.sum():
        raise RuntimeError("offload paths disagree")
    timings = {}
    for name, fn, runs in (("ours", ours, repeats * 10), ("reference", reference, max(3, repeats // 10))):
        timings[name] = median_seconds(fn, runs, setup=forward)
    manager.close()
    return timings["ours"], timings["reference"]


# ---------------------------------------------------------------------------- 3. per call
def per_call_costs(num_seqs: int, layers: int, top_k: int, repeats: int) -> dict[str, float]:
    """Median cost of each capture call in one decode step, measured in isolation."""
    from fd_routing_replay.capture.device import save_routing_to_buffer

    rng = np.random.default_rng(5)
    geometry = CaptureGeometry(max_num_seqs=num_seqs, max_model_len=MAX_LEN, num_moe_layers=layers,
                               top_k=top_k, num_experts=EXPERTS, block_size=BLOCK,
                               total_block_num=num_seqs * (MAX_LEN // BLOCK))
    block_table = paddle.to_tensor(rng.permutation(geometry.total_block_num)
                                   .reshape(num_seqs, -1).astype(np.int32))
    zeros = np.zeros((num_seqs, 1), np.int32)
    share_inputs = {"block_tables": block_table, "seq_lens_encoder": paddle.to_tensor(zeros),
                    "stop_flags": paddle.to_tensor(zeros.astype(bool)),
                    "prompt_lens": paddle.to_tensor(zeros.astype(np.int64))}
    manager = RoutingReplayManager(geometry, block_table=block_table, writer=None,
                                   share_inputs=share_inputs)
    for b in range(num_seqs):
        manager.register_request(batch_id=b, request_id=f"chatcmpl-exp_{b}:0:0:0-{uuid.uuid4()}")
    decoder = paddle.to_tensor(rng.integers(0, MAX_LEN - 1, (num_seqs, 1)).astype(np.int32))
    this_time = paddle.to_tensor(np.ones((num_seqs, 1), np.int32))
    topk = paddle.to_tensor(rng.integers(0, EXPERTS, (num_seqs, top_k)).astype(np.int64))
    batch_ids = paddle.to_tensor(np.arange(num_seqs, dtype=np.int32))
    cu_seqlens = paddle.to_tensor(np.arange(num_seqs + 1, dtype=np.int32))
    finished = paddle.to_tensor(np.zeros(num_seqs, bool))
    state: dict[str, object] = {}

    def positions() -> None:
        state["positions"] = manager.get_token_positions(seq_lens_decoder=decoder, seq_lens_this_time=this_time)
        manager.pending_update_positions = state["positions"]

    def slot_mapping() -> None:
        state["mapping"] = manager.compute_slot_mapping(positions=state["positions"])

    calls = {
        "positions": positions,
        "slot mapping": slot_mapping,
        "offload": lambda: manager.update_host_cache(positions=state["positions"], slot_mapping=state["mapping"]),
        "finish check": lambda: manager.put_finished_batch(finished_batch_ids=finished,
                                                           seq_lens_decoder=decoder),
        "hook (per layer)": lambda: save_routing_to_buffer(
            routing_replay_table=manager.get_routing_table(), topk_ids=topk,
            batch_id_per_token=batch_ids, seq_lens_decoder=decoder, cu_seqlens_q=cu_seqlens,
            layer_idx=0),
    }
    counters = np.from_dlpack(manager.step.counters)

    def forward() -> None:     # untimed: what the step's MoE layers leave in the device counters
        counters[1:] += 1

    def step_before(name: str) -> None:   # untimed: the calls FastDeploy makes before this one
        forward()
        order = list(calls)
        for earlier in order[:order.index(name)] if name in order[:4] else order[:1]:
            calls[earlier]()

    out = {}
    for name, fn in calls.items():
        step_before(name)
        fn()
        out[name] = median_seconds(fn, repeats, setup=lambda name=name: step_before(name))
    out["total per step"] = sum(v for k, v in out.items() if k != "hook (per layer)") + \
        layers * out["hook (per layer)"]
    if errors := manager.counters["errors"]:
        raise RuntimeError(f"the manager counted {errors} errors: the timing is void")
    manager.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 rollouts, 1 repeat, fewer offload runs")
    args = parser.parse_args()
    plan = RolloutPlan(num_rollouts=16 if args.quick else 64, num_turns=3, seed=7)
    repeats = 1 if args.quick else 3
    rows = []
    for label, config in (("tiny (h=32, 3 MoE layers)", TinyMoEConfig()),
                          ("wider (h=128, 5 MoE layers)", WIDE)):
        result = step_times(config, plan, repeats)
        spread = ", ".join(f"{r:+.1%}" for r in result["runs"])
        rows.append([label, "writer (process mode)", result["steps"], fmt_seconds(result["off"]),
                     fmt_seconds(result["on"]), f"**{result['ratio'] - 1:+.1%}** ({spread})",
                     f"{result['total'] - 1:+.1%}"])
    print(f"### Capture overhead: harness step time, on vs off ({plan.num_rollouts} rollouts x "
          f"{plan.num_turns} turns, same seeds, engines in lockstep, {repeats} run(s) each)\n")
    print(markdown_table(["model", "records", "steps", "median step (off)", "median step (on)",
                          "overhead: median of paired steps (each run)", "overhead (total)"], rows))

    rng = np.random.default_rng(11)
    offload_repeats = 20 if args.quick else 100
    rows = []
    for num_seqs in (64, 256):
        ours, reference = offload_case(num_seqs, offload_repeats, rng)
        rows.append([num_seqs, fmt_seconds(reference), fmt_seconds(ours), f"{reference / ours:.0f}x"])
    print(f"\n### Per-step host offload, decode step ({LAYERS} MoE layers x top-{TOP_K}, uint8, "
          f"CPU Paddle; median of {offload_repeats})\n")
    print(markdown_table(["running sequences", "per-sequence loop (reference)",
                          "one gather + one copy (ours)", "speed-up"], rows))

    cases = [(16, 3, 4), (64, 27, 8), (256, 27, 8)]
    after = [per_call_costs(n, layers, k, offload_repeats * 5) for n, layers, k in cases]
    rows = [[name] + [fmt_seconds(a[name]) for a in after] for name in after[0]]
    rows[-1] = [f"**{rows[-1][0]}**"] + [f"**{cell}**" for cell in rows[-1][1:]]
    print("\n### Capture work per decode step, each call in isolation, compiled ledger (median, CPU Paddle)\n")
    print(markdown_table(["call"] + [f"{n} seqs, {layers} layers x top-{k}" for n, layers, k in cases], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
