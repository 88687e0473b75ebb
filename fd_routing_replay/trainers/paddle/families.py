"""The PaddleFormers MoE gates the replay patches: where each one picks its experts.

Read in paddleformers 1.2.0 (``paddleformers/...`` below, the release
``tests/trainers/paddle`` runs).  No gate there has a replay hook, so each family names
the one method that turns scores into expert ids — its *seam* — and the replay swaps that
method on the gate instance for one that returns the recorded ids.  Everything after the
seam is the family's own code, so the routing weights are the family's rule applied to the
live scores at the recorded experts, and the router weight keeps its gradient (R3):

* **DeepSeek-V3, expert parallel size 1** (``DeepseekV3TopkRouter``,
  transformers/deepseek_v3/modeling.py:341-391): ``forward`` takes sigmoid scores of the
  float32 router logits, calls ``get_topk_indices(scores)`` (:359-377: the
  ``e_score_correction_bias`` and the ``topk_group`` best of ``n_group`` groups only pick),
  then gathers the *plain* scores at the ids (:386), renormalises them (``+ 1e-20``) when
  ``norm_topk_prob`` and multiplies by ``routed_scaling_factor``.  Seam:
  ``get_topk_indices``.
* **DeepSeek-V3, expert parallel size > 1** (``MoEGate`` of deepseek_v3/modeling.py:268,
  used by ``DeepseekV3MoEFlexToken``): ``topkgating_nodrop`` (transformers/moe_gate.py:
  564-610) picks with ``_topk_greedy`` / ``_topk_group_limited_greedy`` / ``_topk_noaux_tc``
  (by ``topk_method``, :578-587) and weighs with a mask built from those ids: the scores at
  the ids (no bias), over ``max(sum, eps)`` when ``norm_topk_prob``, times
  ``routed_scaling_factor``.  Seam: the method ``topk_method`` names.
* **ERNIE-4.5-MoE** (``Ernie4_5_MoeSparseMoeBlock``, transformers/ernie4_5_moe/modeling.py:
  259-337, a ``MOEAllGatherLayerV2``): its ``TopKGate`` (:302) gives logits only;
  ``fused_gate_logits_process_fused`` (nn/moe/moe_allgather_layer.py:371-428) takes the
  softmax, picks the top-k of it plus the ``moe_statics`` correction bias, gathers the
  weights from the probabilities *before* the bias (:407-412) and maps the ids through
  ``expand_modality_expert_id`` (:413, the identity for a text model).  The layer divides
  the weights by their sum after the dispatch (``norm_gate_logits``).  Seam:
  ``fused_gate_logits_process_fused``, whose ``[tokens, 2K]`` weights-and-ids output is
  rebuilt from its own probabilities at the recorded ids.  Grouped experts
  (``moe_group_experts``) and multimodal routing (ERNIE-VL) are refused.

GLM-4.5's router (``Glm4MoeTopkRouter``, transformers/glm4_moe/modeling.py:329-381) has the
same seam, but its module imports PaddleFleet (``gpt_provider``, not on PyPI) and cannot be
tested here, so it is not listed.  Qwen3-MoE is not here either: ``Qwen3MoeForCausalLM`` (transformers/qwen3_moe/modeling.py:
1211-1234) builds PaddleFleet's ``GPTModel``, which is not on PyPI, and its legacy
``Qwen3MoeSparseMoeBlock`` takes the top-k inline in ``forward`` (:339-343), with no method
to swap.  This module imports no Paddle: the seams import it when they run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["PADDLE_FAMILIES", "TESTED_PADDLEFORMERS", "PaddleFamily", "paddle_family_of"]

TESTED_PADDLEFORMERS = "1.2.0"

Choose = Callable[[Any], Any]
"""What a seam calls with the live ``[tokens, K]`` expert ids: the ids to use instead."""


@dataclass(frozen=True)
class PaddleFamily:
    """One PaddleFormers gate class: how to find it (``module.Class`` along the MRO), its
    ``top_k`` and expert count, and ``install(gate, choose)``, which swaps the seam on
    that instance and returns a function that restores it.  ``signatures`` are the
    ``inspect.signature`` strings of the seam methods in the tested PaddleFormers
    (``tests/trainers/paddle`` fails when a release changes them)."""

    name: str
    classes: tuple[str, ...]
    seam: str
    top_k: Callable[[Any], int]
    num_experts: Callable[[Any], int]
    install: Callable[[Any, Choose], Callable[[], None]]
    signatures: tuple[tuple[str, str], ...] = ()


def _restore(gate: Any, name: str) -> Callable[[], None]:
    def restore() -> None:
        if name in vars(gate):
            delattr(gate, name)       # the class's method again
    return restore


def _install_topk_indices(gate: Any, choose: Choose) -> Callable[[], None]:
    """DeepSeek-V3 / GLM-4.5 routers: ``get_topk_indices(scores)`` returns the ids."""
    live = gate.get_topk_indices

    def get_topk_indices(scores: Any) -> Any:
        return choose(live(scores))

    gate.get_topk_indices = get_topk_indices
    return _restore(gate, "get_topk_indices")


_GATE_METHODS = {"greedy": "_topk_greedy", "group_limited_greedy": "_topk_group_limited_greedy",
                 "noaux_tc": "_topk_noaux_tc"}


def _install_moe_gate(gate: Any, choose: Choose) -> Callable[[], None]:
    """``PretrainedMoEGate`` (DeepSeek-V3 under EP): the ``topk_method`` picker returns
    ``(weights, ids)``; ``topkgating_nodrop`` weighs from a mask of the ids."""
    method = _GATE_METHODS.get(gate.topk_method)
    if method is None:
        raise ValueError(f"MoEGate topk_method {gate.topk_method!r} is none of "
                         f"{sorted(_GATE_METHODS)}: PaddleFormers' topkgating_nodrop picks no "
                         "experts with it (moe_gate.py:578-587); set the config's topk_method")
    live = getattr(gate, method)

    def pick(scores: Any, k: int, *args: Any, **kwargs: Any) -> Any:
        _, live_ids = live(scores, k, *args, **kwargs)
        ids = choose(live_ids)
        return scores.take_along_axis(ids, axis=1), ids

    setattr(gate, method, pick)
    return _restore(gate, method)


def _install_ernie(block: Any, choose: Choose) -> Callable[[], None]:
    """ERNIE-4.5-MoE: ``fused_gate_logits_process_fused`` returns ``[weights | ids]``
    ``[tokens, 2K]`` and the probabilities; the weights are the probabilities at the ids."""
    if block.group_experts or block.multimodal_experts:
        kind = "grouped experts (moe_group_experts)" if block.group_experts else \
            "multimodal experts"
        raise ValueError(f"{type(block).__name__}: routing replay does not support {kind}; "
                         "its expert ids are renumbered per group or modality "
                         "(expand_modality_expert_id)")
    live = block.fused_gate_logits_process_fused

    def fused_gate_logits_process_fused(gate_logits_lm: Any, gate_logits_mm: Any = None,
                                        token_type_ids: Any = None) -> Any:
        if gate_logits_mm is not None or token_type_ids is not None:
            raise ValueError(f"{type(block).__name__}: routing replay does not support "
                             "token_type_ids (multimodal routing)")
        weights_and_ids, prob_lm, prob_mm = live(gate_logits_lm, gate_logits_mm, token_type_ids)
        k = weights_and_ids.shape[-1] // 2
        # The ids are constants: detached, so no backward reaches the live top-k's index
        # output (Paddle 3.3.1's CPU backward crashes when one does).
        ids = choose(weights_and_ids[:, k:].detach().astype("int64")).detach()
        weights = prob_lm.take_along_axis(ids, axis=1).astype(weights_and_ids.dtype)
        import paddle

        return paddle.concat([weights, ids.astype(weights_and_ids.dtype)], axis=-1), \
            prob_lm, prob_mm

    block.fused_gate_logits_process_fused = fused_gate_logits_process_fused
    return _restore(block, "fused_gate_logits_process_fused")


_DEEPSEEK = "paddleformers.transformers.deepseek_v3.modeling"
_PICKER = ("(self, scores: 'paddle.Tensor', k: 'int', n_group: 'int', topk_group: 'int') -> "
           "'Tuple[paddle.Tensor, paddle.Tensor]'")

PADDLE_FAMILIES: tuple[PaddleFamily, ...] = (
    PaddleFamily("DeepSeek-V3", (f"{_DEEPSEEK}.DeepseekV3TopkRouter",), "get_topk_indices",
                 lambda g: int(g.top_k), lambda g: int(g.n_routed_experts),
                 _install_topk_indices,
                 ((f"{_DEEPSEEK}.DeepseekV3TopkRouter.get_topk_indices", "(self, scores)"),)),
    PaddleFamily("DeepSeek-V3 (expert parallel)", (f"{_DEEPSEEK}.MoEGate",), "_topk_<method>",
                 lambda g: int(g.top_k), lambda g: int(g.num_experts), _install_moe_gate,
                 ((f"{_DEEPSEEK}.MoEGate._topk_greedy",
                   "(self, scores: 'paddle.Tensor', k: 'int') -> "
                   "'Tuple[paddle.Tensor, paddle.Tensor]'"),
                  (f"{_DEEPSEEK}.MoEGate._topk_group_limited_greedy", _PICKER),
                  (f"{_DEEPSEEK}.MoEGate._topk_noaux_tc", _PICKER))),
    PaddleFamily("ERNIE-4.5-MoE",
                 ("paddleformers.transformers.ernie4_5_moe.modeling.Ernie4_5_MoeSparseMoeBlock",),
                 "fused_gate_logits_process_fused", lambda g: int(g.k),
                 lambda g: int(g.num_experts), _install_ernie,
                 (("paddleformers.transformers.ernie4_5_moe.modeling.Ernie4_5_MoeSparseMoeBlock."
                   "fused_gate_logits_process_fused",
                   "(self, gate_logits_lm, gate_logits_mm=None, token_type_ids=None)"),)),
)

_BY_CLASS = {name: family for family in PADDLE_FAMILIES for name in family.classes}


def paddle_family_of(layer: Any) -> PaddleFamily | None:
    """The family whose gate ``layer`` is (its class or a base class), or None."""
    for cls in type(layer).__mro__:
        family = _BY_CLASS.get(f"{cls.__module__}.{cls.__qualname__}")
        if family is not None:
            return family
    return None
