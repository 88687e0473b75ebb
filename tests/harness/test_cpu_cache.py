"""CPU KV cache (#12): cached blocks swap GPU → CPU → GPU with their routing rows.

Memory is tight (40 GPU blocks for 12 sequences) and every rollout shares the system
prompt, so cached prefix blocks are evicted to the CPU tier and later prefix hits swap
them back into other GPU blocks (FastDeploy's ``_swap_routing`` moves the rows with the
KV).  The negative test moves only the KV: the swapped-in blocks then show the routes of
the GPU block's previous occupant, and the fidelity check catches it.
"""

from __future__ import annotations

from fdrr_dev.harness.rollouts import RolloutPlan
from tests.harness.test_scenarios import GENERATIONS, assert_passed, config

TIGHT = dict(num_blocks=40, max_num_seqs=12, num_cpu_blocks=32)


@GENERATIONS
def test_routes_follow_blocks_through_the_cpu_tier(seed, generation, run_checked):
    plan = RolloutPlan(num_rollouts=12, seed=seed % 1000)
    run, report, _ = run_checked(plan, config(generation, **TIGHT))
    assert_passed(report)
    blocks, transfer = run.engine.blocks, run.engine.blocks.swapper
    assert blocks.swapped_out > 0 and blocks.swapped_in > 0 and blocks.cpu_hit_tokens > 0
    assert transfer.moved_elsewhere > 0               # swapped back into another GPU block
    assert transfer.blocks_moved == {"to_cpu": blocks.swapped_out, "to_gpu": blocks.swapped_in}


def test_check_catches_routes_left_behind_by_a_swap(seed, run_checked):
    plan = RolloutPlan(num_rollouts=12, seed=seed % 1000)
    run, report, _ = run_checked(plan, config("step", cpu_swap_routing=False, **TIGHT))
    assert run.engine.blocks.swapper.moved_elsewhere > 0
    assert not report.passed
    assert report.decisive_disagreements > 0          # the previous occupant's routes
