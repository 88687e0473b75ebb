"""The device side of capture: the step buffer, the MoE-layer hooks, verification mode.

**The step buffer** (:class:`StepBuffer`, one per manager or capturer): ``[max_batched_tokens,
L, K]`` of the routing dtype on the device; token ``t`` of the current step is row ``t``
(FastDeploy 2.6's and vLLM's layout, not a request-major ``[seqs, max_len, L, K]`` table,
which costs gigabytes of KV-cache memory); int64 device counters ``[1 + L]`` (bad expert
ids, then calls per layer) written by the record kernel, read once per step with the rows,
so they stay right under CUDA-graph replay; a bound recorder (one pybind11 call per layer,
validated once); one asynchronous copy of the step's rows and counters into host staging.

**The hooks**, one per FastDeploy R3 generation, each with FastDeploy's signature and keyword
names so ``FusedMoE.forward`` binds it unchanged and every MoE backend calls it right after
top-k: :func:`save_routing_to_buffer` (2.5 / develop, ``routing_replay_table=``) and
:func:`save_routing_to_buffer_v2` (2.6, ``device_routing_buffer=``).  Both write the step
buffer with ONE bound call per layer: no index tensors, no Paddle op dispatch, no host
sync.  A buffer no manager of ours registered is handed to FastDeploy's original function
(:func:`set_fallback`), never written by us.  Tensor x expert parallelism: the TP ranks'
shards are all-gathered first and only the last shard's padding rows dropped.  Any other
mismatch between the routed rows and the step's tokens is counted, logged, and the step's
routing is marked lost (never written shifted).  ``layer_idx`` is FastDeploy's (global layer
- ``moe_layer_start_index``); a binding's ``layer_rows`` maps it to our row when the model's
MoE layers are not exactly the layers from ``moe_layer_start_index`` on.  Never raises.

**Verification mode** (``capture.verify``, :class:`HookVerifier`): each rank records a known
function of (position, layer, rank) instead of the routing -- the layer taken from the order of
the hook's calls, not from the call site's ``layer_idx`` -- checked for placement after the
TP x EP gather, so ``fd-rr selftest`` can check every stored row end to end (the function
and its limits are :mod:`fd_routing_replay.codec.verification`'s).  Everything after the
hook is the production path, unchanged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fd_routing_replay import ops
from fd_routing_replay.codec.verification import MARKER_KEY, VerificationCode, marker
from fd_routing_replay.ops.dtypes import PD_INDEX

__all__ = ["HookVerifier", "StepBuffer", "TableBinding", "bind_table", "binding_of",
           "enable_verification", "gather_topk_over_tp", "mark_records",
           "save_routing_to_buffer", "save_routing_to_buffer_v2", "set_fallback", "unbind_table"]


class StepBuffer:
    """Device step buffer + device counters + bound recorder + host staging."""

    def __init__(self, *, max_tokens: int, num_layers: int, top_k: int, num_experts: int,
                 table_experts: int | None = None, layer_rows: tuple[int, ...] | None = None,
                 place: Any = None, extra_itemsize: int = 0) -> None:
        import paddle

        self.max_tokens = int(max_tokens)
        self.num_layers = int(num_layers)
        self.top_k = int(top_k)
        experts_in_table = int(table_experts if table_experts is not None else num_experts)
        self.dtype = ops.routing_dtype(experts_in_table)
        self.fill_value = ops.fill_value(self.dtype)
        self.buffer = ops.new_step_buffer(self.max_tokens, self.num_layers, self.top_k,
                                          experts_in_table, place=place)
        self.place = self.buffer.place
        self.counters = paddle.zeros([1 + self.num_layers], dtype="int64", device=self.place)
        self.host_rows = np.full((self.max_tokens, self.num_layers, self.top_k), self.fill_value,
                                 dtype=self.dtype)
        self.host_counters = np.zeros(1 + self.num_layers, dtype=np.int64)
        self.host_extra = np.zeros(self.max_tokens * int(extra_itemsize), dtype=np.uint8)
        self.recorder = ops.bind_step_recorder(
            self.buffer, self.counters, num_experts=int(num_experts), layer_rows=layer_rows,
            host_rows=self.host_rows, host_counters=self.host_counters, host_extra=self.host_extra)
        self.record = self.recorder.record            # the hook's per-layer call
        # the counters as last read, and the step's change (fixed arrays: the manager's
        # compiled ledger reads and updates them in place)
        self.seen_counters = np.zeros(1 + self.num_layers, dtype=np.int64)
        self.counter_delta = np.zeros(1 + self.num_layers, dtype=np.int64)
        self._pending: tuple[int, np.dtype | None] | None = None
        self.assembler: Any = None        # capture.rows.RowAssembler: told when a step's rows are offloaded

    @property
    def device_bytes(self) -> int:
        """Device memory capture holds: the step buffer and the counters."""
        return int(self.max_tokens * self.num_layers * self.top_k * self.dtype.itemsize
                   + 8 * (1 + self.num_layers))

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def start_offload(self, num_tokens: int, extra: Any = None, *, extra_dtype: np.dtype | None = None) -> None:
        """Queue the copy of rows ``[0, num_tokens)`` (+ counters, + ``extra``) to the host;
        ``extra_dtype``: ``extra``'s dtype as NumPy's, when the caller knows it already."""
        num_tokens = max(0, min(int(num_tokens), self.max_tokens))
        if extra is not None and extra_dtype is None:
            extra_dtype = np.dtype(PD_INDEX.get(extra.dtype) or np.int64)
        if self.assembler is not None:
            self.assembler.end_step()
        self.recorder.offload(num_tokens, extra)
        self._pending = (num_tokens, extra_dtype)

    def wait_offload(self) -> tuple[int, np.dtype | None] | None:
        """Wait for the queued copy; ``(rows staged, dtype of the staged extra)``, or None if
        none was queued.  The counter deltas are left to the caller (the bound ledger or
        flush, which read ``host_counters`` against ``seen_counters``)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        self.recorder.wait()
        return pending

    def bad_ids_total(self) -> int:
        """All bad expert ids recorded so far (reads the device counters: not per step)."""
        return int(self.counters.numpy()[0])

    def calls_total(self) -> int:
        """All record calls so far (reads the device counters: not per step)."""
        return int(self.counters.numpy()[1:].sum())

    def fill(self) -> None:
        """Every row back to the fill (RL round cleanup)."""
        self._pending = None
        self.recorder.fill()


