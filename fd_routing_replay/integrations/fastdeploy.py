"""FastDeploy glue: entry points, the runner subclass and the MoE hook rebinding.

Thin on purpose: it only connects FastDeploy's objects to
:mod:`fd_routing_replay.capture`, where all logic lives and is tested without FastDeploy.
Importing this module imports neither FastDeploy nor Paddle; both are imported inside
the functions FastDeploy calls.

Entry points (declared in setup.cfg; FastDeploy loads them when ``FD_PLUGINS`` names
``fd_routing_replay``):

* ``fastdeploy.model_register_plugins`` → :func:`register_model_plugin`: rebinds
  ``save_routing_to_buffer`` in FastDeploy's MoE module, so every ``FusedMoE`` layer
  records through our ``record_routing_`` custom op.
* ``fastdeploy.model_runner_plugins`` → :func:`model_runner_plugin`: returns a
  ``GPUModelRunner`` subclass whose ``initialize_routing_replay_manager`` installs our
  manager (same runner interface, vectorized offload, fused records, background writer).

Enabling stays FastDeploy's: ``--routing-replay-config '{"enable_routing_replay": true,
...}'``.  The plugin's own YAML comes from ``FD_ROUTING_REPLAY_CONFIG`` (FastDeploy drops
unknown JSON keys, so a path cannot travel in that JSON); FastDeploy's flat keys keep
working and win over the YAML when they differ from FastDeploy's defaults.

Written against FastDeploy 2.4 / 2.5 (``release/2.4``, ``release/2.5``, ``develop`` of late
2025, where ``save_routing_to_buffer`` takes ``routing_replay_table, topk_ids,
batch_id_per_token, seq_lens_decoder, cu_seqlens_q, layer_idx, tp_size, ep_size,
tp_group``).  Not run inside FastDeploy in this repository (no FastDeploy GPU build is
available here); see docs/fastdeploy.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from types import ModuleType
from typing import Any

__all__ = [
    "FASTDEPLOY_DEFAULTS",
    "MOE_HOOK_MODULES",
    "check_supported",
    "config_from_fastdeploy_config",
    "geometry_from_fastdeploy_config",
    "make_runner_class",
    "manager_from_fastdeploy",
    "model_register_plugin",
    "model_runner_plugin",
    "rebind_moe_hook",
    "register_model_plugin",
]

logger = logging.getLogger(__name__)

MOE_HOOK_MODULES = (
    "fastdeploy.model_executor.layers.moe.moe",
    "fastdeploy.model_executor.layers.moe.routing_indices_cache",
)
"""Modules whose global ``save_routing_to_buffer`` FusedMoE looks up at forward time."""

FASTDEPLOY_DEFAULTS: dict[str, Any] = {
    "routing_store_type": "local",
    "local_store_dir": "./routing_replay_output",
    "rdma_store_server": "",
    "only_last_turn": False,
    "use_fused_put": False,
}
"""FastDeploy's ``RoutingReplayConfig`` defaults; a flat key at its default does not override."""


# ---------------------------------------------------------------------------- config
def config_from_fastdeploy_config(fd_config: Any, *, env: Mapping[str, str] | None = None) -> Any:
    """Our :class:`RoutingReplayConfig` for a FastDeploy ``FDConfig``.

    Precedence: defaults < ``FD_ROUTING_REPLAY_CONFIG`` YAML < ``FD_RR_*`` variables <
    FastDeploy's flat keys that differ from FastDeploy's defaults.  ``enabled`` is always
    FastDeploy's ``enable_routing_replay``.
    """
    from fd_routing_replay.config import config_from_fastdeploy, load_config

    rr = getattr(fd_config, "routing_replay_config", None)
    flat: dict[str, Any] = {"enable_routing_replay": bool(getattr(rr, "enable_routing_replay", False))}
    for key, default in FASTDEPLOY_DEFAULTS.items():
        value = getattr(rr, key, default)
        if value is not None and value != "None" and value != default:
            flat[key] = value
    return load_config(overrides=config_from_fastdeploy(flat, source="FastDeploy --routing-replay-config"),
                       env=os.environ if env is None else env)


def _top_k(model_config: Any) -> int:
    architectures = list(getattr(model_config, "architectures", None) or [""])
    if architectures[0] == "Glm4MoeForCausalLM":
        return int(model_config.num_experts_per_tok)
    for name in ("moe_k", "num_experts_per_tok"):
        value = getattr(model_config, name, None)
        if value:
            return int(value)
    raise ValueError("cannot find the MoE top-k in the model config (moe_k / num_experts_per_tok)")


def _count(value: Any) -> int:
    if isinstance(value, (list, tuple)):
        return int(sum(value))
    return int(value or 0)


def geometry_from_fastdeploy_config(fd_config: Any, total_block_num: int) -> Any:
    """Capture sizes from an ``FDConfig``, derived the way FastDeploy derives them."""
    from fd_routing_replay.capture.manager import CaptureGeometry

    model = fd_config.model_config
    spec = getattr(fd_config, "speculative_config", None)
    num_spec = int(getattr(spec, "num_speculative_tokens", 0) or 0) if getattr(spec, "method", None) else 0
    return CaptureGeometry(
        max_num_seqs=int(fd_config.scheduler_config.max_num_seqs),
        max_model_len=int(model.max_model_len),
        num_moe_layers=int(model.num_hidden_layers) - int(model.moe_layer_start_index),
        top_k=_top_k(model),
        num_experts=_count(model.moe_num_experts),
        num_shared_experts=_count(getattr(model, "moe_num_shared_experts", 0)),
        block_size=int(fd_config.cache_config.block_size),
        total_block_num=int(total_block_num),
        num_speculative_tokens=num_spec,
    )


