"""Capture overhead, measured fairly: capture-off and capture-on engines in lockstep.

Both engines run the same plan on the same seeds, so they follow the same schedule
(capture never changes generation): step k of one is the same work as step k of the
other.  They step alternately (who goes first alternates too), so load from other
processes hits both alike, and each pair gives one on/off ratio.  The figure reported is
the **median of the paired per-step ratios** (robust to a step that another process
slowed down) and the ratio of the summed step times; "step time" is the engine's
``insert_tasks_v1`` + ``execute_model`` (forward, sampling, post-processing with the
capture calls), not wall clock of the whole run.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fdrr_dev.harness.engine import Engine, EngineConfig
from fdrr_dev.harness.model import TinyMoEConfig, TinyMoEModel
from fdrr_dev.harness.rollouts import RolloutDriver, RolloutPlan, TurnResult
from fdrr_dev.harness.session import HarnessRun
from fdrr_dev.harness.wiring import geometry_for, manager_factory

__all__ = ["PairedTiming", "run_lockstep"]


@dataclass
class PairedTiming:
    """Per-step times of the two engines, paired by step."""

    off: list[float] = field(default_factory=list)
    on: list[float] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.on)

    @property
    def paired_overhead(self) -> float:
        """Median over steps of on/off - 1 (the headline figure)."""
        return statistics.median(a / b for a, b in zip(self.on, self.off, strict=True)) - 1 if self.on else 0.0

    @property
    def total_overhead(self) -> float:
        """Summed on time / summed off time - 1."""
        return sum(self.on) / sum(self.off) - 1 if self.off and sum(self.off) > 0 else 0.0

    @property
    def median_off(self) -> float:
        return statistics.median(self.off) if self.off else 0.0

    @property
    def median_on(self) -> float:
        return statistics.median(self.on) if self.on else 0.0

    def extend(self, other: PairedTiming) -> None:
        self.off.extend(other.off)
        self.on.extend(other.on)


def run_lockstep(
    plan: RolloutPlan,
    *,
    engine_config: EngineConfig | None = None,
    model_config: TinyMoEConfig | None = None,
    writer: Any = None,
    on_step: Callable[[Engine], None] | None = None,
    on_result: Callable[[TurnResult], None] | None = None,
) -> tuple[HarnessRun, PairedTiming]:
    """Run ``plan`` with capture on (records through ``writer``) and off, in lockstep.

    Returns the capture-on run (results, managers, models: what the fidelity check
    needs) and the paired step times.  Raises if the schedules diverge.
    """
    engine_config = engine_config or EngineConfig()
    engines: dict[str, Engine] = {}
    drivers: dict[str, RolloutDriver] = {}
    managers: list[Any] = []
    models: dict[str, TinyMoEModel] = {}
    for mode in ("off", "on"):
        model = TinyMoEModel(model_config or TinyMoEConfig())
        models[mode] = model
        factory = manager_factory(geometry_for(model.config, engine_config), capture=mode == "on",
                                  writer=writer if mode == "on" else None, tp_size=engine_config.tp_size,
                                  num_decoder_layers=model.config.num_layers,
                                  managers_out=managers if mode == "on" else None)
        engines[mode] = Engine(model, factory, engine_config)
        drivers[mode] = RolloutDriver(plan, model.config.vocab_size, model.config.eos_token_id,
                                      on_result=on_result if mode == "on" else None)
        drivers[mode].start(engines[mode])
    timing = PairedTiming()
    order = ["off", "on"]
    while engines["on"].has_work or engines["off"].has_work:
        took: dict[str, float] = {}
        for mode in order:
            engine, driver = engines[mode], drivers[mode]
            driver.tick()
            before = engine.step_seconds
            for request in engine.step():
                driver.on_done(request)
            took[mode] = engine.step_seconds - before
        order.reverse()                           # alternate who goes first
        if took["on"] > 0 and took["off"] > 0:
            timing.off.append(took["off"])
            timing.on.append(took["on"])
        if on_step is not None:
            on_step(engines["on"])
    engines["on"].flush()
    if engines["on"].steps != engines["off"].steps:
        raise RuntimeError("capture changed the schedule: the lockstep comparison is void")
    run = HarnessRun(engines["on"], managers, drivers["on"].results,
                     {models["on"].weights_version: models["on"]})
    return run, timing