logger = logging.getLogger(__name__)


@dataclass
class TableBinding:
    """What the hook knows about a buffer: its recorder and whom to tell about errors.

    ``record`` is the step buffer's bound entry point; ``calls`` and ``bad_ids`` come from
    the buffer's device counters (right under CUDA-graph replay too).
    """

    num_experts: int
    step: Any = None                                 # StepBuffer
    on_error: Callable[[int, BaseException], None] | None = None
    layer_rows: tuple[int, ...] | None = None       # FastDeploy layer_idx → our row (in the recorder)
    verify: Any = None                               # capture.verify: a HookVerifier
    assemble: Any = None                             # a RowAssembler: EPLB, chunks, expert groups
    errors: int = 0
    mismatches: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.record = self.step.record if self.step is not None else None

    @property
    def calls(self) -> int:
        """Record calls so far (device counters)."""
        return self.step.calls_total() if self.step is not None else 0

    @property
    def bad_ids(self) -> int:
        """Expert ids outside ``[0, num_experts)`` so far (device counters)."""
        return self.step.bad_ids_total() if self.step is not None else 0


_BINDINGS: dict[int, TableBinding] = {}
_LOCK = threading.Lock()


def bind_table(table: Any, binding: TableBinding) -> None:
    """Register ``table`` (a manager's device buffer) with its binding."""
    with _LOCK:
        _BINDINGS[id(table)] = binding


def binding_of(table: Any) -> TableBinding | None:
    """The binding registered for ``table`` (None when no manager of ours owns it)."""
    return _BINDINGS.get(id(table))


