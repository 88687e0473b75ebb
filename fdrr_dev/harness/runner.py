"""A model runner that drives routing replay exactly the way FastDeploy's does.

``HarnessRunner`` plays FastDeploy's ``GPUModelRunner`` (2.4/2.5 line, V1 KV-cache
scheduler): it keeps the same ``share_inputs`` tensors with the same meaning and calls
the routing replay manager at the same points, in the same order, with the same kinds of
arguments —

1. ``insert_tasks_v1``: a PREFILL task (every chunk of a chunked prefill, and the
   recompute of a preempted request) sets ``seq_lens_decoder = prefill_start_index`` and
   calls ``register_request(batch_id=, request_id=)``; PREEMPTED/ABORT tasks reset the
   slot and call ``clear_request(batch_id=)``.
2. ``_preprocess``: ``pending_update_positions = get_token_positions(seq_lens_decoder=,
   seq_lens_this_time=)``; the forward meta carries ``get_routing_table()``.
3. forward: every MoE layer calls ``save_routing_to_buffer(routing_replay_table=,
   topk_ids=, batch_id_per_token=, seq_lens_decoder=, cu_seqlens_q=, layer_idx=,
   tp_size=, ep_size=, tp_group=)`` right after top-k.
4. post-process (after sampling and stop-flag update): ``compute_slot_mapping(positions=)``,
   ``update_host_cache(positions=, slot_mapping=)``, then ``put_finished_batch(
   finished_batch_ids=, seq_lens_decoder=seq_lens_decoder + seq_lens_encoder)`` where
   finished means EOS among the sampled (speculative: accepted) tokens — FastDeploy's
   rule — and only then ``update_inputs``.
5. RL weight update: ``clear_all_request()``.

``generation="step"`` drives FastDeploy 2.6's worker-side capturer instead
(:class:`~fd_routing_replay.capture.fd26.StepRoutingCapturer`, one per TP rank):
no register/clear calls; the forward meta carries ``get_device_routing_buffer()``
(gpu_model_runner.py:1400-1403) and every MoE layer calls ``save_routing_to_buffer_v2``
(model_executor/layers/moe/moe.py:747-759); after sampling, TP rank 0 calls
``prepare_pending_save(num_tokens, slot_mapping, position_ids)`` before the inputs update
(model_executor/pre_and_post_process.py:337-343 normal, :507-513 speculative) and every
rank ``flush_pending_save()`` once the step's event synchronised, before the outputs reach
the engine (worker/gpu_model_runner.py:2305-2311, 2328-2329 with overlap); an RL weight
update calls ``clear()`` (gpu_model_runner.py:2990-2992).  Finished requests are assembled
by the engine (:mod:`fdrr_dev.harness.slot_routing`), not here.

Tensor parallelism is simulated by ranks: one manager per TP rank, each with its own
table, all fed by the same forward; with EP > 1 each rank's hook sees only its shard of
``topk_ids`` and must all-gather first (:mod:`fdrr_dev.harness.parallel`).
With ``process_rank`` this runner is one real TP rank and holds only its own manager.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from fdrr_dev.harness.model import TinyMoEModel
from fdrr_dev.harness.paddle_runtime import paddle
from fdrr_dev.harness.parallel import ProcessRank, step_hook, table_hook

GENERATIONS = ("table", "step")      # FastDeploy 2.5's manager, 2.6's step capturer


class TaskKind(Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    PREEMPTED = "preempted"
    ABORT = "abort"


@dataclass
class Task:
    """What ``insert_tasks_v1`` receives for one slot (FastDeploy's ``Request``)."""

    kind: TaskKind
    idx: int
    request_id: str
    block_table: Sequence[int] = ()
    prefill_start: int = 0
    prefill_end: int = 0
    max_tokens: int = 0
    num_outputs: int = 0
    input_len: int = 0             # prompt + outputs so far (FastDeploy's prompt_lens)


@dataclass
class SlotStep:
    """What the engine feeds one slot this step and learns back."""

    tokens: Sequence[int]          # fed tokens: a prefill chunk, or [last] + drafts
    start: int                     # position of tokens[0] (= seq_lens_decoder)
    seed: int                      # the request's sampling seed
    sample: bool = True            # False for an intermediate prefill chunk
    outputs: list[int] = field(default_factory=list)   # accepted output tokens
    stopped: bool = False


class HarnessRunner:
    """FastDeploy-shaped runner around :class:`TinyMoEModel` (see module docstring)."""

    def __init__(
        self,
        model: TinyMoEModel,
        *,
        max_num_seqs: int,
        block_size: int,
        num_blocks: int,
        managers: Sequence[Any] | Callable[[dict[str, Any]], Sequence[Any]],
        tp_size: int = 1,
        ep_size: int = 1,
        num_speculative_tokens: int = 0,
        temperature: float = 0.7,
        eos_bias: float = 0.0,
        generation: str = "table",
        overlap_schedule: bool = False,
        process_rank: ProcessRank | None = None,
    ) -> None:
        if generation not in GENERATIONS:
            raise ValueError(f"generation must be one of {GENERATIONS}, got {generation!r}")
        if overlap_schedule and generation != "step":
            raise ValueError("overlap_schedule is FastDeploy 2.6's execute_model_overlap: use generation='step'")
        cfg = model.config
        self.generation = generation
        # execute_model_overlap (gpu_model_runner.py:2314-2350): step N's rows are flushed
        # after step N+1's forward, and the launch is padded beyond the step's tokens
        self.overlap_schedule = overlap_schedule
        self.overlap_padding = 3
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_blocks_per_seq = -(-cfg.max_model_len // block_size)
        self.tp_size = tp_size
        self.process_rank = process_rank      # a real TP rank: one manager, a real group
        self.ep_size = ep_size
        self.num_speculative_tokens = num_speculative_tokens
        self.temperature = temperature
        self.eos_bias = eos_bias
        self.kv_cache = model.new_kv_cache(num_blocks * block_size)
        self.drafts_proposed = 0
        self.drafts_accepted = 0
        # on_sample(seed, position, token, logits) sees every sampled token and the raw
        # logits row it was drawn from: the engine's logprobs (harness/r3_effect.py)
        self.on_sample: Callable[[int, int, int, np.ndarray], None] | None = None
        n = max_num_seqs
        # Host mirrors of FastDeploy's share_inputs; the Paddle tensors handed to the
        # manager are rebuilt from them each step (block_tables is shared and mutated).
        self.seq_lens_decoder = np.zeros(n, dtype=np.int32)
        self.seq_lens_encoder = np.zeros(n, dtype=np.int32)
        self.seq_lens_this_time = np.zeros(n, dtype=np.int32)
        self.stop_flags = np.ones(n, dtype=bool)
        self.step_idx = np.zeros(n, dtype=np.int64)
        self.max_dec_len = np.zeros(n, dtype=np.int64)
        self.prompt_lens = np.zeros(n, dtype=np.int64)
        self.block_tables_np = np.full((n, self.max_blocks_per_seq), -1, dtype=np.int32)
        k1 = num_speculative_tokens + 1
        self._input_views: dict[str, np.ndarray | None] = {}
        self.share_inputs: dict[str, Any] = {
            "block_tables": paddle.full([n, self.max_blocks_per_seq], -1, dtype="int32"),
            "eos_token_id": paddle.to_tensor(np.array([[cfg.eos_token_id]], dtype=np.int64)),
            "accept_num": paddle.zeros([n], dtype="int32"),
            "accept_tokens": paddle.full([n, k1], -1, dtype="int64"),
        }
        self._refresh_share_inputs()
        # FastDeploy builds its manager after the KV cache, around share_inputs["block_tables"]
        self.managers = list(managers(self.share_inputs) if callable(managers) else managers)
        if len(self.managers) != (1 if process_rank is not None else tp_size):
            raise ValueError(f"need one manager per TP rank in this process: got "
                             f"{len(self.managers)} for tp_size={tp_size}")
        # step generation: capture is off when the managers are not capturers (FastDeploy
        # 2.6 then has routing_replay_manager None and makes no calls)
        self.capturers = [m for m in self.managers if hasattr(m, "prepare_pending_save")] \
            if generation == "step" else []

    # ------------------------------------------------------------------ helpers
    def _refresh_share_inputs(self) -> None:
        for name, values in (("seq_lens_decoder", self.seq_lens_decoder), ("seq_lens_encoder", self.seq_lens_encoder),
                             ("seq_lens_this_time", self.seq_lens_this_time), ("stop_flags", self.stop_flags),
                             ("step_idx", self.step_idx), ("max_dec_len", self.max_dec_len),
                             ("prompt_lens", self.prompt_lens)):
            self._write_input(name, values.reshape(-1, 1))
        self.share_inputs["seq_lens_this_time_buffer"] = self.share_inputs["seq_lens_this_time"]

    def _write_input(self, name: str, values: np.ndarray) -> None:
        """``share_inputs[name] = values``, in place: FastDeploy's share_inputs are buffers
        allocated once and updated in place (gpu_model_runner.py:796-797, 858-860 in 2.5),
        so the same tensor object carries every step's values."""
        view = self._input_views.get(name)
        if view is not None and view.shape == values.shape:
            view[...] = values
            return
        tensor = paddle.to_tensor(values)
        self.share_inputs[name] = tensor
        view = np.from_dlpack(tensor)
        self._input_views[name] = view if view.flags.writeable else None   # NumPy < 2: read-only

    def _set_block_table(self, idx: int, blocks: Sequence[int]) -> None:
        row = np.full(self.max_blocks_per_seq, -1, dtype=np.int32)
        row[: len(blocks)] = blocks
        self.block_tables_np[idx] = row
        self.share_inputs["block_tables"][idx] = paddle.to_tensor(row)

    def _each_manager(self, method: str, **kwargs: Any) -> list[Any]:
        if self.generation == "step":        # 2.6's runner has no per-request capture calls
            return []
        return [getattr(manager, method)(**kwargs) for manager in self.managers]

    def copy_kv(self, slots: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """The KV entries of ``slots`` in every layer (what a KV transfer sends)."""
        index = paddle.to_tensor(np.asarray(slots, dtype=np.int64))
        return [(paddle.gather(k, index).numpy(), paddle.gather(v, index).numpy())
                for k, v in self.kv_cache]

    def write_kv(self, slots: np.ndarray, entries: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        """Store KV entries (from :meth:`copy_kv`) into ``slots`` of every layer."""
        index = paddle.to_tensor(np.asarray(slots, dtype=np.int64))
        for (k_cache, v_cache), (k, v) in zip(self.kv_cache, entries, strict=True):
            paddle.scatter_(k_cache, index, paddle.to_tensor(k), overwrite=True)
            paddle.scatter_(v_cache, index, paddle.to_tensor(v), overwrite=True)

    # ------------------------------------------------------------------ 1. insert
    def insert_tasks_v1(self, tasks: Sequence[Task]) -> None:
        for task in tasks:
            idx = task.idx
            if task.kind is TaskKind.PREFILL:
                length = task.prefill_end - task.prefill_start
                self._set_block_table(idx, task.block_table)
                self.stop_flags[idx] = False
                self.seq_lens_decoder[idx] = task.prefill_start
                self.seq_lens_this_time[idx] = length
                self.seq_lens_encoder[idx] = length
                self.step_idx[idx] = task.num_outputs
                self.max_dec_len[idx] = task.max_tokens
                self.prompt_lens[idx] = task.input_len
                # Routing Replay: every prefill chunk registers (repeats are harmless)
                self._each_manager("register_request", batch_id=idx, request_id=task.request_id)
            elif task.kind is TaskKind.DECODE:
                self._set_block_table(idx, task.block_table)
            else:  # PREEMPTED or ABORT
                self._set_block_table(idx, ())
                self.stop_flags[idx] = True
                self.seq_lens_this_time[idx] = 0
                self.seq_lens_decoder[idx] = 0
                self.seq_lens_encoder[idx] = 0
                self._each_manager("clear_request", batch_id=idx)

    # ------------------------------------------------------------------ 2-5. one step
    def execute_model(self, steps: dict[int, SlotStep]) -> None:
        """Run one step over ``steps`` (slot → what to feed); fills each step's outputs."""
        spec = self.num_speculative_tokens > 0
        for idx, step in steps.items():
            if self.stop_flags[idx]:
                raise RuntimeError(f"slot {idx} is stopped but was scheduled")
            if int(self.seq_lens_decoder[idx]) != step.start:
                raise RuntimeError(
                    f"slot {idx}: engine position {step.start} != seq_lens_decoder "
                    f"{int(self.seq_lens_decoder[idx])}")
            self.seq_lens_this_time[idx] = len(step.tokens)
        slots = sorted(steps)
        counts = np.array([len(steps[i].tokens) for i in slots], dtype=np.int64)
        token_ids = np.concatenate([np.asarray(steps[i].tokens, dtype=np.int64) for i in slots])
        positions = np.concatenate(
            [steps[i].start + np.arange(len(steps[i].tokens), dtype=np.int64) for i in slots])
        batch_ids = np.repeat(np.asarray(slots, dtype=np.int64), counts)
        cu_seqlens_q = np.zeros(self.max_num_seqs + 1, dtype=np.int32)
        per_slot = np.zeros(self.max_num_seqs, dtype=np.int64)
        per_slot[slots] = counts
        cu_seqlens_q[1:] = np.cumsum(per_slot)
        self._refresh_share_inputs()
        si = self.share_inputs
        si["batch_id_per_token"] = paddle.to_tensor(batch_ids.astype(np.int32))
        si["cu_seqlens_q"] = paddle.to_tensor(cu_seqlens_q)

        token_slots, context_slots, context_mask = self._attention_layout(steps, slots)
        if self.generation == "step":
            # get_position_ids_and_slot_mapping (gpu_model_runner.py:1318-1345): one KV slot
            # and position per token of the step, in the step's token order
            si["slot_mapping_buffer"] = paddle.to_tensor(token_slots.astype(np.int64))
            si["position_ids_buffer"] = paddle.to_tensor(positions.astype(np.int64))
            buffers = [manager.get_device_routing_buffer() for manager in self.capturers]
            hook = step_hook(buffers, si, self.tp_size, self.ep_size, len(token_ids),
                             self.process_rank) \
                if buffers else None
        else:
            # _preprocess: routing positions before the forward pass
            for manager in self.managers:
                manager.pending_update_positions = manager.get_token_positions(
                    seq_lens_decoder=si["seq_lens_decoder"],
                    seq_lens_this_time=si["seq_lens_this_time_buffer"])
            tables = [manager.get_routing_table() for manager in self.managers]
            hook = table_hook(tables, si, self.tp_size, self.ep_size, self.process_rank) \
                if tables[0] is not None else None

        # forward
        logits = self.model.forward_step(
            token_ids, positions, token_slots, context_slots, context_mask, self.kv_cache, hook)
        if self.overlap_schedule:      # save output (last batch): gpu_model_runner.py:2322-2329
            self.sync_routing()

        # sample: rows whose logits produce tokens
        logits_np = logits.numpy()
        offsets = np.concatenate(([0], np.cumsum(counts)))
        accept_num = np.zeros(self.max_num_seqs, dtype=np.int32)
        accept_tokens = np.full((self.max_num_seqs, self.num_speculative_tokens + 1), -1, np.int64)
        sampled_last = np.full(self.max_num_seqs, -1, dtype=np.int64)
        for row, idx in enumerate(slots):
            step = steps[idx]
            lo, hi = offsets[row], offsets[row + 1]
            if self.seq_lens_encoder[idx] > 0:        # prefill: only the last position samples
                targets = [self._sample(logits_np[hi - 1], step.seed, step.start + (hi - lo))]
                accepted = targets
            else:                                     # decode: every fed position samples
                targets = [self._sample(logits_np[lo + i], step.seed, step.start + i + 1)
                           for i in range(hi - lo)]
                accepted = [targets[0]]
                for i, draft in enumerate(step.tokens[1:]):
                    if draft != targets[i]:
                        break
                    accepted.append(targets[i + 1])
                self.drafts_proposed += len(step.tokens) - 1
                self.drafts_accepted += len(accepted) - 1
            sampled_last[idx] = targets[-1] if not spec else accepted[-1]
            accept_num[idx] = len(accepted)
            accept_tokens[idx, : len(accepted)] = accepted
            step.outputs = list(accepted) if step.sample else []
        self._post_process(steps, slots, accept_num, accept_tokens, sampled_last)

    def _post_process(self, steps: dict[int, SlotStep], slots: list[int], accept_num: np.ndarray,
                      accept_tokens: np.ndarray, sampled_last: np.ndarray) -> None:
        eos = self.model.config.eos_token_id
        spec = self.num_speculative_tokens > 0
        si = self.share_inputs
        # 1. stop value: EOS or max_dec_len (non-speculative: before routing, as FastDeploy)
        kept = {}
        for idx in slots:
            step = steps[idx]
            outs = step.outputs
            budget = int(self.max_dec_len[idx] - self.step_idx[idx])
            keep = outs[:budget]
            if eos in keep:
                keep = keep[: keep.index(eos) + 1]
            kept[idx] = keep
            if step.sample and keep and (keep[-1] == eos or len(keep) >= budget):
                step.stopped = True
                if not spec:
                    self.stop_flags[idx] = True
            if not spec and step.sample:
                self.step_idx[idx] += len(keep)
        self._write_input("stop_flags", self.stop_flags.reshape(-1, 1))
        self._write_input("step_idx", self.step_idx.reshape(-1, 1))
        self._write_input("accept_num", accept_num)
        self._write_input("accept_tokens", accept_tokens)

        if self.generation == "step":
            num_tokens = int(si["slot_mapping_buffer"].shape[0])
            if self.overlap_schedule:
                num_tokens = self._pad_launch(num_tokens)
            self._prepare_pending_save(num_tokens)
        else:
            self._table_post_process(steps, slots, accept_num, accept_tokens, sampled_last)

        # 2. update inputs (speculative: the unified update truncates and stops here)
        for idx in slots:
            step = steps[idx]
            if spec:
                if step.sample:
                    self.step_idx[idx] += len(kept[idx])
                if step.stopped:
                    self.stop_flags[idx] = True
            step.outputs = kept[idx]
            if self.seq_lens_encoder[idx] > 0:
                self.seq_lens_decoder[idx] += self.seq_lens_encoder[idx]
                self.seq_lens_encoder[idx] = 0
            else:
                self.seq_lens_decoder[idx] += int(accept_num[idx]) if spec else 1
            self.seq_lens_this_time[idx] = 0
            if self.stop_flags[idx]:
                self.seq_lens_decoder[idx] = 0
        if self.generation == "step" and not self.overlap_schedule:
            # after post_process_event.synchronize(), before _save_model_output hands the
            # outputs to the engine (gpu_model_runner.py:2305-2311)
            self.sync_routing()

    def sync_routing(self) -> None:
        """Every rank's ``flush_pending_save()``: the queued step's rows reach the host slot
        cache.  With overlap scheduling FastDeploy makes it after the next step's forward
        and before that step's ``_save_model_output``; the engine calls it before it
        finalizes a request whose last step is still queued."""
        for manager in self.capturers:
            manager.flush_pending_save()

    def _pad_launch(self, num_tokens: int) -> int:
        """The overlapped launch: ``token_num_overlap`` is the step's token count
        (gpu_model_runner.py:2342-2343) while the launch, sized by prediction, holds padding
        tokens beyond it (their slot entries aim at this step's own first slots, so rows
        that escaped the trim would overwrite real ones); returns the launch's count."""
        si = self.share_inputs
        for manager in self.capturers:
            manager.token_num_overlap = num_tokens
        # the launch fits the capture buffers (without capture, nothing bounds the padding)
        limit = max((m.max_batched_tokens for m in self.capturers),
                    default=num_tokens + self.overlap_padding)
        rows = min(self.overlap_padding, limit - num_tokens)
        if rows <= 0 or num_tokens == 0:
            return num_tokens
        slots = si["slot_mapping_buffer"].numpy()
        si["slot_mapping_buffer"] = paddle.to_tensor(np.concatenate([slots, slots[:rows]]))
        si["position_ids_buffer"] = paddle.to_tensor(np.concatenate(
            [si["position_ids_buffer"].numpy(), np.zeros(rows, dtype=np.int64)]))
        return num_tokens + rows

    def _prepare_pending_save(self, num_tokens: int) -> None:
        """pre_and_post_process.py:337-343 (:507-513 speculative): TP rank 0 queues the
        step's rows for the host slot cache, before the inputs update."""
        si = self.share_inputs
        for manager in self.capturers:
            if manager.tp_rank == 0:
                manager.prepare_pending_save(num_tokens, si["slot_mapping_buffer"],
                                             si["position_ids_buffer"])

    def _table_post_process(self, steps: dict[int, SlotStep], slots: list[int], accept_num: np.ndarray,
                            accept_tokens: np.ndarray, sampled_last: np.ndarray) -> None:
        """FastDeploy 2.5: host cache update, then finished requests."""
        eos = self.model.config.eos_token_id
        spec = self.num_speculative_tokens > 0
        if spec:
            finished = np.isin(np.where(np.arange(accept_tokens.shape[1])[None, :]
                                        < accept_num[:, None], accept_tokens, -1), [eos]).any(1)
        else:
            finished = sampled_last == eos
        finished &= np.isin(np.arange(self.max_num_seqs), [i for i in slots if steps[i].sample])
        context_lens = paddle.to_tensor(
            (self.seq_lens_decoder + self.seq_lens_encoder).astype(np.int32).reshape(-1, 1))
        for manager in self.managers:
            slot_mapping = manager.compute_slot_mapping(positions=manager.pending_update_positions)
            manager.update_host_cache(
                positions=manager.pending_update_positions, slot_mapping=slot_mapping)
            manager.put_finished_batch(
                finished_batch_ids=paddle.to_tensor(finished), seq_lens_decoder=context_lens)

    # ------------------------------------------------------------------ RL weight update
    def clear_requests(self) -> None:
        """FastDeploy's ``clear_requests``: stop every slot, then ``clear_all_request``."""
        self.stop_flags[:] = True
        self.seq_lens_this_time[:] = 0
        self.seq_lens_decoder[:] = 0
        self.seq_lens_encoder[:] = 0
        if self.generation == "step":
            for manager in self.capturers:
                manager.clear()                      # gpu_model_runner.py:2990-2992
        else:
            for manager in self.managers:
                manager.clear_all_request()

    def update_parameters(self, model: TinyMoEModel) -> None:
        """Swap in new weights (the KV cache is reset with them, as FastDeploy does)."""
        self.model = model
        self.kv_cache = model.new_kv_cache(self.num_blocks * self.block_size)

    # ------------------------------------------------------------------ internals
    def _sample(self, logits: np.ndarray, seed: int, position: int) -> int:
        """Sample the token at ``position`` with an RNG keyed by (seed, position).

        Keying by position (not by step) makes a request's tokens independent of batch
        composition, chunking, preemption and speculation.
        """
        token = self._draw(logits, seed, position)
        if self.on_sample is not None:
            self.on_sample(seed, position, token, logits)
        return token

    def _draw(self, logits: np.ndarray, seed: int, position: int) -> int:
        scores = logits.astype(np.float64)
        scores[self.model.config.eos_token_id] += self.eos_bias
        if self.temperature <= 0:
            return int(np.argmax(scores))
        scores = scores / self.temperature
        scores -= scores.max()
        probs = np.exp(scores)
        probs /= probs.sum()
        u = np.random.default_rng([seed, position]).random()
        return int(min(np.searchsorted(np.cumsum(probs), u, side="right"), len(probs) - 1))

    def _attention_layout(self, steps: dict[int, SlotStep], slots: list[int]):
        bs = self.block_size
        rows_slots, rows_ctx, rows_mask = [], [], []
        width = max(steps[i].start + len(steps[i].tokens) for i in slots)
        for idx in slots:
            step = steps[idx]
            end = step.start + len(step.tokens)
            pos = np.arange(end)
            blocks = self.block_tables_np[idx, pos // bs].astype(np.int64)
            if (blocks < 0).any():
                raise RuntimeError(f"slot {idx}: positions up to {end} are not covered by blocks")
            seq_slots = blocks * bs + pos % bs
            rows_slots.append(seq_slots[step.start:end])
            ctx = np.zeros((len(step.tokens), width), dtype=np.int64)
            ctx[:, :end] = seq_slots
            rows_ctx.append(ctx)
            own = step.start + np.arange(len(step.tokens))
            rows_mask.append(np.arange(width)[None, :] <= own[:, None])
        return np.concatenate(rows_slots), np.concatenate(rows_ctx), np.concatenate(rows_mask)
