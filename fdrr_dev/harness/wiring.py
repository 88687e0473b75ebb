"""How a harness engine is built with its capture wired as FastDeploy wires it.

The managers are created the way FastDeploy's runner creates its own (around
``share_inputs["block_tables"]``, after the KV cache), one per TP rank, and only rank 0
gets the sink; the step generation adds the engine's host slot cache and finisher.
Sessions, the PD pair and the lockstep benchmark all build their engines here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fd_routing_replay import ops
from fd_routing_replay.capture.host_cache import HostSlotCache
from fd_routing_replay.capture.manager import CaptureGeometry, RoutingReplayManager
from fd_routing_replay.capture.noop import NoopRoutingReplayManager
from fd_routing_replay.capture.sink import RecordSink
from fd_routing_replay.capture.step_capture import StepRoutingCapturer
from fdrr_dev.harness.engine import Engine, EngineConfig
from fdrr_dev.harness.model import TinyMoEConfig, TinyMoEModel
from fdrr_dev.harness.slot_routing import SlotRouting

__all__ = ["build_engine", "geometry_for", "manager_factory", "moe_layer_map", "step_generation"]


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


def manager_factory(geometry: CaptureGeometry, *, capture: bool = True, sink: RecordSink | None = None,
                    tp_size: int = 1, fused: bool = True, pad_to_max_model_len: bool = False,
                    managers_out: list[Any] | None = None, manager_cls: type = RoutingReplayManager,
                    partial_every_tokens: int = 0) -> Callable[[dict[str, Any]], list[Any]]:
    """A factory the runner calls with its ``share_inputs`` (one manager per TP rank);
    ``partial_every_tokens`` turns on rank 0's partial records (``capture.partial_every_tokens``)."""
    def build(share_inputs: dict[str, Any]) -> list[Any]:
        if not capture:
            made: list[Any] = [NoopRoutingReplayManager() for _ in range(tp_size)]
        else:
            made = [manager_cls(
                geometry, block_table=share_inputs["block_tables"], sink=sink if rank == 0 else None,
                tp_rank=rank, fused=fused, pad_to_max_model_len=pad_to_max_model_len,
                share_inputs=share_inputs) for rank in range(tp_size)]
            for manager in made:
                manager.enable_partials(partial_every_tokens)   # as create_manager does
        if managers_out is not None:
            managers_out.extend(made)
        return made
    return build


def step_generation(geometry: CaptureGeometry, *, capture: bool = True, sink: RecordSink | None = None,
                    tp_size: int = 1, fused: bool = True, pad_to_max_model_len: bool = False,
                    prefix_omission: bool = False, managers_out: list[Any] | None = None,
                    num_decoder_layers: int | None = None, overlap_schedule: bool = False,
                    partial_every_tokens: int = 0,
                    ) -> tuple[SlotRouting | None, Callable[[dict[str, Any]], list[Any]]]:
    """FastDeploy 2.6's arrangement: the engine's host slot cache and finisher, and a
    factory of one :class:`StepRoutingCapturer` per TP rank (rank 0 writes the host cache)."""
    if not capture:
        return None, manager_factory(geometry, capture=False, tp_size=tp_size, managers_out=managers_out)
    dtype = ops.routing_dtype(geometry.num_experts + geometry.num_shared_experts)
    host = HostSlotCache(geometry.total_block_num * geometry.block_size, geometry.num_moe_layers,
                         geometry.top_k, dtype, ops.fill_value(dtype))
    routing = SlotRouting(host, num_experts=geometry.num_experts, block_size=geometry.block_size,
                          sink=sink, fused=fused,
                          pad_to=geometry.max_model_len if pad_to_max_model_len else None,
                          prefix_omission=prefix_omission, num_decoder_layers=num_decoder_layers,
                          layer_map=geometry.layers, partial_every_tokens=partial_every_tokens)

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
                 sink: RecordSink | None = None, fused: bool = True, pad_to_max_model_len: bool = False,
                 prefix_omission: bool = False, managers_out: list[Any] | None = None,
                 manager_cls: type = RoutingReplayManager, partial_every_tokens: int = 0) -> Engine:
    """An engine of ``engine_config.generation`` with its capture wired as FastDeploy wires it."""
    geometry = geometry_for(model.config, engine_config)
    if engine_config.generation == "step":
        routing, factory = step_generation(
            geometry, capture=capture, sink=sink, tp_size=engine_config.tp_size, fused=fused,
            pad_to_max_model_len=pad_to_max_model_len, prefix_omission=prefix_omission,
            managers_out=managers_out, num_decoder_layers=model.config.num_layers,
            overlap_schedule=engine_config.overlap_schedule, partial_every_tokens=partial_every_tokens)
        return Engine(model, factory, engine_config, routing=routing)
    if prefix_omission:
        raise ValueError("prefix omission is FastDeploy 2.6's engine side: use generation='step'")
    return Engine(model, manager_factory(
        geometry, capture=capture, sink=sink, tp_size=engine_config.tp_size, fused=fused,
        pad_to_max_model_len=pad_to_max_model_len, managers_out=managers_out,
        manager_cls=manager_cls, partial_every_tokens=partial_every_tokens), engine_config)