def unbind_table(table: Any) -> None:
    with _LOCK:
        _BINDINGS.pop(id(table), None)


_FALLBACKS: dict[str, Callable[..., Any]] = {}
_UNBOUND_WARNED: set[str] = set()


def set_fallback(hook_name: str, original: Callable[..., Any] | None) -> None:
    """Register FastDeploy's own ``hook_name`` function for buffers that are not ours."""
    with _LOCK:
        if original is None:
            _FALLBACKS.pop(hook_name, None)
        else:
            _FALLBACKS[hook_name] = original


def fallback(hook_name: str) -> Callable[..., Any] | None:
    """FastDeploy's own function registered for ``hook_name`` (None if none)."""
    return _FALLBACKS.get(hook_name)


def _delegate(hook_name: str, kwargs: dict[str, Any]) -> None:
    """Hand a buffer we do not own to FastDeploy's function (or leave it alone)."""
    original = _FALLBACKS.get(hook_name)
    if original is not None:
        original(**kwargs)
        return
    if hook_name not in _UNBOUND_WARNED:
        _UNBOUND_WARNED.add(hook_name)
        logger.warning("routing replay: %s got a buffer no fd-routing-replay manager owns and no "
                       "FastDeploy function to hand it to; it is left untouched", hook_name)


def gather_topk_over_tp(topk_ids: Any, tp_size: int, tp_group: Any) -> Any:
    """All-gather every TP rank's ``[tokens_per_rank, K]`` shard, in rank order."""
    if hasattr(tp_group, "all_gather"):      # an in-process group (the harness)
        return tp_group.all_gather(topk_ids)
    import paddle

    gathered = paddle.zeros([topk_ids.shape[0] * tp_size, topk_ids.shape[1]], dtype=topk_ids.dtype)
    paddle.distributed.all_gather(gathered, topk_ids, tp_group)
    return gathered


_MISMATCH_MARKERS = ("routed rows", "exceed the step buffer")


class _RowMismatch(ValueError):
    """A row-count mismatch found (and counted) in Python."""


def _mismatch(binding: TableBinding, layer_idx: int, what: str) -> None:
    binding.mismatches += 1
    raise _RowMismatch(f"MoE layer {layer_idx}: {what}")


def _gathered(binding: TableBinding, topk_ids: Any, num_tokens: int, layer_idx: int,
              tp_size: int, tp_group: Any) -> Any:
    """TP × EP: every rank's shard all-gathered; only the last shard's padding dropped."""
    topk_ids = gather_topk_over_tp(topk_ids, tp_size, tp_group)
    if num_tokens < 0:
        return topk_ids
    if topk_ids.shape[0] < num_tokens:
        _mismatch(binding, layer_idx, f"{topk_ids.shape[0]} routed rows after the TP all-gather "
                  f"for {num_tokens} tokens")
    return topk_ids[:num_tokens] if topk_ids.shape[0] != num_tokens else topk_ids


def _routed(binding: TableBinding, topk_ids: Any, num_tokens: int, layer_idx: int, tp_size: int,
            ep_size: int, tp_group: Any, positions: Any) -> Any:
    """The rows to record: TP x EP shards all-gathered; in verification mode
    (``binding.verify``) each rank's known values instead of its routing, checked for their
    placement after the gather.  ``positions``: the step's position ids, or the table API's
    (batch_id_per_token, seq_lens_decoder, cu_seqlens_q) they are computed from."""
    verify = binding.verify
    sharded = tp_size > 1 and ep_size > 1
    if verify is not None:
        row = verify.next_row()               # by call order, not by the call site's layer_idx
        if isinstance(positions, tuple):
            positions = verify.table_positions(*positions)
        topk_ids = verify.shard(topk_ids, row, positions, sharded=sharded)
    if sharded:
        shard_rows = int(topk_ids.shape[0])
        topk_ids = _gathered(binding, topk_ids, num_tokens, layer_idx, tp_size, tp_group)
        if verify is not None:
            topk_ids = verify.placed(topk_ids, row, positions, shard_rows)
    return topk_ids


