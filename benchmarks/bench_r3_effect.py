"""The R3 effect over several seeds: a bf16 Paddle engine against an fp32 transformers trainer.

For each seed (weights and workload), :func:`fdrr_dev.harness.r3_effect.run_r3_effect`
runs rollouts of the tiny Qwen3-MoE (12 layers, 128 experts, top-8) through the harness
engine with bf16 activations and recomputes them in fp32 with transformers, without and
with routing replay; the table shows each seed's metrics side by side and their range.
The control runs the engine in fp32 too (one seed).  Not a speed claim: the seconds are
for orientation only.

Usage: python benchmarks/bench_r3_effect.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import markdown_table  # noqa: E402

from fdrr_dev.harness.r3_effect import (  # noqa: E402
    ENGINE_NUMERICS,
    TRAINER_NUMERICS,
    run_r3_effect,
)

METRICS = (("router decisions that differ", "flip_rate", "{:.4f}"),
           ("tokens with >= 1 layer differing", "token_flip_share", "{:.4f}"),
           ("differing routers per token", "flipped_layers_per_token", "{:.3f}"),
           ("k3 KL(engine ‖ trainer)", "k3_kl", "{:.2e}"),
           ("max abs Δ logprob", "max_abs_logprob_diff", "{:.3g}"))


def _pair(result, key: str, fmt: str) -> str:
    return f"{fmt.format(result.off[key])} → {fmt.format(result.on[key])}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 seeds of 16 rollouts")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    seeds, rollouts = (range(2), 16) if args.quick else (range(5), 64)
    results = [run_r3_effect(rollouts=rollouts, seed=seed) for seed in seeds]
    control = run_r3_effect(rollouts=rollouts, seed=0, engine_activations="float32")

    print(f"### R3 effect: replay off → on, {rollouts} rollouts per seed\n")
    print(f"Engine: {ENGINE_NUMERICS}. Trainer: {TRAINER_NUMERICS}.\n")
    header = ["seed", "sequences", "decisions"] + [name for name, _, _ in METRICS] + ["passed"]
    rows = [[r.seed, r.sequences, r.off["decisions"],
             *[_pair(r, key, fmt) for _, key, fmt in METRICS], r.passed] for r in results]
    print(markdown_table(header, rows))
    print("\n### Range over the seeds (replay off; replay on)\n")
    spread = []
    for name, key, fmt in METRICS:
        off = [r.off[key] for r in results]
        on = [r.on[key] for r in results]
        spread.append([name, f"{fmt.format(min(off))} – {fmt.format(max(off))}",
                       f"{fmt.format(min(on))} – {fmt.format(max(on))}"])
    ratios = [r.off["k3_kl"] / r.on["k3_kl"] for r in results]
    spread.append(["KL off / KL on", f"{min(ratios):.1f}× – {max(ratios):.1f}×", ""])
    print(markdown_table(["metric", "replay off", "replay on"], spread))
    print("\n### Control: the engine in fp32 too (seed 0)\n")
    print(markdown_table(header[:3] + [name for name, _, _ in METRICS],
                         [[control.seed, control.sequences, control.off["decisions"],
                           *[_pair(control, key, fmt) for _, key, fmt in METRICS]]]))
    seconds = [r.seconds["engine"] + r.seconds["trainer"] for r in results]
    print(f"\n{len(results)} seeds; {min(seconds):.1f}–{max(seconds):.1f} s per seed "
          "(engine + trainer, for orientation)")
    return 0 if all(r.passed for r in results) and control.passed else 1


if __name__ == "__main__":
    sys.exit(main())
