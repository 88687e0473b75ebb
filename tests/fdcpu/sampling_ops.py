"""CPU stand-ins for the sampling kernels of FastDeploy's ``Sampler.forward_cuda``
(model_executor/layers/sample/sampler.py:775-862 in 2.6).

* ``get_token_penalty_multi_scores`` -- custom_ops/gpu_ops/token_penalty_multi_scores.cu
  (``min_dec_length_logits_process``, ``update_repeat_times``,
  ``update_value_by_repeat_times``, ``ban_bad_words``): called by
  ``apply_penalty_multi_scores`` (sample/ops/apply_penalty_multi_scores.py:42-57); it
  also divides by the temperature.
* ``paddle.tensor.top_p_sampling`` -- Paddle's own op, which has no CPU kernel; FastDeploy's
  default sampling class (``FD_SAMPLING_CLASS=base``) calls it in ``top_k_top_p_sampling``
  (sample/ops/top_k_top_p_sampling.py:117-126).  Mode ``truncated``: per row, a uniform
  draw ``u`` from the row's seed scaled by the row's ``top_p`` picks the first token, in
  order of decreasing probability, whose cumulative probability exceeds ``u * top_p``;
  ``top_p = 0`` is greedy.
* ``min_p_sampling`` (min_p_sampling.cu) and ``top_k_renorm_probs`` (top_k_renorm_probs.cu):
  only called when a request sets ``min_p`` / ``top_k``.

The stand-ins are deterministic given the per-request seeds FastDeploy passes
(``infer_seed``, advanced by the runner every step, gpu_model_runner.py:2689-2691), not
bit-identical to the GPU's random streams.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .tensors import read, write

__all__ = ["get_token_penalty_multi_scores", "min_p_sampling", "top_k_renorm_probs", "top_p_sampling"]


def get_token_penalty_multi_scores(token_ids_all: Any, logits: Any, penalty_scores: Any, frequency_scores: Any,
                                   presence_scores: Any, temperatures: Any, bad_tokens: Any, bad_tokens_lens: Any,
                                   prompt_lens: Any, cur_dec_lens: Any, min_dec_lens: Any,
                                   eos_token_id: Any) -> Any:
    """Penalties, temperature, minimum length and bad words on ``logits`` ``[bsz, vocab]``, in
    place (token_penalty_multi_scores.cu).

    Per row ``b``: while ``0 <= cur_dec_lens[b] < min_dec_lens[b]`` every end id scores
    ``-1e10``; with a repetition / frequency / presence penalty, a token seen only in the
    prompt (``token_ids_all[b, :prompt_lens[b]]``) has its logit multiplied (negative) or
    divided (positive) by the repetition penalty, a token generated ``n`` times
    (``token_ids_all[b, prompt_lens[b]:]``, ids >= 0) gets that too and then ``- n *
    frequency - presence``; every logit is divided by the temperature (the whole row is
    skipped when penalty 1, frequency 0, presence 0 and temperature 1); bad words score
    ``-1e10``.
    """
    values = read(logits).astype(np.float32)
    bsz, vocab = values.shape
    history = read(token_ids_all)
    alpha = read(penalty_scores).reshape(-1)
    beta = read(frequency_scores).reshape(-1)
    gamma = read(presence_scores).reshape(-1)
    temperature = read(temperatures).reshape(-1)
    bad = read(bad_tokens)
    bad_lens = read(bad_tokens_lens).reshape(-1)
    prompts = read(prompt_lens).reshape(-1)
    decoded = read(cur_dec_lens).reshape(-1)
    minimum = read(min_dec_lens).reshape(-1)
    ends = read(eos_token_id).reshape(-1)
    for b in range(bsz):
        if 0 <= decoded[b] < minimum[b]:
            values[b, ends] = -1e10
        penalised = not (alpha[b] == 1.0 and beta[b] == 0.0 and gamma[b] == 0.0)
        if penalised and decoded[b] >= 0:
            times = np.zeros(vocab, dtype=np.int64)
            prompt = history[b, : int(prompts[b])]
            times[prompt[prompt >= 0]] = -1
            generated = history[b, int(prompts[b]):]
            generated = generated[generated >= 0]
            if len(generated):
                counts = np.bincount(generated, minlength=vocab)
                seen = counts > 0
                times[seen] = counts[seen]
        else:
            times = np.zeros(vocab, dtype=np.int64)
        if penalised or temperature[b] != 1.0:
            row = values[b]
            hit = times != 0
            row[hit] = np.where(row[hit] < 0, row[hit] * alpha[b], row[hit] / alpha[b])
            more = times > 0
            row[more] = row[more] - times[more] * beta[b] - gamma[b]
            values[b] = row / temperature[b]
        width = bad.shape[1]
        for token in bad[b, : min(int(bad_lens[b]), width)]:
            if 0 <= token < vocab:
                values[b, token] = -1e10
    write(logits, values)
    return logits


def top_p_sampling(x: Any, ps: Any, threshold: Any = None, topp_seed: Any = None, seed: int = -1, k: int = 0,
                   mode: str = "truncated", return_top: bool = False, name: Any = None) -> tuple:
    """``paddle.tensor.top_p_sampling`` on the CPU, mode ``truncated``: returns ``(scores [bsz, 1],
    ids [bsz, 1] int64)``.  Row ``b`` draws ``u`` from a generator seeded by
    ``topp_seed[b]`` (``seed`` when no per-row seeds are given) and takes the first token, in
    decreasing probability (ties: lower id first), whose cumulative probability exceeds
    ``u * ps[b]``; ``ps[b] = 0`` takes the most probable token."""
    import paddle

    if threshold is not None or k != 0 or return_top or mode != "truncated":
        raise NotImplementedError("top_p_sampling stand-in: only mode 'truncated' without threshold / top-k "
                                  f"(got threshold={threshold is not None}, k={k}, mode={mode!r})")
    probs = read(x).astype(np.float64)
    top_p = read(ps).reshape(-1)
    seeds = read(topp_seed).reshape(-1) if topp_seed is not None else None
    ids = np.zeros((probs.shape[0], 1), dtype=np.int64)
    scores = np.zeros((probs.shape[0], 1), dtype=np.float32)
    for b, row in enumerate(probs):
        order = np.argsort(-row, kind="stable")
        cumulative = np.cumsum(row[order])
        row_seed = int(seeds[b]) if seeds is not None else int(seed)
        draw = np.random.default_rng(row_seed if row_seed >= 0 else None).random()
        target = draw * float(top_p[b])
        pick = int(np.searchsorted(cumulative, target, side="right"))
        pick = min(pick, len(order) - 1)
        ids[b, 0] = order[pick]
        scores[b, 0] = row[order[pick]]
    return paddle.to_tensor(scores).astype(x.dtype), paddle.to_tensor(ids)


def min_p_sampling(probs: Any, min_p: Any) -> Any:
    """``min_p_sampling`` (min_p_sampling.cu): zero every probability below ``min_p[b]`` times
    the row's largest (the same rule as FastDeploy's non-CUDA path, sample/ops/
    top_k_top_p_sampling.py:226-229)."""
    import paddle

    values = read(probs)
    floor = values.max(axis=-1, keepdims=True) * read(min_p).reshape(-1, 1)
    return paddle.to_tensor(np.where(values < floor, 0.0, values).astype(values.dtype))


def top_k_renorm_probs(probs: Any, top_k: Any) -> Any:
    """``top_k_renorm_probs`` (top_k_renorm_probs.cu): keep each row's ``top_k[b]`` most probable
    tokens (all of them for ``top_k[b] <= 0``) and renormalise the row."""
    import paddle

    values = read(probs).astype(np.float64)
    ks = read(top_k).reshape(-1)
    for b, row in enumerate(values):
        k = int(ks[b])
        if 0 < k < len(row):
            keep = np.argsort(-row, kind="stable")[:k]
            mask = np.zeros(len(row), dtype=bool)
            mask[keep] = True
            row[~mask] = 0.0
            values[b] = row / row.sum()
    return paddle.to_tensor(values.astype(read(probs).dtype))