def _record(binding: TableBinding, topk_ids: Any, layer_idx: int, num_tokens: int, tp_size: int,
            ep_size: int, tp_group: Any, positions: Any) -> None:
    """Both hooks' body: assemble (EPLB, chunks, expert groups), gather / verify, record."""
    if binding.assemble is not None:
        topk_ids = binding.assemble.add(topk_ids, layer_idx, num_tokens)
        if topk_ids is None:               # a part of the layer's rows: held until the rest comes
            return
    if binding.verify is not None or (tp_size > 1 and ep_size > 1):
        topk_ids = _routed(binding, topk_ids, num_tokens, layer_idx, tp_size, ep_size, tp_group, positions)
    binding.record(topk_ids, layer_idx, num_tokens)


def _fail(binding: TableBinding | None, layer_idx: int, exc: BaseException) -> None:
    if binding is not None:
        binding.errors += 1
        text = str(exc)
        if not isinstance(exc, _RowMismatch) and any(m in text for m in _MISMATCH_MARKERS):
            binding.mismatches += 1                  # raised by the recorder
        if binding.on_error is not None:
            binding.on_error(layer_idx, exc)
    logger.error("routing replay: recording MoE layer %d failed; the routing of this "
                 "step's requests is marked lost: %r", layer_idx, exc)


def save_routing_to_buffer(
    routing_replay_table: Any,
    topk_ids: Any,
    batch_id_per_token: Any,
    seq_lens_decoder: Any,
    cu_seqlens_q: Any,
    layer_idx: int,
    tp_size: int = 1,
    ep_size: int = 1,
    tp_group: Any = None,
) -> None:
    """Record ``topk_ids`` of MoE layer ``layer_idx`` (FastDeploy 2.5's hook signature).

    ``routing_replay_table`` is our step buffer; row ``t`` gets token ``t``.  The
    ``batch_id_per_token`` / ``cu_seqlens_q`` / ``seq_lens_decoder`` placement is resolved
    once per step on the host, so only the row count is checked here.
    """
    binding = _BINDINGS.get(id(routing_replay_table))
    if binding is None:
        if routing_replay_table is None or topk_ids is None:
            return
        _delegate("save_routing_to_buffer", dict(
            routing_replay_table=routing_replay_table, topk_ids=topk_ids,
            batch_id_per_token=batch_id_per_token, seq_lens_decoder=seq_lens_decoder,
            cu_seqlens_q=cu_seqlens_q, layer_idx=layer_idx, tp_size=tp_size, ep_size=ep_size,
            tp_group=tp_group))
        return
    started = time.perf_counter()
    try:
        _record(binding, topk_ids, layer_idx, batch_id_per_token.shape[0], tp_size, ep_size, tp_group,
                (batch_id_per_token, seq_lens_decoder, cu_seqlens_q))
    except Exception as exc:  # never stop the forward pass
        _fail(binding, layer_idx, exc)
    binding.seconds += time.perf_counter() - started


def save_routing_to_buffer_v2(
    device_routing_buffer: Any,
    topk_ids: Any,
    layer_idx: int,
    tp_size: int,
    ep_size: int,
    tp_group: Any,
    total_token_num: int = -1,
    position_ids: Any = None,
    debug_mode: bool = False,
) -> None:
    """Record ``topk_ids`` of MoE layer ``layer_idx`` into a step buffer (FastDeploy 2.6)."""
    binding = _BINDINGS.get(id(device_routing_buffer))
    if binding is None:
        if device_routing_buffer is None or topk_ids is None:
            return
        _delegate("save_routing_to_buffer_v2", dict(
            device_routing_buffer=device_routing_buffer, topk_ids=topk_ids, layer_idx=layer_idx,
            tp_size=tp_size, ep_size=ep_size, tp_group=tp_group, total_token_num=total_token_num,
            position_ids=position_ids, debug_mode=debug_mode))
        return
    started = time.perf_counter()
    try:
        num_tokens = int(total_token_num) if total_token_num is not None and total_token_num >= 0 else -1
        _record(binding, topk_ids, layer_idx, num_tokens, tp_size, ep_size, tp_group, position_ids)
    except Exception as exc:  # never stop the forward pass
        _fail(binding, layer_idx, exc)
    binding.seconds += time.perf_counter() - started


