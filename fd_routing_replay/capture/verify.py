"""Verification mode in the MoE hook: record a known function of (position, layer, rank)
instead of the routing, so that ``fd-rr selftest`` can check every stored row end to end.

``capture.verify`` turns it on (never for rollouts that train: the ids are a test pattern,
records are marked, adapters refuse them).  The function and its limits are
:mod:`fd_routing_replay.codec.verification`'s.  What the hook does with it
(:mod:`fd_routing_replay.capture.hook` calls :class:`HookVerifier`):

1. Each TP rank replaces the ``topk_ids`` it routed with ``f(p, l, r)``: ``p`` the
   token's position (FastDeploy 2.6 passes ``position_ids``; for 2.5's table API it is
   ``seq_lens_decoder[b] + t - cu_seqlens_q[b]``, FastDeploy's own kernel's placement),
   ``l`` the MoE row of the layer, computed from FastDeploy's ``layer_idx`` and the model's
   layer map independently of the recorder's own mapping, and ``r`` the rank.  Under
   TP x EP rank ``r`` routed the step's rows ``[r * c, (r + 1) * c)`` (``c`` its shard's
   rows, FastDeploy's split), so it takes those rows' positions.
2. After the TP x EP all-gather, row ``t`` must hold rank ``t // c``'s value; a row that
   does not is rewritten with the placement-fault symbol ``R + t // c`` (and counted), so
   the fault reaches the stored record and the selftest names it.  Values are computed
   on the device, without a host sync.

Everything after the hook -- the offload, the slot cache, prefix-cache hits, chunked
prefill, preemption, the PD hand-over, CPU swap, assembly, the writer and the store -- is
the production path, unchanged; the selftest checks what comes out of it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fd_routing_replay.codec.verification import MARKER_KEY, VerificationCode, marker

__all__ = ["HookVerifier", "enable_verification", "mark_records"]

logger = logging.getLogger(__name__)


class HookVerifier:
    """The hook's verification step for one rank's buffer (see the module docstring).

    ``layer_offset`` is what FastDeploy subtracts from a decoder layer's index to make
    ``layer_idx`` (``moe_layer_start_index``, moe.py:748); ``layer_map`` the global
    decoder-layer index of each MoE row (the records' layer map).
    """

    def __init__(self, code: VerificationCode, *, tp_rank: int, layer_offset: int,
                 layer_map: Sequence[int]) -> None:
        if len(layer_map) != code.num_layers:
            raise ValueError(f"verification: the layer map has {len(layer_map)} MoE layers, the "
                             f"code {code.num_layers}")
        if not 0 <= int(tp_rank) < code.ranks:
            raise ValueError(f"verification: TP rank {tp_rank} is outside the code's {code.ranks} ranks")
        self.code = code
        self.tp_rank = int(tp_rank)
        self.layer_offset = int(layer_offset)
        self.row_of = {int(layer): row for row, layer in enumerate(layer_map)}
        self._tables: dict[str, Any] = {}
        self._misplaced: Any = None          # int64 device counter of placement faults

    # ------------------------------------------------------------------ the hook's calls
    def row(self, layer_idx: int) -> int:
        """The MoE row of FastDeploy's ``layer_idx`` (ValueError for a layer with no row)."""
        layer = int(layer_idx) + self.layer_offset
        if layer not in self.row_of:
            raise ValueError(f"verification: MoE layer_idx {layer_idx} (decoder layer {layer}) is "
                             f"not in the layer map {sorted(self.row_of)}")
        return self.row_of[layer]

    def shard(self, topk_ids: Any, layer_idx: int, positions: Any, *, sharded: bool) -> Any:
        """This rank's ``f`` values in place of the ``topk_ids`` it routed.

        ``positions`` covers the whole step (int64, at least the step's tokens);
        ``sharded``: TP x EP, this rank routed rows ``[rank * c, rank * c + c)`` only.
        """
        import paddle

        rows = int(topk_ids.shape[0])
        if positions is None:
            raise ValueError("verification mode needs the step's position ids (FastDeploy's "
                             "forward_meta.position_ids)")
        positions = positions.reshape([-1]).astype("int64")
        if sharded:
            start = min(self.tp_rank * rows, int(positions.shape[0]))
            mine = positions[start:start + rows]
            if int(mine.shape[0]) < rows:        # the last shard's padding rows
                mine = paddle.concat([mine, paddle.zeros([rows - int(mine.shape[0])], dtype="int64")])
        else:
            mine = positions[:rows]
        if int(mine.shape[0]) != rows:
            raise ValueError(f"verification: {rows} routed rows but {int(mine.shape[0])} position ids")
        return self._values(mine, self.row(layer_idx), self.tp_rank).astype(topk_ids.dtype)

    def placed(self, gathered: Any, layer_idx: int, positions: Any, shard_rows: int) -> Any:
        """TP x EP, after the all-gather: rows not holding rank ``t // c``'s value get the
        placement-fault symbol (and are counted)."""
        import paddle

        rows = int(gathered.shape[0])
        positions = positions.reshape([-1]).astype("int64")[:rows]
        owner = paddle.arange(rows, dtype="int64") // max(int(shard_rows), 1)
        row = self.row(layer_idx)
        expected = self._values(positions, row, owner).astype(gathered.dtype)
        wrong = (gathered != expected).any(axis=1)
        flagged = self._values(positions, row, owner + self.code.ranks).astype(gathered.dtype)
        count = wrong.astype("int64").sum()
        self._misplaced = count if self._misplaced is None else self._misplaced + count
        return paddle.where(wrong.unsqueeze(1), flagged, gathered)

    @staticmethod
    def table_positions(batch_id_per_token: Any, seq_lens_decoder: Any, cu_seqlens_q: Any) -> Any:
        """FastDeploy 2.5's placement of step row ``t``: ``seq_lens_decoder[b] + t -
        cu_seqlens_q[b]`` with ``b = batch_id_per_token[t]`` (its save kernel's)."""
        import paddle

        batch = batch_id_per_token.reshape([-1]).astype("int64").clip(min=0)
        starts = paddle.gather(cu_seqlens_q.reshape([-1]).astype("int64"), batch)
        decoded = paddle.gather(seq_lens_decoder.reshape([-1]).astype("int64"), batch)
        return decoded + paddle.arange(int(batch.shape[0]), dtype="int64") - starts

    def misplaced_rows(self) -> int:
        """Rows the TP x EP all-gather put in another rank's share so far (reads the device)."""
        return 0 if self._misplaced is None else int(self._misplaced.numpy())

    # ------------------------------------------------------------------ internals
    def _values(self, positions: Any, row: int, symbols: Any) -> Any:
        """``f`` on the device: int64 ``[n, K]`` for int64 ``positions`` ``[n]``."""
        import paddle

        code = self.code
        table = self._table(positions.place)
        value = (positions % code.period * code.num_layers + row) * code.symbols + symbols
        columns = []
        for k in range(code.top_k, 0, -1):
            chosen = paddle.searchsorted(table[k], value, right=True) - 1
            columns.append(chosen)
            value = value - paddle.gather(table[k], chosen)
        return paddle.stack(columns, axis=1)

    def _table(self, place: Any) -> Any:
        key = str(place)
        if key not in self._tables:
            import paddle

            self._tables[key] = paddle.to_tensor(self.code.table, place=place)
        return self._tables[key]


def mark_records(assembler: Any, code: VerificationCode) -> None:
    """Mark every record ``assembler`` builds as a verification record."""
    assembler.metadata[MARKER_KEY] = marker(code)


def enable_verification(capture: Any, *, num_experts: int, top_k: int, layer_map: Sequence[int],
                        layer_offset: int, tp_size: int = 1, tp_rank: int | None = None) -> HookVerifier:
    """Put ``capture`` (a :class:`RoutingReplayManager` or :class:`StepRoutingCapturer`) in
    verification mode: its hook records ``f`` and its records (where it builds them) are
    marked.  Logs a WARNING: the routing is not recorded while this is on."""
    code = VerificationCode(int(num_experts), int(top_k), len(layer_map), max(int(tp_size), 1))
    rank = int(capture.tp_rank if tp_rank is None else tp_rank)
    verifier = HookVerifier(code, tp_rank=rank, layer_offset=layer_offset, layer_map=layer_map)
    capture.binding.verify = verifier
    assembler = getattr(capture, "assembler", None)
    if assembler is not None:
        mark_records(assembler, code)
    logger.warning("fd-routing-replay: VERIFICATION MODE (capture.verify) on TP rank %d: the MoE hook "
                   "records a test pattern (period %d positions), NOT the routing; records are marked "
                   "and trainers refuse them. Run `fd-rr selftest`, then turn it off.", rank, code.period)
    return verifier
