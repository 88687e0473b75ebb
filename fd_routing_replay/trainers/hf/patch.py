"""Replay recorded top-k into a Hugging Face model's MoE routers, gradients kept.

``with replay_routing(model, routes):`` puts a forward hook on the router of every MoE
block (families.py lists the router classes): the router runs as usual — its logits carry
the gradient — and the hook replaces its output ``(logits, weights, ids)`` by
``(logits, family_weights(logits at the recorded ids), recorded ids)``.  The block then
dispatches each token to the recorded experts with weights the live router computed for
them, so the router weight still learns (R3: the replayed ids are constants, the gather is
differentiable).  Where the routes are not valid (padding, the last token, no record) the
live choice stays.

Alignment is by layer map: router ``i`` of decoder layer ``model.layers[L]`` takes the
routes row whose layer is ``L``; dense layers have no router and no row.  Routes for other
layers, another layer count, another ``top_k``, another expert count (a record's
``num_experts``) or another token count than the forward pass routes are refused with both
numbers in the message.  A model forward in which some
patched router did not run (a fused kernel replaced the block's forward) is refused too.

Under FSDP the hooks sit on the router modules inside the wrapped layers (their names keep
``layers.<i>``), so plain FSDP and FSDP2 both work; with gradient checkpointing run the
backward inside the ``with`` block, since the recompute calls the routers again.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import numpy as np

from fd_routing_replay.codec import RoutingRecord
from fd_routing_replay.trainers._common import lazy_torch
from fd_routing_replay.trainers.hf.families import (
    FAMILIES,
    MIN_TRANSFORMERS,
    Family,
    family_of,
)
from fd_routing_replay.trainers.hf.routes import HFRoutes, routes_for_model

__all__ = ["MoERouter", "RoutingReplay", "check_transformers", "moe_layers", "moe_routers",
           "replay_routing"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?=\.|$)")


@dataclass(frozen=True)
class MoERouter:
    """One router of the model: its decoder layer, qualified name, module and family."""

    layer: int
    name: str
    module: Any
    family: Family


def check_transformers() -> None:
    """RuntimeError when the installed transformers predates the router modules replay
    patches (5.13); nothing when transformers is absent (then no model has them)."""
    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    if parts < MIN_TRANSFORMERS:
        raise RuntimeError(f"transformers {version} is not supported by routing replay: it needs "
                           f">= {'.'.join(map(str, MIN_TRANSFORMERS))} (router modules that "
                           "return logits, weights and expert ids)")


def moe_routers(model: Any) -> list[MoERouter]:
    """The model's MoE routers of a supported family, by ascending decoder layer."""
    found: dict[int, MoERouter] = {}
    for name, module in model.named_modules():
        family = family_of(module)
        if family is None:
            continue
        numbers = _LAYER.findall(name)
        if not numbers:
            raise ValueError(f"router {name!r} ({type(module).__name__}) is not inside a "
                             "numbered decoder layer ('...layers.<i>...'): cannot align it")
        layer = int(numbers[-1])
        if layer in found:
            raise ValueError(f"decoder layer {layer} has two routers: {found[layer].name!r} "
                             f"and {name!r}")
        found[layer] = MoERouter(layer, name, module, family)
    return [found[layer] for layer in sorted(found)]


def moe_layers(model: Any) -> tuple[int, ...]:
    """The decoder layers of ``model`` that hold an MoE router (dense layers left out):
    what a record's layer map must be."""
    return tuple(router.layer for router in moe_routers(model))


