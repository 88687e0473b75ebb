"""How a harness engine is built: through the plugin's production constructors.

FastDeploy 2.5's runner installs :func:`~fd_routing_replay.capture.fd25.create_manager`'s
manager, one per TP rank around ``share_inputs["block_tables"]`` after the KV cache, and only
rank 0 writes; FastDeploy 2.6's worker builds one
:class:`~fd_routing_replay.capture.fd26.StepRoutingCapturer` per TP rank and its engine an
:class:`~fd_routing_replay.capture.fd26.EngineRouting` over the shared slot cache.  The
harness calls exactly those, with a :class:`RoutingReplayConfig` made of its options
(:func:`capture_config`) and the caller's :class:`~fd_routing_replay.writer.RoutingWriter`,
so every harness run exercises the wiring production uses.  Sessions, the PD pair and the
lockstep benchmark all build their engines here.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fd_routing_replay import ops
from fd_routing_replay.capture.fd25 import NoopRoutingReplayManager, create_manager
from fd_routing_replay.capture.fd26 import EngineRouting, StepRoutingCapturer
from fd_routing_replay.capture.slots import CaptureGeometry, HostSlotCache
from fd_routing_replay.config import RoutingReplayConfig, config_from_dict
from fd_routing_replay.store import store_config_from
from fd_routing_replay.writer import RoutingWriter
from fdrr_dev.harness.engine import Engine, EngineConfig
from fdrr_dev.harness.model import TinyMoEConfig, TinyMoEModel
from fdrr_dev.harness.slot_routing import SlotRouting

__all__ = ["build_engine", "capture_config", "geometry_for", "inline_writer", "manager_factory",
           "moe_layer_map", "step_generation"]

METADATA = {"engine": "harness"}


def capture_config(*, fused: bool = True, pad_to_max_model_len: bool = False, prefix_omission: bool = False,
                   partial_every_tokens: int = 0, **capture: Any) -> RoutingReplayConfig:
    """The plugin's configuration with these ``capture.*`` options (routing replay on)."""
    return config_from_dict({"enabled": True, "capture": dict(
        capture, fused=fused, pad_to_max_model_len=pad_to_max_model_len, prefix_omission=prefix_omission,
        partial_every_tokens=partial_every_tokens)}, source="harness")


def inline_writer(store: Any, namespace: str | None = None, *, state_dir: str | Path | None = None,
                  capacity_bytes: int = 64 << 20, mode: str = "inline", full_policy: str = "spill",
                  **options: Any) -> RoutingWriter:
    """A :class:`RoutingWriter` for ``store`` (a URL, a dict or a config, and ``namespace``) in
    ``inline`` mode: every submit returns once its record is stored, so a harness run's records
    are in the store as its requests finish -- the production writer, without the wait.
    ``state_dir`` holds its journal and dead letters (default: a new temporary directory);
    ``capacity_bytes``, ``mode`` and ``full_policy`` are its ``writer.*`` settings;
    ``options`` are :class:`RoutingWriter` keywords (``only_last_turn``, ``record_format``,
    ``encoding``, ``partials``, ...).  Close it (or use it as a context manager)."""
    root = Path(state_dir) if state_dir is not None else Path(tempfile.mkdtemp(prefix="fdrr-writer-"))
    return RoutingWriter(store_config_from(store, namespace),
                         {"mode": mode, "capacity_bytes": capacity_bytes, "full_policy": full_policy,
                          "journal_dir": str(root / "journal"),
                          "dead_letter_dir": str(root / "dead")}, **options)


def geometry_for(model_config: TinyMoEConfig, engine_config: EngineConfig) -> CaptureGeometry:
    """The capture sizes FastDeploy would derive for this model and engine."""
    return CaptureGeometry(
        max_num_seqs=engine_config.max_num_seqs, max_model_len=model_config.max_model_len,
        num_moe_layers=model_config.num_moe_layers, top_k=model_config.top_k,
        num_experts=model_config.num_experts, num_shared_experts=model_config.num_shared_experts,
        layer_map=moe_layer_map(model_config),
        block_size=engine_config.block_size, total_block_num=engine_config.num_blocks,
        num_speculative_tokens=engine_config.num_speculative_tokens,
        max_num_batched_tokens=engine_config.max_num_batched_tokens)


def moe_layer_map(model_config: Any) -> tuple[int, ...]:
    """The decoder layer of each MoE layer, as a record's layer map names them: the
    config's ``moe_layers`` when it has them (Qwen3-MoE's ``mlp_only_layers``), else the
    layers from ``moe_layer_start_index`` on."""
    layers = getattr(model_config, "moe_layers", None)
    if layers is not None:
        return tuple(int(layer) for layer in layers)
    return tuple(range(model_config.moe_layer_start_index, model_config.num_layers))


