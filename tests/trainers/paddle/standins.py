"""What PaddleFormers 1.2.0 needs to import and run its MoE models on a CPU, and nothing more.

* ``paddlefleet_ops`` (PaddleFleet's compiled ops, not on PyPI): transformers/fused_a2a.py:17
  imports ``is_deep_ep_available`` from it at module level, so every model that reaches
  ``moe_layer.py`` fails to import without it.  The stand-in answers that probe with False
  (no DeepEP: PaddleFormers then never touches ``paddlefleet_ops.deep_ep``).  A real
  ``paddlefleet_ops`` is used when installed.
* ``expand_modality_expert_id`` (ERNIE's id expansion, nn/moe/moe_allgather_layer.py:413):
  Paddle 3.3.1 registers it for GPU and XPU only.  The stand-in computes what those kernels
  compute (Paddle's ``phi::ExpandModalityExpertIDKernel``): with grouped experts id ``e``
  in slot ``i`` becomes ``e + (i % k) * group_size``; with ``num_expert_per_modality > 0``,
  ``rank * 2 * n + e % n + modality_offset * n`` for ``rank = e // n``; else unchanged.
"""

from __future__ import annotations

import importlib.util
import sys
import types


def install_paddlefleet_probe() -> None:
    """``paddlefleet_ops.is_deep_ep_available() -> False`` unless the real package exists."""
    if "paddlefleet_ops" in sys.modules or importlib.util.find_spec("paddlefleet_ops"):
        return
    module = types.ModuleType("paddlefleet_ops")
    module.__doc__ = "test stand-in: PaddleFleet's availability probe only (no DeepEP)"
    module.is_deep_ep_available = lambda: False
    sys.modules["paddlefleet_ops"] = module


def expand_modality_expert_id(expert_id, num_expert_per_modality, group_size, modality_offset,
                              is_group_expert):
    import paddle

    ids = expert_id
    if is_group_expert:
        slots = paddle.arange(ids.shape[-1], dtype=ids.dtype) * group_size
        ids = ids + slots.unsqueeze(0)
    if num_expert_per_modality > 0:
        n = num_expert_per_modality
        ids = (ids // n) * (2 * n) + ids % n + modality_offset * n
    return ids


def install_cpu_expand_modality_expert_id() -> None:
    """ERNIE's MoE layer calls the module-level name it imported: replace it there."""
    from paddleformers.nn.moe import moe_allgather_layer

    moe_allgather_layer.expand_modality_expert_id = expand_modality_expert_id
