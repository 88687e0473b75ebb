"""Replay recorded top-k into a PaddleFormers model's MoE gates, gradients kept.

``with replay_routing(model, routes):`` swaps, on every MoE gate of the model, the one
method that picks the experts (families.py: each family's *seam*) for one that returns the
recorded ids where the routes are valid and the gate's own choice elsewhere (padding, the
last token, a sequence without a record).  The gate's own code then weighs those ids from
its live scores, so the routing weights follow the family's rule and the router weight
keeps its gradient (R3).  Leaving the block restores the class's methods.

Alignment is by layer map: the gate inside decoder layer ``model.layers[L]`` takes the
routes row whose layer is ``L``; dense layers have no gate and no row.  Multi-token
prediction layers (decoder index ``>= config.num_hidden_layers``, or an ``mtp`` block) are
not recorded by the engine, so their gates route live.  Routes for other layers, another
layer count, another ``top_k``, another expert count or another token count than the gate
sees are refused, naming both sides; so is a model forward in which a patched gate did not
run.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from fd_routing_replay.codec import RoutingRecord
from fd_routing_replay.trainers.hf.routes import HFRoutes, routes_for_model
from fd_routing_replay.trainers.paddle.families import (
    PADDLE_FAMILIES,
    PaddleFamily,
    paddle_family_of,
)

__all__ = ["PaddleGate", "PaddleRoutingReplay", "moe_gates", "moe_layers", "replay_routing"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?=\.|$)")
_MTP = re.compile(r"(?:^|\.)mtp")


@dataclass(frozen=True)
class PaddleGate:
    """One MoE gate of the model: its decoder layer, qualified name, layer and family."""

    layer: int
    name: str
    module: Any
    family: PaddleFamily

    @property
    def top_k(self) -> int:
        return self.family.top_k(self.module)

    @property
    def num_experts(self) -> int:
        return self.family.num_experts(self.module)


def _all_gates(model: Any) -> tuple[list[PaddleGate], list[str]]:
    """The decoder layers' gates by ascending layer, and the names of the MTP gates."""
    found: dict[int, PaddleGate] = {}
    mtp: list[str] = []
    hidden_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for name, layer in model.named_sublayers():
        family = paddle_family_of(layer)
        if family is None:
            continue
        numbers = _LAYER.findall(name)
        if _MTP.search(name) or (numbers and isinstance(hidden_layers, int)
                                 and int(numbers[-1]) >= hidden_layers):
            mtp.append(name)
            continue
        if not numbers:
            raise ValueError(f"MoE gate {name!r} ({type(layer).__name__}) is not inside a "
                             "numbered decoder layer ('...layers.<i>...'): cannot align it "
                             "(a pipeline-parallel model's stages are not supported)")
        index = int(numbers[-1])
        if index in found:
            raise ValueError(f"decoder layer {index} has two MoE gates: {found[index].name!r} "
                             f"and {name!r}")
        found[index] = PaddleGate(index, name, layer, family)
    return [found[index] for index in sorted(found)], mtp


def moe_gates(model: Any) -> list[PaddleGate]:
    """The model's MoE gates of a supported family, by ascending decoder layer (MTP left out)."""
    return _all_gates(model)[0]


def moe_layers(model: Any) -> tuple[int, ...]:
    """The decoder layers of ``model`` that hold an MoE gate (dense and MTP layers left
    out): what a record's layer map must be."""
    return tuple(gate.layer for gate in moe_gates(model))


