"""What a MoE layer's hook calls contribute to the step's rows, before they are recorded.

The hooks (:mod:`~fd_routing_replay.capture.device`) record, per MoE layer and step, one
row per token of the step holding the *logical* experts the router chose.  Three FastDeploy
setups hand the hook something else; a :class:`RowAssembler` (``TableBinding.assemble``)
turns each call into those rows on the device, with no host sync and no allocation that
depends on device values.  File:line references are to ``../shared/fastdeploy/2.6``.

* **EPLB with redundant experts** (:class:`ExpertPlacement`).  On the expert-parallel path
  FastDeploy selects with ``moe_redundant_topk_select`` (layers/moe/ep.py:520-530), which
  writes a *physical replica slot*, drawn at random among the chosen expert's replicas, into
  ``topk_idx``; the hook gets that (fused_moe_cutlass_backend.py:138-151, :286-289).  The
  slot's logical expert is ``model_ep_rank_to_expert_id_list[layer, slot]`` of FastDeploy's
  own ``RedundantExpertManger`` (worker/experts_manager.py:55-62), which FastDeploy keeps
  beside the logical-to-physical table the kernel reads and updates both of in place, in
  one call (``update_expert_rank_table``, :161-181) between forward passes (the worker loop's
  ``_run_eplb``, worker/worker_process.py:414-456, :501-503).  One gather through that
  tensor, on the stream the kernel ran on, right after it, therefore reads the placement
  the kernel used: a rebalance lands between two steps, never inside one, and since every
  row is stored as a logical id, a record whose steps straddle a rebalance holds one id
  space throughout (what a placement version would say is the same for every row).  A slot
  outside the table, or one the table leaves unassigned (-1), is passed on as -1, which the
  record kernel counts as a bad id and stores as the fill.
* **Chunked MoE** (:class:`MoEChunks`).  ``FusedMoE.forward_chunked_moe`` (moe.py:791-840)
  runs the experts on ``paddle.tensor_split(x, moe_num_chunk)`` in order -- the hook sees
  each chunk's rows, in token order -- and then ``max_moe_num_chunk - moe_num_chunk`` times
  on an empty input (keeping the EP ranks in step), which the hook sees as empty calls.
  The chunks are concatenated and recorded once the layer's rows are complete; empty calls
  record nothing.  Parts still held when the step's rows are offloaded are dropped (that
  layer then recorded nothing this step: its rows are stored as unknown).
* **Per-modality expert groups** (:class:`ExpertGroups`, ERNIE-4.5-VL).  Each MoE decoder
  layer runs a text MoE on the text tokens and then an image MoE on the image tokens
  (models/ernie4_5_vl/ernie4_5_vl_moe.py:265-290), each compacted in token order by
  ``text_image_gather_scatter`` with FastDeploy's ``text_index`` / ``image_index`` of the
  step (:543).  The two calls are put back in token order through those same index
  buffers, the image experts' ids after the text experts' (``expert_id_offset``, :238):
  one id space ``[0, text + image)``, the group of a row read off its id range.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

__all__ = ["ExpertGroups", "ExpertPlacement", "MoEChunks", "RowAssembler"]

logger = logging.getLogger(__name__)


class ExpertPlacement:
    """Physical replica slot -> logical expert, through FastDeploy's own placement table.

    ``table``: ``RedundantExpertManger.model_ep_rank_to_expert_id_list``, int32
    ``[num_hidden_layers, physical slots]``, the tensor FastDeploy updates in place (never a
    copy); ``rows[layer_idx]``: the table row of the hook's ``layer_idx`` (FastDeploy's global
    ``FusedMoE.layer_idx``, which ``moe_select`` looks the table up with, ep.py:500), -1 where
    that layer's ids are logical already (no redundant select on its path).
    """

    def __init__(self, table: Any, rows: Sequence[int]) -> None:
        if len(table.shape) != 2:
            raise ValueError(f"the EPLB placement table must be [layers, slots], got {list(table.shape)}")
        self.table = table
        self.rows = tuple(int(r) for r in rows)
        self.slots = int(table.shape[1])
        for row in self.rows:
            if row >= int(table.shape[0]):
                raise ValueError(f"EPLB table row {row} is outside the table's {int(table.shape[0])} layers")

    def maps(self, layer_idx: int) -> bool:
        """Whether the hook's ids of ``layer_idx`` are physical slots (mapped here)."""
        return 0 <= layer_idx < len(self.rows) and self.rows[layer_idx] >= 0

    def logical(self, topk_ids: Any, layer_idx: int) -> Any:
        """``topk_ids`` as logical expert ids (one gather; -1 where the slot has none)."""
        if not self.maps(layer_idx):
            return topk_ids
        import paddle

        ids = topk_ids.astype("int64")
        inside = ids.clip(0, self.slots - 1)
        mapped = paddle.gather(self.table[self.rows[layer_idx]], inside.reshape([-1]))
        mapped = mapped.reshape(ids.shape).astype("int64")
        return paddle.where(inside == ids, mapped, paddle.full_like(mapped, -1))


