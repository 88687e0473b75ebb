"""Routing replay into transformers' ERNIE-4.5-VL MoE: one router per expert group and layer.

``Ernie4_5_VLMoeMoeBlock`` (transformers 5.24, models/ernie4_5_vl_moe/modeling_ernie4_5_vl_moe.py)
runs a text MoE on the text tokens and a vision MoE on the image / video tokens, split by
``moe_mm_token_type_ids``; each has its own ``Ernie4_5_VLMoeMoeTopKRouter`` over its own
experts.  A FastDeploy record of ERNIE-4.5-VL holds both groups in one id space
(docs/record-format.md, "Expert groups"), read one group at a time:
``packed_routes(records, expert_group="text")`` and ``(..., expert_group="image")``.

``with replay_grouped_routing(model, {"text": text_routes, "image": image_routes}):`` puts a
forward pre-hook on every modality block (it keeps the block's token types) and a forward
hook on every router: the text router replays its group's routes at the text tokens, in
order, the vision router its group's at the image tokens, with weights recomputed from the
live logits as ERNIE 4.5's router normalises them (``families._softmax_clamped``) so the
routers keep their gradient.  A token the record routed through one group but the batch
gives to the other modality is refused naming it; so is a token count that differs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from fd_routing_replay.trainers._common import lazy_torch
from fd_routing_replay.trainers.hf.families import softmax_clamped
from fd_routing_replay.trainers.hf.patch import check_transformers
from fd_routing_replay.trainers.hf.routes import HFRoutes, as_routes

__all__ = ["GROUP_OF_BLOCK", "SIGNATURES", "GroupRouter", "GroupedRoutingReplay", "grouped_routers",
           "replay_grouped_routing"]

ROUTER = "Ernie4_5_VLMoeMoeTopKRouter"
MODAL_BLOCK = "Ernie4_5_VLMoeMoeBlock"
GROUP_OF_BLOCK = {"text_moe": "text", "vision_moe": "image"}
"""The modality block's attribute holding each group's MoE -> the record's group name."""

SIGNATURES = (
    (ROUTER, "(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]"),
    (MODAL_BLOCK, "(self, hidden_states: torch.Tensor, moe_mm_token_type_ids: torch.IntTensor | None = None)"
                  " -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]"),
)
"""``inspect.signature`` of the hooked classes' ``forward`` in the pinned transformers (5.24.0)."""

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.(text_moe|vision_moe)\.gate$")


@dataclass(frozen=True)
class GroupRouter:
    layer: int
    group: str
    name: str
    module: Any


def grouped_routers(model: Any) -> list[GroupRouter]:
    """ERNIE-4.5-VL's routers: ``layers.<i>.mlp.{text_moe,vision_moe}.gate``, by layer."""
    found = []
    for name, module in model.named_modules():
        if type(module).__name__ != ROUTER:
            continue
        match = _LAYER.search(name)
        if match is None:
            raise ValueError(f"router {name!r} is not a '...layers.<i>.mlp.text_moe|vision_moe.gate': "
                             "cannot tell its layer and expert group")
        found.append(GroupRouter(int(match.group(1)), GROUP_OF_BLOCK[match.group(2)], name, module))
    return sorted(found, key=lambda r: (r.layer, r.group != "text"))