def manager_factory(geometry: CaptureGeometry, *, capture: bool = True, writer: Any = None,
                    config: RoutingReplayConfig | None = None, tp_size: int = 1,
                    num_decoder_layers: int | None = None,
                    managers_out: list[Any] | None = None) -> Callable[[dict[str, Any]], list[Any]]:
    """A factory the runner calls with its ``share_inputs``: one manager per TP rank, each
    :func:`create_manager`'s; rank 0 writes through ``writer``."""
    config = config or capture_config()
    if capture and writer is None:
        raise ValueError("a capturing table-API engine writes its records through a writer (TP rank 0): "
                         "pass writer=")

    def build(share_inputs: dict[str, Any]) -> list[Any]:
        if not capture:
            made: list[Any] = [NoopRoutingReplayManager() for _ in range(tp_size)]
        else:
            made = [create_manager(config, geometry, block_table=share_inputs["block_tables"], tp_rank=rank,
                                   share_inputs=share_inputs, writer=writer if rank == 0 else None,
                                   metadata=dict(METADATA), num_decoder_layers=num_decoder_layers)
                    for rank in range(tp_size)]
        if managers_out is not None:
            managers_out.extend(made)
        return made
    return build


def step_generation(geometry: CaptureGeometry, *, capture: bool = True, writer: Any = None,
                    config: RoutingReplayConfig | None = None, tp_size: int = 1,
                    managers_out: list[Any] | None = None, num_decoder_layers: int | None = None,
                    overlap_schedule: bool = False,
                    ) -> tuple[SlotRouting | None, Callable[[dict[str, Any]], list[Any]]]:
    """FastDeploy 2.6's arrangement: the engine's side over its host slot cache (writing
    through ``writer``; None: a PD prefill instance, which writes no record) and a factory of
    one :class:`StepRoutingCapturer` per TP rank (rank 0 writes the host cache)."""
    if not capture:
        return None, manager_factory(geometry, capture=False, tp_size=tp_size, managers_out=managers_out)
    config = config or capture_config()
    dtype = ops.routing_dtype(geometry.num_experts + geometry.num_shared_experts)
    host = HostSlotCache(geometry.total_block_num * geometry.block_size, geometry.num_moe_layers,
                         geometry.top_k, dtype, ops.fill_value(dtype))
    routing = SlotRouting(EngineRouting(config, geometry, host, writer=writer, writes_records=writer is not None,
                                        metadata=dict(METADATA), num_decoder_layers=num_decoder_layers))

    def build(share_inputs: dict[str, Any]) -> list[Any]:
        made = [StepRoutingCapturer(
            max_batched_tokens=geometry.max_num_batched_tokens, num_moe_layers=geometry.num_moe_layers,
            top_k=geometry.top_k, num_experts=geometry.num_experts,
            num_shared_experts=geometry.num_shared_experts, tp_rank=rank,
            overlap_schedule=overlap_schedule,   # FastDeploy's enable_overlap_schedule
            attach_host=(lambda: host) if rank == 0 else None) for rank in range(tp_size)]
        if managers_out is not None:
            managers_out.extend(made)
        return made
    return routing, build


def build_engine(model: TinyMoEModel, engine_config: EngineConfig, *, capture: bool = True,
                 writer: Any = None, config: RoutingReplayConfig | None = None,
                 managers_out: list[Any] | None = None) -> Engine:
    """An engine of ``engine_config.generation`` with its capture wired as FastDeploy wires
    it; ``config`` (default :func:`capture_config`) carries the ``capture.*`` options."""
    geometry = geometry_for(model.config, engine_config)
    config = config or capture_config()
    if engine_config.generation == "step":
        routing, factory = step_generation(
            geometry, capture=capture, writer=writer, config=config, tp_size=engine_config.tp_size,
            managers_out=managers_out, num_decoder_layers=model.config.num_layers,
            overlap_schedule=engine_config.overlap_schedule)
        return Engine(model, factory, engine_config, routing=routing)
    if config.capture.prefix_omission:
        raise ValueError("prefix omission is FastDeploy 2.6's engine side: use generation='step'")
    return Engine(model, manager_factory(
        geometry, capture=capture, writer=writer, config=config, tp_size=engine_config.tp_size,
        num_decoder_layers=model.config.num_layers, managers_out=managers_out), engine_config)
