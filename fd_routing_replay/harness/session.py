"""Wiring for harness runs: model + engine + capture managers + sink, then rollouts.

Tests, the demo and the benchmark all build their runs here, so they exercise one
configuration path: the managers are created the way FastDeploy's runner creates its
own (around ``share_inputs["block_tables"]``, after the KV cache), one per TP rank, and
only rank 0 gets the sink.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fd_routing_replay.capture.manager import CaptureGeometry, RoutingReplayManager
from fd_routing_replay.capture.noop import NoopRoutingReplayManager
from fd_routing_replay.capture.sink import RecordSink
from fd_routing_replay.harness.engine import Engine, EngineConfig
from fd_routing_replay.harness.model import TinyMoEConfig, TinyMoEModel
from fd_routing_replay.harness.rollouts import RolloutDriver, RolloutPlan, TurnResult


def geometry_for(model_config: TinyMoEConfig, engine_config: EngineConfig) -> CaptureGeometry:
    """The capture sizes FastDeploy would derive for this model and engine."""
    return CaptureGeometry(
        max_num_seqs=engine_config.max_num_seqs, max_model_len=model_config.max_model_len,
        num_moe_layers=model_config.num_moe_layers, top_k=model_config.top_k,
        num_experts=model_config.num_experts, num_shared_experts=model_config.num_shared_experts,
        block_size=engine_config.block_size, total_block_num=engine_config.num_blocks,
        num_speculative_tokens=engine_config.num_speculative_tokens,
        max_num_batched_tokens=engine_config.max_num_batched_tokens)


def manager_factory(geometry: CaptureGeometry, *, capture: bool = True, sink: RecordSink | None = None,
                    tp_size: int = 1, fused: bool = True, pad_to_max_model_len: bool = False,
                    managers_out: list[Any] | None = None,
                    manager_cls: type = RoutingReplayManager) -> Callable[[dict[str, Any]], list[Any]]:
    """A factory the runner calls with its ``share_inputs`` (one manager per TP rank)."""
    def build(share_inputs: dict[str, Any]) -> list[Any]:
        if not capture:
            made: list[Any] = [NoopRoutingReplayManager() for _ in range(tp_size)]
        else:
            made = [manager_cls(
                geometry, block_table=share_inputs["block_tables"], sink=sink if rank == 0 else None,
                tp_rank=rank, fused=fused, pad_to_max_model_len=pad_to_max_model_len,
                share_inputs=share_inputs) for rank in range(tp_size)]
        if managers_out is not None:
            managers_out.extend(made)
        return made
    return build


@dataclass
class HarnessRun:
    """Everything a finished run leaves behind."""

    engine: Engine
    managers: list[Any]
    results: list[TurnResult]
    models: dict[int, TinyMoEModel] = field(default_factory=dict)

    def model_for_version(self, version: int) -> TinyMoEModel:
        return self.models[version]

    @property
    def manager(self) -> Any:
        return self.managers[0]


def run_rollouts(
    plan: RolloutPlan,
    *,
    engine_config: EngineConfig | None = None,
    model_config: TinyMoEConfig | None = None,
    sink: RecordSink | None = None,
    capture: bool = True,
    fused: bool = True,
    pad_to_max_model_len: bool = False,
    weight_update_after: int | None = None,
    on_step: Callable[[Engine], None] | None = None,
    on_result: Callable[[TurnResult], None] | None = None,
    manager_cls: type = RoutingReplayManager,
) -> HarnessRun:
    """Run ``plan``'s multi-turn rollouts to completion through a capturing engine.

    ``weight_update_after=n`` performs one RL weight update (new weights, FastDeploy's
    ``clear_requests`` → ``clear_all_request``) once ``n`` turns have finished; the turns
    in flight are dropped, as FastDeploy drops them.  ``manager_cls`` swaps the manager
    (e.g. a subclass reproducing the reference's behaviour, to show the check catches it).
    """
    engine_config = engine_config or EngineConfig()
    model = TinyMoEModel(model_config or TinyMoEConfig())
    geometry = geometry_for(model.config, engine_config)
    managers: list[Any] = []
    engine = Engine(model, manager_factory(
        geometry, capture=capture, sink=sink, tp_size=engine_config.tp_size, fused=fused,
        pad_to_max_model_len=pad_to_max_model_len, managers_out=managers,
        manager_cls=manager_cls), engine_config)
    driver = RolloutDriver(plan, model.config.vocab_size, model.config.eos_token_id,
                           on_result=on_result)
    run = HarnessRun(engine, managers, driver.results, {model.weights_version: model})
    updated = weight_update_after is None

    def step_hook(current: Engine) -> None:
        nonlocal updated
        if not updated and len(driver.results) >= weight_update_after:
            updated = True
            new_model = TinyMoEModel(current.model.config,
                                     weights_version=current.model.weights_version + 1)
            run.models[new_model.weights_version] = new_model
            for request in current.update_weights(new_model):
                driver.on_done(request)
        if on_step is not None:
            on_step(current)

    driver.run(engine, on_step=step_hook)
    return run
