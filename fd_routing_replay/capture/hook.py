"""The MoE-layer hooks: write one layer's ``topk_ids`` into a device routing buffer.

Two hooks, one per FastDeploy R3 generation (see :mod:`fd_routing_replay.integrations.fastdeploy.api`),
each with FastDeploy's signature and keyword names so ``FusedMoE.forward`` binds it
unchanged (``functools.partial(hook, <buffer>=..., layer_idx=..., ...)``) and every MoE
backend calls it right after top-k with ``topk_ids=``:

* :func:`save_routing_to_buffer` — FastDeploy 2.5 / develop (``routing_replay_table=``);
* :func:`save_routing_to_buffer_v2` — FastDeploy 2.6 (``device_routing_buffer=``).

Both write the same token-major step buffer ``[max_batched_tokens, L, K]``
(:class:`~fd_routing_replay.capture.step_buffer.StepBuffer`): token ``t`` of the step is
row ``t``, so one layer is ONE call of the bound recorder (a pybind11 entry point of the
custom-op library, validated when the buffer was bound) — no index tensors, no Paddle op
dispatch, no per-layer validation in Python, no host sync.  Where the table API's tokens
sit (sequence, position, KV slot) is worked out once per step on the host from the
step's lengths (:mod:`fd_routing_replay.capture.positions`), not per layer.

A buffer no manager of ours registered (FastDeploy's own, another runner's) is handed
to FastDeploy's original function, registered with :func:`set_fallback` — never written
by us: FastDeploy allocates its table with the dtype *string* ``"uint16"``, which Paddle
treats as bfloat16, so our op must not touch it.

Tensor × expert parallelism: when ``tp_size > 1 and ep_size > 1`` FastDeploy routes each
TP rank's share of the tokens separately, so the shards are all-gathered over the TP
group first and only the padding rows of the last shard are dropped.  Any other
mismatch between the routed rows and the step's tokens (or more tokens than the step
buffer holds) is a real error: counted, logged, and the step's routing is marked lost
(never written shifted).

Verification mode (``capture.verify``, :mod:`fd_routing_replay.capture.verify`): a
binding's ``verify`` replaces each rank's rows with known values before the gather and
checks their placement after it; everything downstream is unchanged.

``layer_idx`` is FastDeploy's (global layer − ``moe_layer_start_index``); a binding's
``layer_rows`` maps it to our row when the model's MoE layers are not exactly the layers
from ``moe_layer_start_index`` on (DeepSeek-V3's ``first_k_dense_replace``, Qwen3-MoE's
``decoder_sparse_step``).

Never raises: a failure is counted and logged, and the forward goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TableBinding", "bind_table", "binding_of", "gather_topk_over_tp", "save_routing_to_buffer",
           "save_routing_to_buffer_v2", "set_fallback", "unbind_table"]

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
    verify: Any = None                               # capture.verify: a capture.verify.HookVerifier
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
        if isinstance(positions, tuple):
            positions = verify.table_positions(*positions)
        topk_ids = verify.shard(topk_ids, layer_idx, positions, sharded=sharded)
    if sharded:
        shard_rows = int(topk_ids.shape[0])
        topk_ids = _gathered(binding, topk_ids, num_tokens, layer_idx, tp_size, tp_group)
        if verify is not None:
            topk_ids = verify.placed(topk_ids, layer_idx, positions, shard_rows)
    return topk_ids


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
        num_tokens = batch_id_per_token.shape[0]
        if binding.verify is not None or (tp_size > 1 and ep_size > 1):
            topk_ids = _routed(binding, topk_ids, num_tokens, layer_idx, tp_size, ep_size, tp_group,
                               (batch_id_per_token, seq_lens_decoder, cu_seqlens_q))
        binding.record(topk_ids, layer_idx, num_tokens)
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
        if binding.verify is not None or (tp_size > 1 and ep_size > 1):
            topk_ids = _routed(binding, topk_ids, num_tokens, layer_idx, tp_size, ep_size, tp_group,
                               position_ids)
        binding.record(topk_ids, layer_idx, num_tokens)
    except Exception as exc:  # never stop the forward pass
        _fail(binding, layer_idx, exc)
    binding.seconds += time.perf_counter() - started


save_routing_to_buffer.fdrr_hook = True        # type: ignore[attr-defined]
save_routing_to_buffer_v2.fdrr_hook = True     # type: ignore[attr-defined]
