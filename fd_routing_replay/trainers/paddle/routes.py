"""Routes in the token order a PaddleFormers MoE gate sees, including a sequence-parallel
rank's share.

Without sequence parallelism every supported gate flattens its ``[B, S, H]`` input with
``view(-1, H)`` / ``reshape([-1, H])``, so token row ``b * S + s`` is position ``s`` of batch
row ``b``: the layout of :func:`~fd_routing_replay.trainers.hf.routes.packed_routes` and
:func:`~fd_routing_replay.trainers.hf.routes.padded_routes`, which this adapter takes as
they are.

Under sequence parallelism (tensor parallel size > 1) a rank holds a contiguous share of the
flattened tokens.  PaddleFormers 1.2.0's DeepSeek-V3 and ERNIE-4.5-MoE flatten **batch
first** — ``reshape([bs * seq_len, hidden])`` then ``ScatterOp`` (deepseek_v3/modeling.py:
1543-1546, ernie4_5_moe/modeling.py:911-913; ``ScatterOp`` keeps rank ``r``'s ``r``-th
contiguous share along axis 0, paddle/distributed/fleet/utils/sequence_parallel_utils.py,
``scatter``) — so rank ``r`` routes rows ``[r·N/tp, (r+1)·N/tp)`` of the ``b * S + s``
order.  Megatron-style models (PaddleFleet's ``GPTModel``) keep activations ``[S, B, H]``
instead: row ``s * B + b``.  :func:`sequence_parallel_routes` gives either share.
NumPy only.
"""

from __future__ import annotations

import numpy as np

from fd_routing_replay.trainers.hf.routes import HFRoutes
from fd_routing_replay.trainers.parallel import sequence_parallel_slice

__all__ = ["TOKEN_ORDERS", "sequence_parallel_routes"]

TOKEN_ORDERS = ("bs", "sb")
"""``"bs"``: row ``b * S + s`` (PaddleFormers' models); ``"sb"``: row ``s * B + b``
(``[S, B, H]`` activations, Megatron / PaddleFleet)."""


def sequence_parallel_routes(routes: HFRoutes, sp_size: int, sp_rank: int, *,
                             batch_size: int = 1, order: str = "bs") -> HFRoutes:
    """Rank ``sp_rank``'s share of a whole batch's routes (``packed_routes`` or
    ``padded_routes`` built without ``sp_size``, rows ``b * S + s``) under sequence
    parallelism of size ``sp_size``: the ``sp_rank``-th contiguous share of the tokens in
    ``order`` (:data:`TOKEN_ORDERS`; ``batch_size`` rows of equal length for ``"sb"``)."""
    if order not in TOKEN_ORDERS:
        raise ValueError(f"order must be one of {TOKEN_ORDERS}, got {order!r}")
    total = routes.num_tokens
    if batch_size < 1 or total % batch_size:
        raise ValueError(f"{total} tokens do not split into batch_size {batch_size} rows")
    rows = np.arange(total, dtype=np.int64)
    if order == "sb":
        rows = rows.reshape(batch_size, total // batch_size).T.reshape(-1)
    return routes.take(rows[sequence_parallel_slice(total, sp_size, sp_rank)])