class PaddleRoutingReplay:
    """``routes`` replayed into ``model``'s MoE gates.

    :func:`replay_routing` is the context-manager form; a trainer that keeps the replay
    across micro-batches calls :meth:`install` once, :meth:`set_routes` per micro-batch and
    :meth:`remove` at the end.  ``calls[layer]`` counts the gate calls replayed;
    ``live_gates`` names the MTP gates left to route live.
    """

    def __init__(self, model: Any, routes: HFRoutes | RoutingRecord | Any, *,
                 layers: Sequence[int] | None = None) -> None:
        self.model = model
        self.gates, self.live_gates = _all_gates(model)
        if not self.gates:
            names = ", ".join(f"{f.name} ({f.classes[0].rsplit('.', 1)[1]})"
                              for f in PADDLE_FAMILIES)
            raise ValueError(f"{type(model).__name__} has no MoE gate of a supported family: "
                             f"{names}")
        self.layers = tuple(gate.layer for gate in self.gates)
        self.calls = dict.fromkeys(self.layers, 0)
        self._restores: list[Callable[[], None]] = []
        self._hooks: list[Any] = []
        self._seen: dict[int, int] = {}
        self.set_routes(routes, layers=layers)

    def set_routes(self, routes: HFRoutes | RoutingRecord | Any, *,
                   layers: Sequence[int] | None = None) -> None:
        """Replay ``routes`` from the next forward pass on; checks them against the model."""
        self.routes = routes_for_model(
            routes, layers, [(gate.layer, gate.top_k, gate.num_experts) for gate in self.gates],
            unit="gate", units="MoE gates")
        self._tensors: dict[str, tuple[Any, Any]] = {}

    def _on(self, place: Any) -> tuple[Any, Any]:
        """The routes as int64 / bool tensors on ``place`` (converted once per place)."""
        key = str(place)
        if key not in self._tensors:
            import paddle

            self._tensors[key] = (
                paddle.to_tensor(self.routes.ids, dtype="int64", place=place),
                paddle.to_tensor(np.ascontiguousarray(self.routes.valid), place=place))
        return self._tensors[key]

    def _chooser(self, row: int, gate: PaddleGate) -> Callable[[Any], Any]:
        def choose(live_ids: Any) -> Any:
            import paddle

            tokens = int(live_ids.shape[0])
            if tokens != self.routes.num_tokens:
                raise ValueError(
                    f"decoder layer {gate.layer}: the gate routes {tokens} tokens in this "
                    f"forward pass but the routes hold {self.routes.num_tokens}; build them "
                    "for this batch (packed_routes / padded_routes, a rank's share under "
                    "SP: sequence_parallel_routes)")
            ids, valid = self._on(live_ids.place)
            self.calls[gate.layer] += 1
            chosen = paddle.where(valid[row].unsqueeze(1), ids[row], live_ids.astype("int64"))
            return chosen.astype(live_ids.dtype)
        return choose

    def _before_model(self, layer: Any, inputs: Any) -> None:
        self._seen = dict(self.calls)

    def _after_model(self, layer: Any, inputs: Any, outputs: Any) -> None:
        idle = [layer for layer in self.layers if self.calls[layer] == self._seen.get(layer)]
        if idle:
            raise RuntimeError(f"the MoE gates of decoder layers {idle} did not run in this "
                               "forward pass, so their routes were not replayed (a fused MoE "
                               "path bypassed the patched method?)")

    def install(self) -> PaddleRoutingReplay:
        """Swap the seams and put the model hooks on (idempotent)."""
        if not self._restores:
            try:
                for row, gate in enumerate(self.gates):
                    self._restores.append(gate.family.install(gate.module,
                                                              self._chooser(row, gate)))
            except BaseException:
                self.remove()
                raise
            self._hooks = [self.model.register_forward_pre_hook(self._before_model),
                           self.model.register_forward_post_hook(self._after_model)]
        return self

    def remove(self) -> None:
        """Restore the gates' own methods: they route live again."""
        for restore in self._restores:
            restore()
        for hook in self._hooks:
            hook.remove()
        self._restores, self._hooks = [], []


@contextmanager
def replay_routing(model: Any, routes: HFRoutes | RoutingRecord | Any, *,
                   layers: Sequence[int] | None = None) -> Iterator[PaddleRoutingReplay]:
    """Within the block, ``model``'s MoE gates replay ``routes``: :class:`HFRoutes`
    (``packed_routes``, ``padded_routes``, :func:`sequence_parallel_routes`), a record (one
    unpadded sequence) or a ``[layers, tokens, K]`` id array (numpy, Paddle) whose rows are
    ``layers`` (default: the model's MoE layers).  Run the backward inside the block when
    the model recomputes activations."""
    replay = PaddleRoutingReplay(model, routes, layers=layers).install()
    try:
        yield replay
    finally:
        replay.remove()
