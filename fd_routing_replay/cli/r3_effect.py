"""``fd-rr r3-effect``: the R3 effect, measured on a bf16 engine and an fp32 trainer.

Runs :func:`fd_routing_replay.harness.r3_effect.run_r3_effect`: rollouts of a tiny
Qwen3-MoE through the Paddle harness engine (bf16 activations, routes captured into a
local store), then the same tokens recomputed by ``transformers`` in fp32 from the
safetensors checkpoint the harness wrote, once with its own routers and once replaying the
records; prints the R3 paper's metrics side by side.  Needs Paddle and the
``trainer-test`` extra (torch, transformers).  Exit status 1 when replay does not make
the trainer route exactly as the engine did, or does not lower the KL.
"""

from __future__ import annotations

import argparse
import json
import sys

from fd_routing_replay.cli.common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``fd-rr r3-effect``."""
    parser.add_argument("--rollouts", type=int, default=64, help="rollouts (default 64)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the weights and the workload (default 0)")
    parser.add_argument("--output", default=None,
                        help="keep the checkpoint and the store here (default: a temporary "
                             "directory, removed afterwards)")
    parser.add_argument("--engine-activations", choices=("bfloat16", "float32"),
                        default="bfloat16",
                        help="the engine's activation precision (default bfloat16; float32 is "
                             "the control: the engine then computes as the trainer does)")
    parser.add_argument("--json", action="store_true", help="print a JSON object instead")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fd-rr r3-effect``."""
    if args.rollouts < 1:
        print(f"error: --rollouts must be at least 1, got {args.rollouts}", file=sys.stderr)
        return EXIT_USAGE
    from fd_routing_replay.harness.r3_effect import (
        ENGINE_NUMERICS,
        TRAINER_NUMERICS,
        run_r3_effect,
    )

    result = run_r3_effect(rollouts=args.rollouts, seed=args.seed, workdir=args.output,
                           engine_activations=args.engine_activations)
    if args.json:
        print(json.dumps({**result.as_dict(), "engine_activations": args.engine_activations},
                         indent=2))
    else:
        engine = ENGINE_NUMERICS if args.engine_activations == "bfloat16" else \
            "Paddle, fp32 activations (control), paged KV, batched steps"
        print(f"engine:  {engine}\ntrainer: {TRAINER_NUMERICS}\n")
        print(result.table())
        on, off = result.on, result.off
        ratio = off["k3_kl"] / on["k3_kl"] if on["k3_kl"] > 0 else float("inf")
        print(f"\nreplay on: {on['flipped_decisions']} of {on['decisions']} router decisions "
              f"differ from the record; k3 KL {ratio:.1f}x lower than without replay "
              f"({result.seconds['engine']:.1f} s engine, {result.seconds['trainer']:.1f} s "
              "trainer)")
    return EXIT_OK if result.passed else EXIT_FAILURE