class RoutingReplay:
    """Forward hooks replaying ``routes`` into ``model``'s routers.

    :func:`replay_routing` is the context-manager form; a trainer that keeps the hooks
    across micro-batches calls :meth:`install` once, :meth:`set_routes` per micro-batch and
    :meth:`remove` at the end.  ``calls[layer]`` counts the router calls replayed.
    """

    def __init__(self, model: Any, routes: HFRoutes | RoutingRecord | Any, *,
                 layers: Sequence[int] | None = None) -> None:
        check_transformers()
        self.model = model
        self.routers = moe_routers(model)
        if not self.routers:
            names = ", ".join(f"{f.name} ({f.router})" for f in FAMILIES)
            raise ValueError(f"{type(model).__name__} has no MoE router of a supported family: "
                             f"{names}")
        self.layers = tuple(router.layer for router in self.routers)
        self.calls = dict.fromkeys(self.layers, 0)
        self._handles: list[Any] = []
        self._seen: dict[int, int] = {}
        self.set_routes(routes, layers=layers)

    def set_routes(self, routes: HFRoutes | RoutingRecord | Any, *,
                   layers: Sequence[int] | None = None) -> None:
        """Replay ``routes`` from the next forward pass on; checks them against the model."""
        self.routes = routes_for_model(
            routes, layers, [(router.layer, int(router.module.top_k),
                              int(router.module.num_experts)) for router in self.routers],
            unit="router", units="MoE blocks")
        self._tensors: dict[Any, tuple[Any, Any]] = {}

    def _on(self, device: Any) -> tuple[Any, Any]:
        """The routes as int64 / bool tensors on ``device`` (converted once per device)."""
        if device not in self._tensors:
            torch = lazy_torch()
            self._tensors[device] = (torch.from_numpy(self.routes.ids).to(device),
                                     torch.from_numpy(np.ascontiguousarray(self.routes.valid))
                                     .to(device))
        return self._tensors[device]

    def _hook(self, row: int, router: MoERouter) -> Any:
        def replay(module: Any, args: Any, output: Any) -> Any:
            if not (isinstance(output, tuple) and len(output) == 3 and
                    not output[2].is_floating_point() and output[2].ndim == 2):
                raise RuntimeError(
                    f"router {router.name!r} ({type(module).__name__}) did not return "
                    "(logits, weights, expert ids): this transformers release is not one the "
                    f"replay supports (>= {'.'.join(map(str, MIN_TRANSFORMERS))})")
            logits, live_weights, live_ids = output
            tokens = live_ids.shape[0]
            if tokens != self.routes.num_tokens:
                raise ValueError(
                    f"decoder layer {router.layer}: the model routes {tokens} tokens in this "
                    f"forward pass but the routes hold {self.routes.num_tokens}; build them for "
                    "this batch (packed_routes / padded_routes, a rank's slice under CP/SP)")
            all_ids, all_valid = self._on(live_ids.device)
            ids = all_ids[row].where(all_valid[row].unsqueeze(1), live_ids)
            weights = router.family.weights(module, logits.reshape(tokens, logits.shape[-1]), ids)
            self.calls[router.layer] += 1
            return logits, weights.to(live_weights.dtype), ids
        return replay

    def _before_model(self, module: Any, args: Any) -> None:
        self._seen = dict(self.calls)

    def _after_model(self, module: Any, args: Any, output: Any) -> None:
        idle = [layer for layer in self.layers if self.calls[layer] == self._seen.get(layer)]
        if idle:
            raise RuntimeError(f"the routers of decoder layers {idle} did not run in this "
                               "forward pass, so their routes were not replayed (a fused MoE "
                               "kernel replaced the block's forward?)")

    def install(self) -> RoutingReplay:
        """Put the hooks on (idempotent)."""
        if not self._handles:
            for row, router in enumerate(self.routers):
                self._handles.append(router.module.register_forward_hook(self._hook(row, router)))
            self._handles.append(self.model.register_forward_pre_hook(self._before_model))
            self._handles.append(self.model.register_forward_hook(self._after_model))
        return self

    def remove(self) -> None:
        """Take the hooks off: the routers route live again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


@contextmanager
def replay_routing(model: Any, routes: HFRoutes | RoutingRecord | Any, *,
                   layers: Sequence[int] | None = None) -> Iterator[RoutingReplay]:
    """Within the block, ``model``'s MoE routers replay ``routes``: :class:`HFRoutes`
    (:func:`packed_routes`, :func:`padded_routes`), a record (one unpadded sequence) or a
    ``[layers, tokens, K]`` id array whose rows are ``layers`` (default: the model's MoE
    layers).  Run the backward inside the block when gradient checkpointing is on."""
    replay = RoutingReplay(model, routes, layers=layers).install()
    try:
        yield replay
    finally:
        replay.remove()
