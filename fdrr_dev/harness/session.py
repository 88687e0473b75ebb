"""Harness runs: build a model and a capturing engine (wired by :mod:`.wiring`, or a PD
pair with ``disaggregated``), drive multi-turn rollouts through it to completion, and hand
back what the run left behind (:class:`HarnessRun`).

The engines are built by the same wiring the lockstep runs of the demo and the benchmark
use, so every harness run exercises one configuration path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fdrr_dev.harness.disaggregation import DisaggregatedEngine
from fdrr_dev.harness.engine import Engine, EngineConfig
from fdrr_dev.harness.model import TinyMoEConfig, TinyMoEModel
from fdrr_dev.harness.rollouts import RolloutDriver, RolloutPlan, TurnResult
from fdrr_dev.harness.wiring import build_engine, capture_config

__all__ = ["HarnessRun", "run_rollouts"]


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

    @property
    def counters(self) -> dict[str, Any]:
        """Record counters of either generation (submitted, failed, prefix omitted, ...)."""
        routing = getattr(self.engine, "routing", None)
        return routing.counters if routing is not None else self.manager.counters


def run_rollouts(
    plan: RolloutPlan,
    *,
    engine_config: EngineConfig | None = None,
    model_config: TinyMoEConfig | None = None,
    writer: Any = None,
    capture: bool = True,
    fused: bool = True,
    pad_to_max_model_len: bool = False,
    weight_update_after: int | None = None,
    on_step: Callable[[Engine], None] | None = None,
    on_result: Callable[[TurnResult], None] | None = None,
    prefix_omission: bool = False,
    disaggregated: bool | dict[str, Any] = False,
    partial_every_tokens: int = 0,
) -> HarnessRun:
    """Run ``plan``'s multi-turn rollouts to completion through a capturing engine.

    ``weight_update_after=n`` performs one RL weight update (new weights, FastDeploy's
    ``clear_requests`` → ``clear_all_request``) once ``n`` turns have finished; the turns
    in flight are dropped, as FastDeploy drops them.  Records go to ``writer`` (a
    :class:`~fd_routing_replay.writer.RoutingWriter`).  ``engine_config.generation="step"``
    runs FastDeploy 2.6's capture (worker capturer + engine-side finish), where
    ``prefix_omission`` and ``disaggregated`` (a prefill and a decode engine,
    :mod:`fdrr_dev.harness.disaggregation`; a dict passes options to it) apply.
    ``fused``, ``pad_to_max_model_len``, ``prefix_omission`` and ``partial_every_tokens``
    are the ``capture.*`` options of the configuration the engines are built with.
    """
    engine_config = engine_config or EngineConfig()
    model = TinyMoEModel(model_config or TinyMoEConfig())
    managers: list[Any] = []
    config = capture_config(fused=fused, pad_to_max_model_len=pad_to_max_model_len,
                            prefix_omission=prefix_omission, partial_every_tokens=partial_every_tokens)
    options = dict(capture=capture, writer=writer, config=config, managers_out=managers)
    if disaggregated:
        if weight_update_after is not None:
            raise ValueError("RL weight updates are not modelled across a PD pair in the harness")
        pd_options = disaggregated if isinstance(disaggregated, dict) else {}
        engine: Any = DisaggregatedEngine.build(model, engine_config, **options, **pd_options)
    else:
        engine = build_engine(model, engine_config, **options)
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
