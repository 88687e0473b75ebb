"""slime / SGLang: ``routed_experts [T - 1, num_hidden_layers, K]`` int32, dense layers 0.

SGLang (``python/sglang/srt/layers/moe/routed_experts_capturer.py``) captures into
``torch.zeros((tokens, num_hidden_layers, num_experts_per_tok), dtype=torch.int32)``
buffers, device and host; only MoE layers write their row (``capture(layer_id, topk_ids)``),
so a dense layer's row stays **0**.  ``get_routed_experts`` returns the rows of the
request's first ``seqlen - 1`` tokens (every forwarded position: the same token
convention as our records), and the response's ``meta_info["routed_experts"]`` is that
int32 array base64-encoded, flattened.  slime decodes it in ``Sample._apply_meta_info``
(``slime/utils/types.py``; ``decode_int32_meta_array`` in ``slime/utils/misc.py``): it
checks the element count against ``(len(sample.tokens) - 1 - routed_experts_start_len) *
args.num_layers * args.moe_router_topk``, reshapes, and stores
``sample.rollout_routed_experts`` — the array itself when ``routed_experts_start_len`` is
0 (or absent), else the sample's first ``routed_experts_start_len`` rows followed by it
(SGLang's multi-turn clients receive only the rows they do not hold yet).

:func:`to_sglang_routed_experts` gives that array from one of our records, and
:func:`sglang_routed_experts_b64` the ``meta_info`` string, so a slime user swaps
SGLang's ``routed_experts`` for ours without touching the trainer.  A record always holds
the whole sequence, so :func:`with_record_routes` also drops ``routed_experts_start_len``
from the ``meta_info``: left at SGLang's value, slime's element-count check refuses the
full array.

A position without routing (SGLang has no "unknown"; :func:`unrouted_positions` lists
them) gets the distinct placeholder experts ``0..K-1`` on every MoE layer
(:func:`~fd_routing_replay.trainers._common.placeholder_ids`, as the Megatron adapter),
not ``[0, 0, …]``: slime's ``fill_routing_replay`` (``slime/backends/megatron_utils/actor.py``)
hands column ``layer_id`` of every MoE layer to that layer's router, whose replay gathers
the scores at the ids, so duplicate ids would replay the token as one expert.  slime's own
padding (the last token, CP/TP padding) is distinct experts too (``_pad_routed_experts``
in ``slime/backends/megatron_utils/cp_utils.py``: ``arange(...) % num_experts``).  Dense
layers' columns are never read by slime: they stay 0.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import numpy as np

from fd_routing_replay.codec import RoutingRecord
from fd_routing_replay.trainers._common import check_convention, placeholder_ids, routed_length

__all__ = ["START_LEN_KEY", "sglang_routed_experts_b64", "to_sglang_routed_experts",
           "unrouted_positions", "with_record_routes"]

START_LEN_KEY = "routed_experts_start_len"
"""SGLang's ``meta_info`` key: how many leading rows ``routed_experts`` leaves out."""


def _num_layers(record: RoutingRecord, num_layers: int | None) -> int:
    if num_layers is None:
        # A record knows its MoE layers, not how many decoder layers follow the last one.
        stated = getattr(record, "num_decoder_layers", None)
        num_layers = stated if isinstance(stated, int) else (max(record.layer_map) + 1
                                                             if record.num_layers else 0)
    if record.num_layers and max(record.layer_map) >= num_layers:
        raise ValueError(f"num_layers {num_layers} is too small for the record's MoE layer "
                         f"{max(record.layer_map)}")
    return int(num_layers)


def to_sglang_routed_experts(record: RoutingRecord, *, num_layers: int | None = None,
                             num_tokens: int | None = None, dense_fill: int = 0,
                             unrouted_fill: int | None = None) -> np.ndarray:
    """``[T, num_layers, K]`` int32 where ``T`` is the record's forwarded positions (or
    ``num_tokens`` = ``len(sample.tokens) - 1``: cut, or extended with unrouted positions).

    Row ``l`` of the layer axis is decoder layer ``l``: MoE layers from the record's layer
    map, every other (dense) layer ``dense_fill`` (SGLang: 0).  Give ``num_layers`` (the
    model's ``num_hidden_layers``) when the last decoder layers are dense or MTP is
    counted; by default it is the last MoE layer + 1.  Unrouted positions of the MoE
    layers hold the placeholder experts ``0..K-1``, or ``unrouted_fill`` in every slot
    when given (e.g. -1 to mark them; not for a trainer that replays them).
    """
    check_convention(record)
    layers = _num_layers(record, num_layers)
    rows = routed_length(record) if num_tokens is None else int(num_tokens)
    if rows < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    out = np.full((rows, layers, record.top_k), dense_fill, dtype=np.int32)
    take = min(rows, routed_length(record))
    ids = record.ids[:, :take]                                   # [L_moe, take, K]
    fill = placeholder_ids(record.top_k, record.num_experts).astype(np.int32) \
        if unrouted_fill is None else unrouted_fill
    moe = ids.astype(np.int32)
    moe[(ids == record.fill_value).any(axis=2)] = fill            # a partial row is unrouted
    out[:take, list(record.layer_map)] = moe.transpose(1, 0, 2)
    if take < rows:
        out[take:, list(record.layer_map)] = fill
    return out


def sglang_routed_experts_b64(record: RoutingRecord, **kwargs: object) -> str:
    """What SGLang puts in ``meta_info["routed_experts"]``: the int32 array of
    :func:`to_sglang_routed_experts` (same keyword arguments), base64 (ASCII)."""
    array = np.ascontiguousarray(to_sglang_routed_experts(record, **kwargs), dtype="<i4")
    return base64.b64encode(array.tobytes()).decode("ascii")


def with_record_routes(meta_info: Mapping[str, Any], record: RoutingRecord,
                       **kwargs: Any) -> dict[str, Any]:
    """A copy of an SGLang response's ``meta_info`` whose ``routed_experts`` is the
    record's whole sequence (:func:`sglang_routed_experts_b64`, same keyword arguments:
    ``num_layers=args.num_layers``, ``num_tokens=len(sample.tokens) - 1`` counting this
    turn's tokens) and without ``routed_experts_start_len``, so slime takes it as the
    sample's routes from position 0.  Hand it to slime where SGLang's went
    (``sample.append_response_tokens(..., meta_info=...)``)."""
    out = {key: value for key, value in meta_info.items() if key != START_LEN_KEY}
    out["routed_experts"] = sglang_routed_experts_b64(record, **kwargs)
    return out


def unrouted_positions(record: RoutingRecord) -> np.ndarray:
    """Positions (forwarded tokens) that lack routing in at least one MoE layer."""
    ids = record.ids[:, :routed_length(record)]
    return np.flatnonzero((ids == record.fill_value).any(axis=(0, 2)))
