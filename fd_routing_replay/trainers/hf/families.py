"""The Hugging Face MoE families the replay patches: their router classes and normalisations.

From transformers 5.13 on (read in 5.24.0, ``transformers/models/<family>/modeling_*.py``)
every family below routes through a router module of its own whose ``forward(hidden_states)``
returns ``(router_logits [N, E], routing_weights [N, K], expert_ids [N, K])``; the MoE block
hands the ids and weights to its experts unchanged.  So replay needs no new forward: a
forward hook on the router swaps in the recorded ids and recomputes the weights from the
live ``router_logits`` at those ids with the family's own normalisation, which keeps the
router weight's gradient (as R3 does).  How each router picks and weighs its experts:

* **Qwen3-MoE, Qwen2-MoE** (``Qwen3MoeTopKRouter``, ``Qwen2MoeTopKRouter``): softmax in
  float32 over all experts, top-k, renormalised over the k when ``norm_topk_prob``.
* **Mixtral** (``MixtralTopKRouter``): softmax in float32, top-k, always renormalised.
* **DeepSeek-V3** (``DeepseekV3TopkRouter``): sigmoid scores; the choice adds
  ``e_score_correction_bias`` and is limited to the ``topk_group`` best of ``n_group``
  groups, but the weights are the plain sigmoid scores at the chosen experts, renormalised
  (``+ 1e-20``) when ``norm_topk_prob``, times ``routed_scaling_factor``.  The bias and the
  group limit only pick experts, so under replay they drop out.
* **GPT-OSS** (``GptOssTopKRouter``, a biased linear): top-k of the logits, softmax over
  those k logits.
* **ERNIE 4.5 MoE** (``Ernie4_5_MoeTopKRouter``): softmax in float32; the choice adds the
  ``moe_statics`` bias; the weights are the softmax at the chosen experts divided by
  ``max(sum, moe_norm_min)``.  ERNIE-4.5-VL's per-group routers
  (``Ernie4_5_VLMoeMoeTopKRouter``, two per layer) weigh the same way; they are replayed by
  :mod:`fd_routing_replay.trainers.hf.groups`, not listed here.

Each weight function gets the router, its float logits ``[N, E]`` and int64 ids ``[N, K]``
and uses tensor methods only, so this module imports no torch.  ``signatures`` are the
``inspect.signature`` strings of the patched classes' ``forward`` in the pinned transformers;
``tests/trainers/test_hf.py`` fails when a release changes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["FAMILIES", "MIN_TRANSFORMERS", "TESTED_TRANSFORMERS", "Family", "family_of", "softmax_clamped"]

MIN_TRANSFORMERS = (5, 13)
TESTED_TRANSFORMERS = "5.24.0"

_ROUTER_SIGNATURE = "(self, hidden_states)"
_BLOCK_SIGNATURE = "(self, hidden_states: torch.Tensor) -> torch.Tensor"


def _softmax_topk(router: Any, logits: Any, ids: Any) -> Any:
    """Qwen2/Qwen3-MoE: softmax over all experts, gathered, renormalised if asked."""
    weights = logits.float().softmax(dim=-1).gather(1, ids)
    if getattr(router, "norm_topk_prob", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def _softmax_topk_renorm(router: Any, logits: Any, ids: Any) -> Any:
    """Mixtral: softmax over all experts, gathered, always renormalised."""
    weights = logits.float().softmax(dim=-1).gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True)


def _sigmoid_scaled(router: Any, logits: Any, ids: Any) -> Any:
    """DeepSeek-V3: sigmoid scores at the ids (no bias), renormalised, scaled."""
    weights = logits.float().sigmoid().gather(1, ids)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


def _softmax_of_topk_logits(router: Any, logits: Any, ids: Any) -> Any:
    """GPT-OSS: softmax over the k logits at the ids."""
    return logits.gather(1, ids).softmax(dim=1)


def softmax_clamped(router: Any, logits: Any, ids: Any) -> Any:
    """ERNIE 4.5 MoE: softmax at the ids over ``max(sum, moe_norm_min)``."""
    weights = logits.float().softmax(dim=1).gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True).clamp(min=router.norm_min)


@dataclass(frozen=True)
class Family:
    """One transformers MoE family: the router class the hook goes on (matched by class
    name along the module's MRO, so FSDP's wrapper subclasses match too), the MoE block
    that calls it, how its weights are normalised, and the pinned ``forward`` signatures."""

    name: str
    model_type: str
    router: str
    block: str
    weights: Callable[[Any, Any, Any], Any]
    signatures: tuple[tuple[str, str], ...]

    @property
    def module(self) -> str:
        """The transformers module that defines the family's classes."""
        return f"transformers.models.{self.model_type}.modeling_{self.model_type}"


def _family(name: str, model_type: str, router: str, block: str,
            weights: Callable[[Any, Any, Any], Any], *, router_signature: str = _ROUTER_SIGNATURE,
            block_signature: str = _BLOCK_SIGNATURE) -> Family:
    return Family(name, model_type, router, block, weights,
                  ((router, router_signature), (block, block_signature)))


FAMILIES: tuple[Family, ...] = (
    _family("Qwen3-MoE", "qwen3_moe", "Qwen3MoeTopKRouter", "Qwen3MoeSparseMoeBlock",
            _softmax_topk),
    _family("Qwen2-MoE", "qwen2_moe", "Qwen2MoeTopKRouter", "Qwen2MoeSparseMoeBlock",
            _softmax_topk),
    _family("Mixtral", "mixtral", "MixtralTopKRouter", "MixtralSparseMoeBlock",
            _softmax_topk_renorm),
    _family("DeepSeek-V3", "deepseek_v3", "DeepseekV3TopkRouter", "DeepseekV3MoE",
            _sigmoid_scaled),
    _family("GPT-OSS", "gpt_oss", "GptOssTopKRouter", "GptOssMLP", _softmax_of_topk_logits,
            block_signature="(self, hidden_states)"),
    _family("ERNIE 4.5 MoE", "ernie4_5_moe", "Ernie4_5_MoeTopKRouter",
            "Ernie4_5_MoeSparseMoeBlock", softmax_clamped,
            router_signature="(self, hidden_states: torch.Tensor) -> "
                             "tuple[torch.Tensor, torch.Tensor]"),
)

_BY_ROUTER = {family.router: family for family in FAMILIES}


def family_of(module: Any) -> Family | None:
    """The family whose router ``module`` is (its class or a base class by name), or None."""
    for cls in type(module).__mro__:
        family = _BY_ROUTER.get(cls.__name__)
        if family is not None:
            return family
    return None
