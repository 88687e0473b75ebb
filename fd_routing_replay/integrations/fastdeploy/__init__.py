"""FastDeploy glue: entry points, the runner subclass, and where the MoE hook is bound.

Thin on purpose: it connects FastDeploy's objects to :mod:`fd_routing_replay.capture`
(capture) and :mod:`fd_routing_replay.integrations.fastdeploy.engine` (2.6's engine side), where
the logic lives and is tested without FastDeploy.  Importing this module imports neither
FastDeploy nor Paddle.  File:line references are to ``../shared/fastdeploy/<version>``;
the contract tier (``tests/fastdeploy_contract``) runs FastDeploy's own code around it.

Entry points (setup.cfg; FastDeploy loads them when ``FD_PLUGINS`` names
``fd_routing_replay``, fastdeploy/plugins/utils.py):

* ``fastdeploy.model_runner_plugins`` → :func:`model_runner_plugin`: a ``GPUModelRunner``
  subclass whose ``initialize_routing_replay_manager`` (called by
  ``GpuWorker.initialize_cache`` only when routing replay is enabled, gpu_worker.py:188)
  installs our manager — the request-level manager for FastDeploy 2.5 / develop, the step
  capturer for 2.6 — and binds the MoE hook to ours.  On XPU and the other platforms with
  runners of their own it raises, so FastDeploy's worker falls back to its own runner
  (xpu_worker.py:35-38).
* ``fastdeploy.token_processor_plugins`` → :func:`token_processor_plugin`: FastDeploy's
  ``TokenProcessor``, and with 2.6 a subclass that assembles finished requests into our
  records (see :mod:`fd_routing_replay.integrations.fastdeploy.engine`).

Enabling stays FastDeploy's: ``--routing-replay-config '{"enable_routing_replay": true,
...}'``.  Our YAML comes from ``FD_ROUTING_REPLAY_CONFIG``.
"""

from __future__ import annotations

import logging
from typing import Any

from fd_routing_replay.errors import ConfigError