save_routing_to_buffer.fdrr_hook = True        # type: ignore[attr-defined]
save_routing_to_buffer_v2.fdrr_hook = True     # type: ignore[attr-defined]


class HookVerifier:
    """The hook's verification step for one rank's buffer (see the module docstring).

    The MoE row a call records comes from the order of the hook's calls, not from the
    ``layer_idx`` the call site passes: a model calls its ``L`` MoE layers in order, once each
    per forward (a CUDA graph replays them as captured, in that order), so call ``n`` is MoE
    row ``n mod L``.  A call site that passes another layer's index stores this layer's known
    values in that layer's row, and the selftest names the row.  ``layer_map``: the global
    decoder-layer index of each MoE row (the records' layer map).
    """

    def __init__(self, code: VerificationCode, *, tp_rank: int, layer_map: Sequence[int]) -> None:
        if len(layer_map) != code.num_layers:
            raise ValueError(f"verification: the layer map has {len(layer_map)} MoE layers, the "
                             f"code {code.num_layers}")
        if not 0 <= int(tp_rank) < code.ranks:
            raise ValueError(f"verification: TP rank {tp_rank} is outside the code's {code.ranks} ranks")
        self.code = code
        self.tp_rank = int(tp_rank)
        self.calls = 0                       # hook calls so far on this rank
        self._tables: dict[str, Any] = {}
        self._misplaced: Any = None          # int64 device counter of placement faults

    # ------------------------------------------------------------------ the hook's calls
    def current_row(self) -> int:
        """The MoE row the hook's next (or current) call records: its place in the call order."""
        return self.calls % self.code.num_layers

    def next_row(self) -> int:
        """:meth:`current_row`, counting the call (the hook calls it once per call)."""
        row = self.current_row()
        self.calls += 1
        return row

    def shard(self, topk_ids: Any, row: int, positions: Any, *, sharded: bool) -> Any:
        """This rank's ``f`` values of MoE row ``row`` in place of the ``topk_ids`` it routed.

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
        return self._values(mine, row, self.tp_rank).astype(topk_ids.dtype)

    def placed(self, gathered: Any, row: int, positions: Any, shard_rows: int) -> Any:
        """TP x EP, after the all-gather: rows not holding rank ``t // c``'s value get the
        placement-fault symbol (and are counted)."""
        import paddle

        rows = int(gathered.shape[0])
        positions = positions.reshape([-1]).astype("int64")[:rows]
        owner = paddle.arange(rows, dtype="int64") // max(int(shard_rows), 1)
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


def mark_records(metadata: dict[str, Any], code: VerificationCode) -> None:
    """Mark every record built with ``metadata`` as a verification record."""
    metadata[MARKER_KEY] = marker(code)


def enable_verification(capture: Any, *, num_experts: int, top_k: int, layer_map: Sequence[int],
                        tp_size: int = 1, tp_rank: int | None = None) -> HookVerifier:
    """Put ``capture`` (a :class:`RoutingReplayManager` or :class:`StepRoutingCapturer`) in
    verification mode: its hook records ``f`` and its records (where it builds them) are
    marked.  Logs a WARNING: the routing is not recorded while this is on."""
    code = VerificationCode(int(num_experts), int(top_k), len(layer_map), max(int(tp_size), 1))
    rank = int(capture.tp_rank if tp_rank is None else tp_rank)
    verifier = HookVerifier(code, tp_rank=rank, layer_map=layer_map)
    capture.binding.verify = verifier
    handoff = getattr(capture, "handoff", None)
    if handoff is not None:
        mark_records(handoff.metadata, code)
    logger.warning("fd-routing-replay: VERIFICATION MODE (capture.verify) on TP rank %d: the MoE hook "
                   "records a test pattern (period %d positions), NOT the routing; records are marked "
                   "and trainers refuse them. Run `fd-rr selftest`, then turn it off.", rank, code.period)
    return verifier
