"""The harness engine run as real TP ranks: one process per rank, real collectives.

Each rank (started by ``paddle.distributed.launch``, e.g. through
:func:`fdrr_dev.testing.ranks.launch_ranks`) builds the same tiny model and the
same engine, drives the same rollouts, and holds only its own manager (FastDeploy 2.5) or
step capturer (2.6), with ``tp_rank`` = its rank in a real ``paddle.distributed`` group.
Under TP x EP each rank routes only its token share of the step (the split of
:func:`~fdrr_dev.harness.parallel.tp_shards`, the last share padded) and the hook
all-gathers over that group and trims to the step's tokens, as FastDeploy's MoE layer
does; with EP = 1 every rank sees the whole step.  Only rank 0 writes records (2.5's
manager, 2.6's engine side), through an inline writer.

:func:`main` is the per-rank entry: it reads a JSON spec (the rollout plan and a list of
named engine configurations), runs each configuration in turn in one world, and writes
rank 0's records to ``local://<out>/<name>/store``, rank 0's turn results to
``<out>/<name>/results.json`` and every rank's capture counters to
``<out>/<name>/rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fd_routing_replay.capture.fd25 import create_manager
from fd_routing_replay.capture.fd26 import StepRoutingCapturer
from fdrr_dev.harness.engine import Engine, EngineConfig
from fdrr_dev.harness.model import TinyMoEConfig, TinyMoEModel
from fdrr_dev.harness.parallel import ProcessRank
from fdrr_dev.harness.rollouts import RolloutDriver, RolloutPlan, TurnResult
from fdrr_dev.harness.wiring import (
    METADATA,
    capture_config,
    geometry_for,
    inline_writer,
    step_generation,
)

__all__ = ["main", "plan_from", "rank_engine", "run_rank"]


def rank_engine(model: TinyMoEModel, engine_config: EngineConfig, process_rank: ProcessRank, *,
                writer: Any = None) -> Engine:
    """This rank's engine: its own manager (or capturer) only; ``writer`` is used on rank 0."""
    geometry = geometry_for(model.config, engine_config)
    rank = process_rank.rank
    writer = writer if rank == 0 else None
    config = capture_config()
    if engine_config.generation == "step":
        routing, factory = step_generation(            # rank 0: the engine-side slot cache
            geometry, writer=writer, config=config, tp_size=1, num_decoder_layers=model.config.num_layers)

        def build(share_inputs: dict[str, Any]) -> list[Any]:
            if rank == 0:
                return factory(share_inputs)
            return [StepRoutingCapturer(
                max_batched_tokens=geometry.max_num_batched_tokens,
                num_moe_layers=geometry.num_moe_layers, top_k=geometry.top_k,
                num_experts=geometry.num_experts, num_shared_experts=geometry.num_shared_experts,
                tp_rank=rank, attach_host=None)]
        return Engine(model, build, engine_config, routing=routing if rank == 0 else None,
                      process_rank=process_rank)

    def managers(share_inputs: dict[str, Any]) -> list[Any]:
        return [create_manager(config, geometry, block_table=share_inputs["block_tables"], writer=writer,
                               tp_rank=rank, share_inputs=share_inputs, metadata=dict(METADATA),
                               num_decoder_layers=model.config.num_layers)]
    return Engine(model, managers, engine_config, process_rank=process_rank)


def run_rank(plan: RolloutPlan, engine_config: EngineConfig, process_rank: ProcessRank, *,
             writer: Any = None, model_config: TinyMoEConfig | None = None,
             ) -> tuple[Engine, list[TurnResult]]:
    """Drive ``plan``'s rollouts to completion on this rank's engine."""
    model = TinyMoEModel(model_config or TinyMoEConfig())
    engine = rank_engine(model, engine_config, process_rank, writer=writer)
    driver = RolloutDriver(plan, model.config.vocab_size, model.config.eos_token_id)
    driver.run(engine)
    return engine, driver.results


def plan_from(fields: dict[str, Any]) -> RolloutPlan:
    """A :class:`RolloutPlan` from JSON fields (lists become the plan's tuples)."""
    return RolloutPlan(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def _stats(engine: Engine) -> list[dict[str, Any]]:
    return [{k: v for k, v in manager.stats().items() if isinstance(v, (int, float, str))}
            for manager in engine.runner.managers]


def main(argv: Sequence[str] | None = None) -> None:
    """Per-rank entry: ``--spec SPEC.json --out DIR`` (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    options = parser.parse_args(argv)
    spec = json.loads(Path(options.spec).read_text())

    import paddle.distributed as dist

    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    plan = plan_from(spec["plan"])
    for run in spec["runs"]:
        engine_config = EngineConfig(**run["engine"])
        if engine_config.tp_size != world:
            raise SystemExit(f"run {run['name']}: tp_size {engine_config.tp_size} != world {world}")
        out = Path(options.out) / run["name"]
        out.mkdir(parents=True, exist_ok=True)
        writer = inline_writer(f"local://{out / 'store'}", state_dir=out / "writer") if rank == 0 else None
        engine, results = run_rank(plan, engine_config, ProcessRank(group, rank), writer=writer)
        if writer is not None:
            writer.close()
        (out / f"rank{rank}.json").write_text(json.dumps(_stats(engine)))
        if rank == 0:
            (out / "results.json").write_text(json.dumps([asdict(r) for r in results]))
        dist.barrier()


if __name__ == "__main__":
    main()