class MoEChunks:
    """A layer's chunks (``forward_chunked_moe``), concatenated once its rows are complete."""

    def __init__(self) -> None:
        self._parts: dict[int, tuple[int, list[Any]]] = {}
        self.dropped = 0                 # layers whose chunks never completed a step

    def add(self, topk_ids: Any, layer_idx: int, num_tokens: int) -> Any:
        """The layer's rows when this call completes them; None while parts are held (and
        for the empty calls that keep EP ranks in step)."""
        rows = int(topk_ids.shape[0])
        if num_tokens < 0:
            return topk_ids
        expected, parts = self._parts.pop(layer_idx, (num_tokens, []))
        if parts and expected != num_tokens:
            self._drop(layer_idx, f"{expected} tokens, now a call for {num_tokens}")
            parts = []
        if rows == 0:
            if parts:
                self._parts[layer_idx] = (expected, parts)
            return None
        held = sum(int(p.shape[0]) for p in parts) + rows
        if held < num_tokens:
            self._parts[layer_idx] = (num_tokens, [*parts, topk_ids])
            return None
        if not parts:
            return topk_ids
        import paddle

        # More rows than tokens: returned as they are, so the recorder counts the mismatch.
        return paddle.concat([p.astype("int64") for p in parts] + [topk_ids.astype("int64")], axis=0)

    def end_step(self) -> None:
        """The step's rows are being offloaded: parts still held never completed."""
        for layer_idx in list(self._parts):
            self._drop(layer_idx, "the step ended first")
        self._parts.clear()

    def _drop(self, layer_idx: int, why: str) -> None:
        self.dropped += 1
        logger.error("routing replay: MoE layer %d's chunked-MoE rows were incomplete (%s); that "
                     "layer's rows of the step are stored as unknown", layer_idx, why)


class ExpertGroups:
    """ERNIE-4.5-VL's text and image MoE of a layer, put back in token order as one id space.

    ``token_types``, ``text_index``, ``image_index``: FastDeploy's own per-step buffers of the
    model (int32 ``[max_model_len]``; row ``t < num_tokens`` is the step's token ``t``: 0 text,
    1 image, and its index among the step's text / image tokens).  ``image`` is True while
    the image MoE runs (:meth:`image_call` wraps its forward); ``image_offset``: the text
    experts' count, added to the image MoE's ids.  The text MoE always gets at least one row
    (``max(tokens - image tokens, 1)``, ernie4_5_vl_moe.py:512); the image MoE may get none.
    """

    names = ("text", "image")

    def __init__(self, *, text_experts: int, image_experts: int, token_types: Any, text_index: Any,
                 image_index: Any) -> None:
        self.counts = (int(text_experts), int(image_experts))
        self.image_offset = int(text_experts)
        self.token_types, self.text_index, self.image_index = token_types, text_index, image_index
        self.image = False
        self._text: dict[int, Any] = {}

    def groups(self) -> list[dict[str, Any]]:
        """The record metadata ``expert_groups`` entry (docs/record-format.md)."""
        firsts = (0, self.image_offset)
        return [{"name": name, "first": first, "count": count}
                for name, first, count in zip(self.names, firsts, self.counts, strict=True)]

    def image_call(self, forward: Any) -> Any:
        """``forward`` (the image MoE's) marking its hook calls as the image group's; a
        forward wrapped before (by a previous manager) is unwrapped first."""
        forward = getattr(forward, "fdrr_original", forward)

        def image_forward(*args: Any, **kwargs: Any) -> Any:
            self.image = True
            try:
                return forward(*args, **kwargs)
            finally:
                self.image = False
        image_forward.fdrr_original = forward         # type: ignore[attr-defined]
        return image_forward

    def add(self, topk_ids: Any, layer_idx: int, num_tokens: int) -> Any:
        """The layer's rows for the step's tokens, or None while the image rows are due."""
        rows = int(topk_ids.shape[0])
        if not self.image:
            self._text[layer_idx] = topk_ids
            return topk_ids if rows == num_tokens else None     # all text: no image rows follow
        if rows == 0:
            return None                                          # no image token: text rows stand
        text = self._text.pop(layer_idx, None)
        if text is None or num_tokens < 0:
            raise ValueError(f"MoE layer {layer_idx}: {rows} image routed rows without the "
                             "layer's text rows of this step")
        import paddle

        types = self.token_types[:num_tokens].reshape([-1, 1])
        text_at = self.text_index[:num_tokens].astype("int64").clip(0, int(text.shape[0]) - 1)
        image_at = self.image_index[:num_tokens].astype("int64").clip(0, rows - 1)
        text_rows = paddle.gather(text.astype("int64"), text_at)
        image_rows = paddle.gather(topk_ids.astype("int64"), image_at)
        image_rows = paddle.where(image_rows < 0, image_rows, image_rows + self.image_offset)
        return paddle.where(types == 1, image_rows, text_rows)


class RowAssembler:
    """EPLB mapping, then expert groups, then chunks: what one hook call records (or None)."""

    def __init__(self, *, placement: ExpertPlacement | None = None, groups: ExpertGroups | None = None,
                 chunks: MoEChunks | None = None) -> None:
        self.placement, self.groups, self.chunks = placement, groups, chunks

    def add(self, topk_ids: Any, layer_idx: int, num_tokens: int) -> Any:
        ids = self.placement.logical(topk_ids, layer_idx) if self.placement is not None else topk_ids
        if self.groups is not None:
            ids = self.groups.add(ids, layer_idx, num_tokens)
            if ids is None:
                return None
        if self.chunks is not None:
            ids = self.chunks.add(ids, layer_idx, num_tokens)
        return ids

    def end_step(self) -> None:
        """Called when the step's rows are offloaded."""
        if self.chunks is not None:
            self.chunks.end_step()

    def stats(self) -> dict[str, int]:
        return {"chunked_layers_dropped": self.chunks.dropped} if self.chunks is not None else {}
