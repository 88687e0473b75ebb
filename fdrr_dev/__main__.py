"""``python -m fdrr_dev``: the demo and the R3-effect measurement, from a checkout.

* ``demo``: multi-turn rollouts through the harness engine with capture on, read back and
  checked against a teacher-forced forward (``make demo``);
* ``r3-effect``: rollouts of a tiny Qwen3-MoE through the harness engine in bf16
  activations, recomputed by ``transformers`` in fp32 from the checkpoint the harness
  wrote, without and with routing replay; prints the R3 paper's metrics side by side.
  Needs the ``trainer-test`` extra.  Exit status 1 when replay does not make the trainer
  route exactly as the engine did, or does not lower the KL.

Exit status: 0 success, 1 failure, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

__all__ = ["main"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def _r3_effect_arguments(parser: argparse.ArgumentParser) -> None:
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


def _r3_effect(args: argparse.Namespace) -> int:
    if args.rollouts < 1:
        print(f"error: --rollouts must be at least 1, got {args.rollouts}", file=sys.stderr)
        return EXIT_USAGE
    from fdrr_dev.harness.r3_effect import ENGINE_NUMERICS, TRAINER_NUMERICS, run_r3_effect

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


def build_parser() -> argparse.ArgumentParser:
    from fdrr_dev.harness import demo

    parser = argparse.ArgumentParser(prog="python -m fdrr_dev", allow_abbrev=False,
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("demo", help="run the end-to-end demo on the local store",
                       description="Run multi-turn rollouts through the harness engine with "
                                   "capture on, read the records back and check them against a "
                                   "teacher-forced forward pass.")
    demo.add_arguments(p)
    p.set_defaults(func=demo.run)
    p = sub.add_parser("r3-effect", help="measure R3: a bf16 engine vs an fp32 trainer, replay off/on",
                       description="Rollouts of a tiny Qwen3-MoE through the harness engine (bf16), "
                                   "recomputed by transformers in fp32 without and with replay.")
    _r3_effect_arguments(p)
    p.set_defaults(func=_r3_effect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
