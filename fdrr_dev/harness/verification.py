"""Verification mode (``capture.verify``) on a harness engine, as the FastDeploy glue turns it on.

Every capture object of the engine (each TP rank's manager or capturer; both instances of
a PD pair) gets the hook's verifier with the model's layer map, and the records the engine
builds are marked as verification records.  What the selftest then checks is the
harness's whole path after the hook: offload, slot cache, prefix cache, chunked prefill,
preemption, CPU swap, the PD hand-over, assembly, writer and store.
"""

from __future__ import annotations

from typing import Any

from fd_routing_replay.capture.device import HookVerifier, enable_verification, mark_records

__all__ = ["engines_of", "verify_engine"]


def engines_of(engine: Any) -> list[Any]:
    """The harness engines behind ``engine``: both instances of a PD pair, or itself."""
    if hasattr(engine, "prefill") and hasattr(engine, "decode"):
        return [engine.prefill, engine.decode]
    return [engine]


def verify_engine(engine: Any) -> list[HookVerifier]:
    """Put every capture object of ``engine`` in verification mode; mark its records."""
    verifiers = []
    for instance in engines_of(engine):
        cfg = instance.model.config
        layer_map = tuple(range(cfg.moe_layer_start_index, cfg.num_layers))
        for capture in instance.runner.managers:
            if getattr(capture, "binding", None) is None:
                continue                    # capture off (the no-op manager)
            verifiers.append(enable_verification(
                capture, num_experts=cfg.num_experts, top_k=cfg.top_k, layer_map=layer_map,
                tp_size=instance.config.tp_size))
        routing = getattr(instance, "routing", None)
        routing = getattr(routing, "inner", routing)          # a PD prefill's wrapper
        handoff = getattr(getattr(routing, "routing", None), "handoff", None)
        if handoff is not None and verifiers:
            mark_records(handoff.metadata, verifiers[-1].code)
    return verifiers
