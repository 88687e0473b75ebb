"""CPU stand-ins for the kernels that drive FastDeploy's engine-worker state machine.

Each function mirrors one custom op of FastDeploy's GPU build, with the signature its 2.6
Python callers use (declared in ``custom_ops/gpu_ops/cpp_extensions.cc``); the docstring
names the ``custom_ops/gpu_ops/*.cu`` file and kernel whose semantics it reproduces
(public PaddlePaddle/FastDeploy sources).  Only the non-speculative path is stood in: an
optional speculative input that is not None is refused by name.

These kernels decide when a request is prefilled, decoded, paused for blocks, resumed and
stopped; a stand-in that differs from the kernel hangs the engine rather than failing, so
each has hand-worked cases in ``tests/fdcpu/test_step_ops.py``.

Tensor shapes (worker/input_batch.py:110-230): ``seq_lens_this_time`` / ``_encoder`` /
``_decoder`` are int32 ``[max_num_seqs]`` (``seq_lens_this_time`` is a slice
``[:num_running_requests]``), ``step_seq_lens_decoder`` int32 ``[max_num_seqs, 1]``,
``prompt_lens`` / ``step_idx`` / ``next_tokens`` int64 ``[max_num_seqs, 1]``,
``stop_flags`` bool ``[max_num_seqs, 1]``, ``is_block_step`` bool ``[max_num_seqs]``,
``block_tables`` int32 ``[max_num_seqs, blocks_per_seq]``, ``input_ids`` int64
``[max_num_seqs, max_chunk_tokens]``, ``token_ids_all`` int64 ``[max_num_seqs, max_model_len]``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .tensors import read, require_none, write

__all__ = ["custom_numpy_to_tensor", "get_padding_offset", "get_position_ids_and_slot_mapping",
           "rebuild_padding", "recover_decode_task", "set_stop_value_multi_ends",
           "set_value_by_flags_and_idx", "update_inputs_v1"]


def get_padding_offset(input_ids: Any, seq_len: Any, draft_tokens: Any = None, seq_lens_encoder: Any = None,
                       token_num_cpu: int = 0) -> list:
    """``get_padding_offset`` (get_padding_offset.cu, ``PrefixSumKernel``): the step's tokens
    packed without padding.

    Row ``b`` contributes ``input_ids[b, :seq_len[b]]``; returns ``[ids_remove_padding
    (int64, token_num), batch_id_per_token (int32, token_num), cu_seqlens_q, cu_seqlens_k
    (int32, bsz + 1, prefix sums of seq_len)]``.  ``token_num_cpu`` is the caller's count of
    the step's tokens (gpu_model_runner.py:1262) and the kernel sizes its outputs by it.
    With overlap scheduling the count is predicted before the step's inputs are final
    (``_resolve_current_launch_token_num``, gpu_model_runner.py:364-387) and may exceed the
    sum of ``seq_len`` (a padded launch): the kernel leaves the tail of its ``paddle::empty``
    outputs unwritten, the stand-in fills it with token 0 and batch id -1.  A count below
    the sum would make the kernel write out of bounds; it is an error here.
    """
    import paddle

    require_none("get_padding_offset", draft_tokens=draft_tokens, seq_lens_encoder=seq_lens_encoder)
    ids = read(input_ids)
    lens = read(seq_len).reshape(-1).astype(np.int64)
    total = int(lens.sum())
    launch = int(token_num_cpu)
    if total > launch:
        raise ValueError(f"get_padding_offset: token_num_cpu={launch} but seq_lens_this_time sums "
                         f"to {total} ({lens.tolist()})")
    cu = np.zeros(len(lens) + 1, dtype=np.int32)
    cu[1:] = np.cumsum(lens)
    packed = np.zeros(launch, dtype=np.int64)
    batch_ids = np.full(launch, -1, dtype=np.int32)
    if total:
        packed[:total] = np.concatenate([ids[b, :n] for b, n in enumerate(lens)])
        batch_ids[:total] = np.repeat(np.arange(len(lens), dtype=np.int32), lens)
    return [paddle.to_tensor(packed.astype(np.int64)), paddle.to_tensor(batch_ids),
            paddle.to_tensor(cu), paddle.to_tensor(cu.copy())]


def get_position_ids_and_slot_mapping(seq_lens_encoder: Any, seq_lens_decoder: Any, seq_lens_this_time: Any,
                                      batch_id_per_token: Any, block_tables: Any, position_ids: Any,
                                      slot_mapping: Any, block_size: int) -> None:
    """``get_position_ids_and_slot_mapping`` (get_position_ids_and_slot_mapping.cu,
    ``GetPositionIdsAndSlotMappingKernel``), in place.

    For sequence ``b`` with ``n = seq_lens_this_time[b] > 0`` tokens starting at packed
    offset ``sum(seq_lens_this_time[:b])``: token ``i`` gets position ``seq_lens_decoder[b] +
    i`` and KV slot ``block_tables[batch_id_per_token[t], pos // block_size] * block_size +
    pos % block_size`` (the block table row is the token's batch id, as in the kernel).
    Unused entries of the buffers are left as they are.
    """
    lens = read(seq_lens_this_time).reshape(-1).astype(np.int64)
    decoded = read(seq_lens_decoder).reshape(-1).astype(np.int64)
    batch = read(batch_id_per_token).reshape(-1)
    tables = read(block_tables)
    positions = read(position_ids).reshape(-1)
    slots = read(slot_mapping).reshape(-1)
    offset = 0
    for b, n in enumerate(lens):
        for i in range(int(n)):
            pos = int(decoded[b]) + i
            row = int(batch[offset + i])
            positions[offset + i] = pos
            slots[offset + i] = int(tables[row, pos // block_size]) * block_size + pos % block_size
        offset += int(n)
    write(position_ids, positions)
    write(slot_mapping, slots)


def recover_decode_task(stop_flags: Any, seq_lens_this_time: Any, seq_lens_encoder: Any, seq_lens_decoder: Any,
                        step_seq_lens_decoder: Any, block_tables: Any, is_block_step: Any,
                        draft_tokens: Any = None, step_draft_tokens: Any = None,
                        step_seq_lens_this_time: Any = None, block_size: int = 64,
                        max_draft_tokens: int = 0) -> None:
    """``recover_decode_task`` (recover_decode_task.cu, kernel ``recover_decode_task``), in place.

    A sequence paused for lack of a KV block (``is_block_step``, set by
    :func:`update_inputs_v1`) resumes decoding once the scheduler has given it the block its
    next position needs: ``block_tables[b, step_seq_lens_decoder[b] // block_size] != -1``
    clears ``is_block_step`` and ``stop_flags``, sets ``seq_lens_this_time = 1``,
    ``seq_lens_encoder = 0`` and restores ``seq_lens_decoder`` from ``step_seq_lens_decoder``.
    """
    require_none("recover_decode_task", draft_tokens=draft_tokens, step_draft_tokens=step_draft_tokens,
                 step_seq_lens_this_time=step_seq_lens_this_time)
    this_time = read(seq_lens_this_time).reshape(-1)
    blocked = read(is_block_step).reshape(-1)
    if not blocked[: len(this_time)].any():
        return
    stops = read(stop_flags).reshape(-1)
    encoder = read(seq_lens_encoder).reshape(-1)
    decoder = read(seq_lens_decoder).reshape(-1)
    step_decoder = read(step_seq_lens_decoder).reshape(-1)
    tables = read(block_tables)
    for b in range(len(this_time)):
        if blocked[b] and tables[b, int(step_decoder[b]) // block_size] != -1:
            blocked[b] = False
            this_time[b] = 1
            stops[b] = False
            encoder[b] = 0
            decoder[b] = step_decoder[b]
    for tensor, values in ((is_block_step, blocked), (seq_lens_this_time, this_time), (stop_flags, stops),
                           (seq_lens_encoder, encoder), (seq_lens_decoder, decoder)):
        write(tensor, values)


def rebuild_padding(tmp_out: Any, cu_seqlens_q: Any, seq_len_this_time: Any, seq_lens_decoder: Any,
                    seq_lens_encoder: Any, batch_id_per_token_output: Any = None, cu_seqlens_q_output: Any = None,
                    first_token_out: Any = None, enable_logprob: bool = False) -> Any:
    """``rebuild_padding`` (rebuild_padding.cu, ``RebuildPaddingKernel``): one hidden row per
    sequence, the one whose logits sample its next token.

    Output ``[bsz, dim]`` (``bsz = len(cu_seqlens_q) - 1``), zero for a sequence with no
    tokens this step or one with ``seq_lens_decoder == seq_lens_encoder == 0``; otherwise row
    ``cu_seqlens_q[b] + (seq_lens_encoder[b] - 1 if seq_lens_encoder[b] > 0 else 0)`` of
    ``tmp_out`` (the last token of a prefill chunk, the single token of a decode step).
    """
    import paddle

    require_none("rebuild_padding", batch_id_per_token_output=batch_id_per_token_output,
                 cu_seqlens_q_output=cu_seqlens_q_output, first_token_out=first_token_out)
    cu = read(cu_seqlens_q).reshape(-1)
    this_time = read(seq_len_this_time).reshape(-1)
    decoder = read(seq_lens_decoder).reshape(-1)
    encoder = read(seq_lens_encoder).reshape(-1)
    bsz = len(cu) - 1
    rows = np.full(bsz, -1, dtype=np.int64)
    for b in range(bsz):
        if this_time[b] == 0 or (decoder[b] == 0 and encoder[b] == 0):
            continue
        rows[b] = int(cu[b]) + (int(encoder[b]) - 1 if encoder[b] > 0 else 0)
    out = paddle.zeros([bsz, tmp_out.shape[1]], dtype=tmp_out.dtype)
    live = np.nonzero(rows >= 0)[0]
    if len(live):
        out[paddle.to_tensor(live)] = paddle.gather(tmp_out, paddle.to_tensor(rows[live]))
    return out


def set_value_by_flags_and_idx(token_ids_all: Any, input_ids: Any, seq_lens_this_time: Any, seq_lens_encoder: Any,
                               seq_lens_decoder: Any, prompt_lens: Any, step_idx: Any, stop_flags: Any) -> None:
    """``set_value_by_flags_and_idx`` (set_value_by_flags.cu, ``set_value_by_flag_and_id``), in place.

    Records the token a running sequence feeds this step in its history: for a sequence not
    stopped, with tokens (``seq_lens_decoder`` or ``seq_lens_encoder`` non-zero) and
    ``step_idx > 0`` generated tokens, ``input_ids[b, seq_lens_encoder[b] - 1]`` (prefill:
    the chunk's last token) or ``input_ids[b, 0]`` (decode) goes to generated slot
    ``step_idx[b]``.  2.6 keeps the generated tokens in ``token_ids_all`` after the prompt
    (the MTP proposer reads them back as ``token_ids_all[b, prompt_len:]``,
    worker/input_batch.py:754-759), so slot ``j`` is ``token_ids_all[b, prompt_lens[b] + j]``.
    """
    history = read(token_ids_all)
    ids = read(input_ids)
    stops = read(stop_flags).reshape(-1)
    encoder = read(seq_lens_encoder).reshape(-1)
    decoder = read(seq_lens_decoder).reshape(-1)
    prompts = read(prompt_lens).reshape(-1)
    steps = read(step_idx).reshape(-1)
    changed = False
    for b in range(read(seq_lens_this_time).reshape(-1).shape[0]):
        if stops[b] or (decoder[b] == 0 and encoder[b] == 0) or steps[b] <= 0:
            continue
        token = ids[b, int(encoder[b]) - 1] if encoder[b] > 0 else ids[b, 0]
        column = int(prompts[b]) + int(steps[b])
        if column < history.shape[1]:
            history[b, column] = token
            changed = True
    if changed:
        write(token_ids_all, history)


def _prefill_one_step_stop(variable: str) -> bool:
    return os.environ.get(variable, "")[:1] == "1"


def set_stop_value_multi_ends(topk_ids: Any, stop_flags: Any, seq_lens: Any, end_ids: Any, next_tokens: Any,
                              token_ids_all: Any, prompt_lens: Any, step_idx: Any, stop_seqs: Any,
                              stop_seqs_len: Any, min_tokens: Any, beam_search: bool = False) -> None:
    """``set_stop_value_multi_ends`` (stop_generation_multi_ends.cu, ``GetStopFlagsMulti`` /
    ``set_value_by_flags``; the 2.6 signature with ``token_ids_all``, ``prompt_lens`` and
    ``min_tokens`` is the one of the XPU plugin's reference CPU wrapper,
    custom_ops/xpu_ops/src/plugin/src/wrapper/nn_set_stop_value_multi_ends.cpp), in place.

    Per sequence ``b`` (``bsz = len(topk_ids)``), with ``can_stop = step_idx[b] >= min_tokens[b]``:

    * a stopped sequence emits ``-1`` if it had no tokens this step, else the first end id
      (``topk_ids`` and ``next_tokens``); a running one passes its sampled token to
      ``next_tokens``;
    * a sampled end id stops the sequence (when ``can_stop``), written as ``end_ids[0]``;
    * a stop sequence matching the tail of the generated history
      (``token_ids_all[b, prompt_lens[b] + step_idx[b] - k]``, k = 1..len) stops it too.

    ``PREFILL_NODE_ONE_STEP_STOP=1`` (a PD prefill instance) stops every sequence after one step.
    """
    ids = read(topk_ids).reshape(-1)
    stops = read(stop_flags).reshape(-1)
    lens = read(seq_lens).reshape(-1)
    ends = read(end_ids).reshape(-1)
    nexts = read(next_tokens).reshape(-1)
    steps = read(step_idx).reshape(-1)
    minimum = read(min_tokens).reshape(-1)
    history = read(token_ids_all)
    prompts = read(prompt_lens).reshape(-1)
    seqs = read(stop_seqs)
    seq_lens = read(stop_seqs_len)
    one_step = _prefill_one_step_stop("PREFILL_NODE_ONE_STEP_STOP")
    for b in range(len(ids)):
        can_stop = steps[b] >= minimum[b]
        if one_step:
            stops[b] = True
            if lens[b] == 0:
                ids[b] = -1
            nexts[b] = ids[b]
        else:
            if stops[b]:
                if lens[b] == 0:
                    ids[b] = -1
                else:
                    ids[b] = ends[0]
                    nexts[b] = ends[0]
            else:
                nexts[b] = ids[b]
            if not beam_search and can_stop and ids[b] in ends:
                stops[b] = True
                ids[b] = ends[0]
                nexts[b] = ends[0]
        if can_stop and not stops[b]:
            generated = history[b, int(prompts[b]):]
            for s in range(seqs.shape[1]):
                length = int(seq_lens[b, s])
                if length <= 0:
                    continue
                tail = [int(steps[b]) - k for k in range(1, length + 1)]
                if min(tail) >= 0 and all(generated[t] == seqs[b, s, length - k]
                                          for k, t in enumerate(tail, start=1)):
                    nexts[b] = ends[0]
                    stops[b] = True
                    ids[b] = ends[0]
                    break
    write(topk_ids, ids)
    write(stop_flags, stops)
    write(next_tokens, nexts)


def update_inputs_v1(stop_flags: Any, not_need_stop: Any, seq_lens_this_time: Any, seq_lens_encoder: Any,
                     seq_lens_decoder: Any, step_seq_lens_decoder: Any, prompt_lens: Any, topk_ids: Any,
                     input_ids: Any, block_tables: Any, next_tokens: Any, is_block_step: Any,
                     block_size: int) -> None:
    """``update_inputs_v1`` (update_inputs_v1.cu, ``update_inputs_kernel_v1``), in place: the
    next step's inputs after this step's tokens were sampled.

    For each of the step's ``bsz = len(seq_lens_this_time)`` sequences:

    * stopped: no tokens next step (``seq_lens_this_time = seq_lens_decoder =
      seq_lens_encoder = 0``); its sampled token becomes ``-1`` if the prompt was not fully
      forwarded yet (``seq_lens_this_time + seq_lens_decoder < prompt_lens``);
    * prompt fully forwarded: decode next step -- ``seq_lens_decoder += seq_lens_this_time``,
      one token (``next_tokens[b]`` into ``input_ids[b, 0]``); if the block that position
      needs is not allocated (``block_tables[b, seq_lens_decoder // block_size] == -1``) the
      sequence pauses: ``is_block_step``, ``stop_flags``, ``step_seq_lens_decoder`` keeps the
      length, ``seq_lens_decoder = seq_lens_this_time = 0`` (:func:`recover_decode_task`
      resumes it);
    * a chunk of the prompt still to come: stopped, its token ``-1`` (the scheduler sends the
      next chunk as a new prefill).

    ``not_need_stop[0]`` is True while any of the ``max_bsz = len(stop_flags)`` slots still
    runs (slots at and beyond ``bsz`` count as stopped).  ``PREFILL_NODE_ONE_STEP_STOP_V1=1``
    stops a sequence once its prompt is forwarded (a PD prefill instance).
    """
    stops = read(stop_flags).reshape(-1)
    this_time = read(seq_lens_this_time).reshape(-1)
    encoder = read(seq_lens_encoder).reshape(-1)
    decoder = read(seq_lens_decoder).reshape(-1)
    step_decoder = read(step_seq_lens_decoder).reshape(-1)
    prompts = read(prompt_lens).reshape(-1)
    sampled = read(topk_ids).reshape(-1)
    ids = read(input_ids)
    tables = read(block_tables)
    nexts = read(next_tokens).reshape(-1)
    blocked = read(is_block_step).reshape(-1)
    max_bsz, bsz = len(stops), len(this_time)
    one_step = _prefill_one_step_stop("PREFILL_NODE_ONE_STEP_STOP_V1")
    stopped = [True] * max_bsz
    for b in range(min(bsz, max_bsz)):
        stopped[b] = bool(stops[b])
        if stops[b]:
            if this_time[b] + decoder[b] < prompts[b]:
                sampled[b] = -1
            this_time[b] = decoder[b] = encoder[b] = 0
        elif this_time[b] + decoder[b] >= prompts[b]:
            if one_step:
                stops[b] = True
                this_time[b] = decoder[b] = encoder[b] = 0
                stopped[b] = True
            else:
                decoder[b] += this_time[b]
                this_time[b] = 1
                encoder[b] = 0
                ids[b, 0] = nexts[b]
                if tables[b, int(decoder[b]) // block_size] == -1:
                    blocked[b] = True
                    this_time[b] = 0
                    stops[b] = True
                    step_decoder[b] = decoder[b]
                    decoder[b] = 0
                    stopped[b] = True
        else:
            stops[b] = True
            this_time[b] = decoder[b] = encoder[b] = 0
            sampled[b] = -1
            stopped[b] = True
    write(not_need_stop, np.array([sum(stopped) < max_bsz]))
    for tensor, values in ((stop_flags, stops), (seq_lens_this_time, this_time), (seq_lens_encoder, encoder),
                           (seq_lens_decoder, decoder), (step_seq_lens_decoder, step_decoder),
                           (topk_ids, sampled), (input_ids, ids), (is_block_step, blocked)):
        write(tensor, values)


def custom_numpy_to_tensor(array: np.ndarray, tensor: Any) -> Any:
    """``custom_numpy_to_tensor`` (cpp_extensions.cc, ``CustomNumpyToTensor``): copy a NumPy
    array's bytes into ``tensor`` (a ``cudaMemcpyAsync`` host to device there) and return it.
    The bytes are taken as ``tensor``'s dtype, as the kernel's raw copy does."""
    source = np.ascontiguousarray(array)
    count = int(np.prod(tensor.shape))
    target_dtype = read(tensor).dtype
    if source.nbytes != count * target_dtype.itemsize:
        raise ValueError(f"custom_numpy_to_tensor: {source.nbytes} bytes into a tensor of {count} x "
                         f"{target_dtype} ({count * target_dtype.itemsize} bytes)")
    write(tensor, source.view(target_dtype).reshape(-1))
    return tensor