__all__ = ["bind_moe_hook", "build_manager", "make_runner_class", "model_runner_plugin",
           "route_logs_to_fastdeploy", "token_processor_plugin"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- logging
def route_logs_to_fastdeploy(fd_logger: Any = None) -> None:
    """Send the plugin's log lines to FastDeploy's own log handlers.

    Inside FastDeploy our ``fd_routing_replay`` logger gets the handlers of FastDeploy's
    worker logger (``log/workerlog.*`` / ``gpu_worker.log``), so the lines the docs tell
    operators to look for land where FastDeploy's do.
    """
    if fd_logger is None:
        try:
            from fastdeploy.utils import get_logger
        except ImportError:
            return
        fd_logger = get_logger("gpu_worker", "gpu_worker.log")
    ours = logging.getLogger("fd_routing_replay")
    for handler in getattr(fd_logger, "handlers", ()):
        if handler not in ours.handlers:
            ours.addHandler(handler)
    if ours.handlers:
        ours.setLevel(min(logging.INFO, fd_logger.level or logging.INFO))
        ours.propagate = False


# ---------------------------------------------------------------------------- hook
def bind_moe_hook(api: Any) -> None:
    """Point FastDeploy's MoE hook at ours, keeping FastDeploy's as the fallback.

    ``FusedMoE.forward`` looks the hook up as a module global at every call (moe.py:702 in
    2.5, :750 in 2.6), so rebinding before the first forward is enough; buffers that are
    not ours are handed to FastDeploy's original (:func:`capture.device.set_fallback`).
    """
    import importlib

    from fd_routing_replay.capture import device as hook
    from fd_routing_replay.integrations.fastdeploy.api import CACHE_MODULE, MOE_MODULE

    ours = getattr(hook, api.hook_name)
    hook.set_fallback(api.hook_name, api.original_hook)
    for name in (MOE_MODULE, CACHE_MODULE):
        module = importlib.import_module(name)
        if getattr(module, api.hook_name, None) is not ours:
            setattr(module, api.hook_name, ours)


# ---------------------------------------------------------------------------- managers
def build_manager(runner: Any, api: Any) -> Any:
    """Our manager for ``runner`` (a FastDeploy ``GPUModelRunner``) and FastDeploy's API."""
    from fd_routing_replay.integrations.fastdeploy import setup as fd_setup
    from fd_routing_replay.integrations.fastdeploy.api import STEP_BUFFER

    fd_config = runner.fd_config
    config = fd_setup.config_from_fastdeploy_config(fd_config)
    fd_setup.check_supported(fd_config, generation=api.generation)
    if config.capture.verify and fd_setup.expert_groups_of(fd_config.model_config) is not None:
        raise ConfigError(f"capture.verify is not supported with {fd_setup.architecture_of(fd_config.model_config)}'s "
                          "per-modality expert groups (two MoE hook calls per layer)")
    geometry = fd_setup.geometry_from_fastdeploy_config(fd_config, runner.num_gpu_blocks)
    rows = fd_setup.fastdeploy_layer_rows(fd_config.model_config, geometry.layers)
    tp_rank = int(getattr(fd_config.parallel_config, "tensor_parallel_rank", 0) or 0)
    from fd_routing_replay.integrations.fastdeploy.model_rows import row_assembler

    assembler = row_assembler(fd_config, getattr(runner, "model", None))   # EPLB, chunks, expert groups
    if api.generation == STEP_BUFFER:
        from fd_routing_replay.capture.fd26 import StepRoutingCapturer
        from fd_routing_replay.integrations.fastdeploy.engine import attach_shared_slots

        return _verifying(config, fd_config, geometry, _assembled(assembler, StepRoutingCapturer(
            max_batched_tokens=fd_setup.max_batched_tokens(fd_config),
            num_moe_layers=geometry.num_moe_layers, top_k=geometry.top_k,
            num_experts=geometry.num_experts, num_shared_experts=geometry.num_shared_experts,
            tp_rank=tp_rank,
            overlap_schedule=bool(getattr(fd_config.scheduler_config, "enable_overlap_schedule", False)),
            attach_host=lambda: attach_shared_slots(fd_config, geometry), layer_rows=rows)))
    import dataclasses

    from fd_routing_replay.capture.fd25 import create_manager

    # The table API's forward writes the same token-major step buffer: size it like 2.6's.
    try:
        step_rows = fd_setup.max_batched_tokens(fd_config)
    except AttributeError:       # a config without the scheduler's token budget: derived
        step_rows = 0
    geometry = dataclasses.replace(geometry, max_num_batched_tokens=step_rows)
    block_table = runner.share_inputs["block_tables"]
    return _verifying(config, fd_config, geometry, _assembled(assembler, create_manager(
        config, geometry, block_table=block_table, tp_rank=tp_rank,
        share_inputs=runner.share_inputs, layer_rows=rows,
        identity=fd_setup.rank_identity(fd_config),
        num_decoder_layers=int(fd_config.model_config.num_hidden_layers),
        metadata={"engine": "fastdeploy", "fastdeploy": api.fastdeploy_version,
                  **fd_setup.record_metadata(fd_config)})))


def _assembled(assembler: Any, manager: Any) -> Any:
    """``manager`` whose MoE hook assembles its rows with ``assembler`` (None: as they come)."""
    if assembler is not None:
        manager.binding.assemble = manager.step.assembler = assembler
    return manager


def _verifying(config: Any, fd_config: Any, geometry: Any, manager: Any) -> Any:
    """``manager`` in verification mode when ``capture.verify`` asks for it (the hook then
    records a known pattern instead of the routing; ``fd-rr selftest`` checks it)."""
    if config.capture.verify:
        from fd_routing_replay.capture.device import enable_verification
        from fd_routing_replay.integrations.fastdeploy import setup as fd_setup

        enable_verification(manager, num_experts=geometry.num_experts, top_k=geometry.top_k,
                            layer_map=geometry.layers,
                            tp_size=fd_setup.tp_size(fd_config))
    return manager


# ---------------------------------------------------------------------------- runner
def make_runner_class(base: type, api: Any = None) -> type:
    """Subclass FastDeploy's ``GPUModelRunner`` (``base``) to install our manager."""

    class RoutingReplayGPUModelRunner(base):  # type: ignore[misc, valid-type]
        """``GPUModelRunner`` whose routing replay manager is fd-routing-replay's."""

        def initialize_routing_replay_manager(self) -> None:
            """Install our manager once; a repeated call with the same KV size keeps it."""
            from fd_routing_replay.integrations.fastdeploy.api import (
                check_manager_covers,
                detect_api,
            )

            current = getattr(self, "routing_replay_manager", None)
            blocks = int(self.num_gpu_blocks)
            if getattr(current, "fdrr_manager", False) and getattr(current, "fdrr_blocks", None) == blocks:
                return
            resolved = api or detect_api().with_members_used()
            if getattr(current, "fdrr_manager", False):
                # KV cache re-sized: flush and release the old manager (its writer holds the
                # rank's journal) before its successor starts.
                self.routing_replay_manager = None
                current.close()
            manager = build_manager(self, resolved)
            try:
                check_manager_covers(manager, resolved.members_used or frozenset())
            except ConfigError:
                manager.close()
                raise
            manager.fdrr_blocks = blocks
            self.routing_replay_manager = manager
            bind_moe_hook(resolved)
            logger.info("fd-routing-replay: installed %s for FastDeploy %s (%s interface)",
                        type(manager).__name__, resolved.fastdeploy_version, resolved.generation)

    RoutingReplayGPUModelRunner.__qualname__ = f"RoutingReplay{base.__name__}"
    return RoutingReplayGPUModelRunner


OTHER_PLATFORMS = ("xpu", "npu", "gcu", "intel_hpu", "iluvatar", "maca", "dcu")
"""FastDeploy platforms with their own worker and runner (``current_platform.is_<name>()``)."""


def _require_gpu_runner() -> None:
    """Raise on platforms whose worker also loads runner plugins but needs its own runner."""
    from fastdeploy.platforms import current_platform

    for name in OTHER_PLATFORMS:
        probe = getattr(current_platform, f"is_{name}", None)
        if callable(probe) and probe():
            raise ConfigError(f"fd-routing-replay supports FastDeploy's GPU model runner only; this "
                              f"worker runs on {name}, so FastDeploy keeps its own runner")


def model_runner_plugin() -> type:
    """Entry point of ``fastdeploy.model_runner_plugins``: the runner class to use."""
    from fd_routing_replay.integrations.fastdeploy.api import detect_api

    _require_gpu_runner()
    route_logs_to_fastdeploy()
    api = detect_api().with_members_used()
    from fastdeploy.worker.gpu_model_runner import GPUModelRunner

    return make_runner_class(GPUModelRunner, api)


def token_processor_plugin() -> type:
    """Entry point of ``fastdeploy.token_processor_plugins``: the engine's token processor.

    In the engine process the plugin's log lines go to FastDeploy's engine log
    (``log/fastdeploy.log``, FastDeploy's ``llm_logger``, utils.py:1198 in 2.6); without
    that its INFO lines (``engine-side routing assembly ready``) went nowhere.
    """
    from fastdeploy.output.token_processor import TokenProcessor
    from fastdeploy.utils import llm_logger

    from fd_routing_replay.integrations.fastdeploy.api import STEP_BUFFER, detect_api

    route_logs_to_fastdeploy(llm_logger)
    api = detect_api()
    if api.generation != STEP_BUFFER:
        return TokenProcessor        # 2.5: records are assembled in the worker
    from fd_routing_replay.integrations.fastdeploy.engine import install_engine_side

    return install_engine_side(TokenProcessor)