def check_supported(fd_config: Any) -> None:
    """Refuse setups where capture would record garbage, naming the setting."""
    from fd_routing_replay.errors import ConfigError

    parallel = fd_config.parallel_config
    if getattr(parallel, "enable_chunked_moe", False):
        raise ConfigError(
            "routing replay does not support enable_chunked_moe: FastDeploy calls the top-k hook "
            "once per MoE chunk without the chunk's token offset; disable chunked MoE")
    if getattr(fd_config.scheduler_config, "splitwise_role", "mixed") != "mixed":
        raise ConfigError(
            "routing replay supports splitwise_role='mixed' only: with disaggregated prefill the "
            "prompt's routing is produced on another instance and never reaches this one")


def manager_from_fastdeploy(fd_config: Any, share_inputs: Any, total_block_num: int, *,
                            env: Mapping[str, str] | None = None) -> Any:
    """Build the manager a FastDeploy runner installs (no-op twin when disabled)."""
    from fd_routing_replay import ops
    from fd_routing_replay.capture.factory import create_manager

    config = config_from_fastdeploy_config(fd_config, env=env)
    geometry = geometry_from_fastdeploy_config(fd_config, total_block_num)
    if config.enabled:
        check_supported(fd_config)
        block_table = share_inputs["block_tables"]
        if not block_table.place.is_cpu_place() and ops.ops_backend() != "compiled":
            from fd_routing_replay.errors import ConfigError

            raise ConfigError(
                "routing replay needs the compiled routing ops on a GPU, but they did not load: "
                f"{ops.ops_backend_reason()}")
    tp_rank = int(getattr(fd_config.parallel_config, "tensor_parallel_rank", 0) or 0)
    return create_manager(config, geometry, block_table=share_inputs["block_tables"],
                          tp_rank=tp_rank, share_inputs=share_inputs,
                          metadata={"engine": "fastdeploy"})


# ---------------------------------------------------------------------------- runner
def make_runner_class(base: type) -> type:
    """Subclass FastDeploy's ``GPUModelRunner`` (``base``) to install our manager."""

    class RoutingReplayGPUModelRunner(base):  # type: ignore[misc, valid-type]
        """``GPUModelRunner`` whose routing replay manager is fd-routing-replay's."""

        def initialize_routing_replay_manager(self) -> None:
            self.routing_replay_manager = manager_from_fastdeploy(
                self.fd_config, self.share_inputs, self.num_gpu_blocks)
            logger.info("fd-routing-replay: installed %s", type(self.routing_replay_manager).__name__)

        def update_share_input_block_num(self, num_gpu_blocks: int) -> None:
            # Versions that build the manager elsewhere (or not at all) still get ours,
            # after the KV cache exists, around share_inputs["block_tables"].
            super().update_share_input_block_num(num_gpu_blocks)
            rr = getattr(self.fd_config, "routing_replay_config", None)
            current = getattr(self, "routing_replay_manager", None)
            if getattr(rr, "enable_routing_replay", False) and not getattr(current, "fdrr_manager", False):
                self.initialize_routing_replay_manager()

    RoutingReplayGPUModelRunner.__qualname__ = f"RoutingReplay{base.__name__}"
    return RoutingReplayGPUModelRunner


def model_runner_plugin() -> type:
    """Entry point of ``fastdeploy.model_runner_plugins``: the runner class to use."""
    from fastdeploy.worker.gpu_model_runner import GPUModelRunner

    return make_runner_class(GPUModelRunner)


# ---------------------------------------------------------------------------- MoE hook
def rebind_moe_hook(modules: list[ModuleType]) -> list[str]:
    """Point each module's ``save_routing_to_buffer`` at ours; returns the names rebound."""
    from fd_routing_replay.capture.hook import save_routing_to_buffer

    rebound = []
    for module in modules:
        if hasattr(module, "save_routing_to_buffer"):
            module.save_routing_to_buffer = save_routing_to_buffer
            rebound.append(module.__name__)
    return rebound


def register_model_plugin() -> None:
    """Entry point of ``fastdeploy.model_register_plugins``: rebind the MoE hook."""
    import importlib

    modules = []
    for name in MOE_HOOK_MODULES:
        try:
            modules.append(importlib.import_module(name))
        except ImportError as exc:
            logger.warning("fd-routing-replay: cannot import %s (%s); its hook is not rebound", name, exc)
    rebound = rebind_moe_hook(modules)
    if not rebound:
        logger.error("fd-routing-replay: found no save_routing_to_buffer to rebind in %s; this "
                     "FastDeploy version is not supported", ", ".join(MOE_HOOK_MODULES))
    else:
        logger.info("fd-routing-replay: MoE routing hook rebound in %s", ", ".join(rebound))


# Entry-point aliases under the group names (either spelling may be declared).
model_register_plugin = register_model_plugin