class GroupedRoutingReplay:
    """Hooks replaying per-group routes into an ERNIE-4.5-VL model (see the module docstring)."""

    def __init__(self, model: Any, routes: Mapping[str, HFRoutes | Any]) -> None:
        check_transformers()
        self.model = model
        self.routers = grouped_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no {ROUTER}: grouped replay is for ERNIE-4.5-VL")
        self.layers = tuple(sorted({r.layer for r in self.routers}))
        self.calls = {(r.layer, r.group): 0 for r in self.routers}
        self._types: dict[int, Any] = {}
        self._handles: list[Any] = []
        missing = sorted({r.group for r in self.routers} - set(routes))
        if missing:
            raise ValueError(f"no routes for the expert group(s) {missing}: pass "
                             "{'text': ..., 'image': ...} (packed_routes(..., expert_group=...))")
        self.routes = {group: as_routes(value, model_layers=self.layers) for group, value in routes.items()}
        for group, value in self.routes.items():
            if value.layers != self.layers:
                raise ValueError(f"the {group!r} routes cover decoder layers {list(value.layers)}, the model's "
                                 f"MoE layers are {list(self.layers)}")
        tokens = {value.num_tokens for value in self.routes.values()}
        if len(tokens) > 1:
            raise ValueError(f"the groups' routes cover different token counts {sorted(tokens)}")
        self._tensors: dict[Any, dict[str, tuple[Any, Any]]] = {}

    def _on(self, device: Any) -> dict[str, tuple[Any, Any]]:
        if device not in self._tensors:
            torch = lazy_torch()
            self._tensors[device] = {group: (torch.from_numpy(r.ids).to(device),
                                             torch.from_numpy(np.ascontiguousarray(r.valid)).to(device))
                                     for group, r in self.routes.items()}
        return self._tensors[device]

    def _keep_types(self, layer: int) -> Any:
        def keep(module: Any, args: Any, kwargs: Any) -> None:
            types = kwargs.get("moe_mm_token_type_ids", args[1] if len(args) > 1 else None)
            self._types[layer] = types
        return keep

    def _hook(self, router: GroupRouter) -> Any:
        row = self.layers.index(router.layer)

        def replay(module: Any, args: Any, output: Any) -> Any:
            logits, live_weights, live_ids = output
            tokens = live_ids.shape[0]
            routes = self._on(live_ids.device)
            types = self._types.get(router.layer)
            vision = None if types is None or not bool(types.any()) else types.reshape(-1).bool()
            total = self.routes[router.group].num_tokens
            if vision is None:                       # no image token: the text MoE runs on all tokens
                mine = lazy_torch().ones(total, dtype=lazy_torch().bool, device=live_ids.device)
            else:
                mine = vision if router.group == "image" else ~vision
            if int(mine.shape[0]) != total or int(mine.sum()) != tokens:
                raise ValueError(f"decoder layer {router.layer}, {router.group} experts: the model routes "
                                 f"{tokens} tokens of {int(mine.shape[0])} but the routes hold {total}")
            for group, (_, valid) in routes.items():
                wrong = valid[row] & (~mine if group == router.group else mine)
                if bool(wrong.any()):
                    position = int(wrong.nonzero()[0][0])
                    raise ValueError(f"decoder layer {router.layer}: token {position} was routed through the "
                                     f"{group!r} experts at rollout but the batch gives it to the "
                                     f"{'other' if group == router.group else router.group!r} modality")
            ids_all, valid_all = routes[router.group]
            ids = ids_all[row][mine].where(valid_all[row][mine].unsqueeze(1), live_ids)
            weights = softmax_clamped(module, logits.reshape(tokens, logits.shape[-1]), ids)
            self.calls[(router.layer, router.group)] += 1
            return logits, weights.to(live_weights.dtype), ids
        return replay

    def install(self) -> GroupedRoutingReplay:
        if not self._handles:
            for router in self.routers:
                block = self.model.get_submodule(router.name.rsplit(".", 2)[0])
                if type(block).__name__ != MODAL_BLOCK:
                    raise ValueError(f"{router.name!r} is not inside a {MODAL_BLOCK}")
                if router.group == "text":
                    self._handles.append(block.register_forward_pre_hook(self._keep_types(router.layer),
                                                                         with_kwargs=True))
                self._handles.append(router.module.register_forward_hook(self._hook(router)))
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


@contextmanager
def replay_grouped_routing(model: Any, routes: Mapping[str, HFRoutes | Any]) -> Iterator[GroupedRoutingReplay]:
    """Within the block, ``model``'s (ERNIE-4.5-VL) routers replay ``routes`` per expert group."""
    replay = GroupedRoutingReplay(model, routes).install()
    try:
        yield replay
    finally:
        replay.remove()

