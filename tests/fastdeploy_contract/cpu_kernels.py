"""CPU stand-ins that compute, for FastDeploy kernels the EPLB, multimodal and model-matrix
contract tests run through (the ones ``tests/fdcpu`` does not provide).

Each reproduces the CUDA kernel it names (custom_ops/gpu_ops in the public
PaddlePaddle/FastDeploy repository), read from its source; none is FastDeploy's code.

=====================================  =====================================================
stand-in                               CUDA source
=====================================  =====================================================
:class:`RedundantTopkSelect`           moe/moe_redundant_topk_select.cu (the
                                       ``apply_norm_weight`` path: ``moe_softmax`` then
                                       ``moe_redundant_top_k_normed``, moe/fused_moe_op.h)
=====================================  =====================================================
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

CALLS: Counter = Counter()
"""How often each stand-in ran (a test checks the model took the path it names)."""

__all__ = ["RedundantTopkSelect", "softmax_topk", "xorwow"]

_MASK = 0xFFFFFFFF


def read(tensor: Any) -> np.ndarray:
    return np.array(tensor.numpy()) if hasattr(tensor, "numpy") else np.asarray(tensor)


def xorwow(state: int) -> int:
    """``xorwow_moe`` (moe/fused_moe_op.h): the kernel's per-row random step (uint32)."""
    state ^= state >> 7
    state ^= (state << 9) & _MASK
    state ^= state >> 13
    return state & _MASK


def _c_int(value: int) -> int:
    """``(int)`` of a uint32, two's complement (what nvcc does)."""
    return value - (1 << 32) if value >= 1 << 31 else value


def _c_mod(a: int, b: int) -> int:
    """C's ``%``: truncates toward zero, the result takes the dividend's sign."""
    return int(np.fmod(a, b))


def softmax_topk(logits: np.ndarray, top_k: int, bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' selection: float32 softmax over the experts, the ``top_k`` best of
    ``softmax + bias`` (ties: the lower expert id); ``(ids [n, k], softmax [n, E])``."""
    logits = logits.astype(np.float32)
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32)
    scores = probs + bias.reshape(1, -1).astype(np.float32) if bias is not None else probs
    return np.argsort(-scores, axis=1, kind="stable")[:, :top_k], probs


class RedundantTopkSelect:
    """``moe_redundant_topk_select`` (EPLB's top-k with redundant experts), on the CPU.

    Per token row: softmax over the logical experts (float32); the ``k`` best of
    ``softmax + bias`` in turn (ties: the lower expert id, as ``cub::ArgMax``); for each, a
    replica drawn from the per-row random state ``state = block_row + blockIdx.x * 256``
    (blocks of 256 threads; one block per row up to 1024 rows, else a ``[ceil(n/256), 256]``
    grid, ``Get1DBlocksAnd2DGridsMoe``), ``state = xorwow(state)``,
    ``select = (int)state % expert_in_rank_num_list[e]`` and the physical slot
    ``expert_id_to_ep_rank_array[e * (R + 1) + select]``; ``tokens_per_expert_stats_list[e]``
    += 1; the weights are the softmax values over their sum.  Returns ``[topk_ids int64,
    topk_weights float32]`` like the op.

    The draw is cast to a signed int before the modulo, as the kernel does: a draw of 2^31
    or more gives a negative ``select``, so the kernel then reads the slot *before* the
    chosen expert's row (another expert's replica, or -1).  Reproduced: the slot read there
    is returned (-1 where the kernel would read before the array).  ``signed_draw=False``
    takes the modulo of the unsigned draw instead, so every slot is a replica of the chosen
    expert (for a test that compares records with the router's top-k row by row; the signed
    draw is exercised in test_eplb.py).  ``calls`` keeps, per call, the logical choice, the
    slots and whether each draw stayed inside the chosen expert's replicas.
    """

    def __init__(self, *, signed_draw: bool = True) -> None:
        self.signed_draw = signed_draw
        self.calls: list[dict[str, np.ndarray]] = []

    def __call__(self, gating_logits: Any, expert_id_to_ep_rank_array: Any, expert_in_rank_num_list: Any,
                 tokens_per_expert_stats_list: Any, bias: Any = None, moe_topk: int = 1,
                 apply_norm_weight: bool = True, enable_softmax_top_k_fused: bool = False,
                 redundant_ep_rank_num_plus_one: int = 1) -> list[Any]:
        import paddle

        if not apply_norm_weight or enable_softmax_top_k_fused:
            raise NotImplementedError("moe_redundant_topk_select stand-in: the apply_norm_weight, unfused "
                                      "path only (what FastDeploy's EPRunner.moe_select calls)")
        logits = read(gating_logits).astype(np.float32)
        rows, experts = logits.shape
        logical, probs = softmax_topk(logits, moe_topk, read(bias) if bias is not None else None)
        table = read(expert_id_to_ep_rank_array).reshape(-1)
        replicas = read(expert_in_rank_num_list).reshape(-1)
        width = int(redundant_ep_rank_num_plus_one)
        physical = np.empty_like(logical)
        inside = np.ones(logical.shape, bool)
        grid_x = rows if rows <= 1024 else -(-rows // 256)
        for row in range(rows):
            block_x = row if rows <= 1024 else row % grid_x
            state = (row + block_x * 256) & _MASK
            for j in range(moe_topk):
                state = xorwow(state)
                expert = int(logical[row, j])
                select = _c_mod(_c_int(state) if self.signed_draw else state, int(replicas[expert]))
                flat = expert * width + select
                inside[row, j] = select >= 0
                physical[row, j] = table[flat] if flat >= 0 else -1
        weights = np.take_along_axis(probs, logical, axis=1)
        weights = weights / weights.sum(axis=1, keepdims=True)
        stats = read(tokens_per_expert_stats_list)
        stats += np.bincount(logical.reshape(-1), minlength=experts).astype(stats.dtype)
        tokens_per_expert_stats_list.copy_(paddle.to_tensor(stats), False)
        CALLS["moe_redundant_topk_select"] += 1
        self.calls.append({"logical": logical.astype(np.int64), "physical": physical.astype(np.int64),
                           "inside": inside})
        return [paddle.to_tensor(physical.astype(np.int64)), paddle.to_tensor(weights.astype(np.float32))]


# ----------------------------------------------------------------------------- attention
def rotary(x: Any, positions: np.ndarray, theta: float, neox: bool) -> Any:
    """Rotary position embedding of ``x`` ``[tokens, heads, dim]`` at ``positions``:
    halves rotated (``neox``) or even/odd pairs (GPT-J style), as FastDeploy's rope kernels
    (encoder_write_cache_with_rope / the rotary_embs it precomputes) do."""
    import paddle

    dim = x.shape[-1]
    inv = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    angles = positions.astype(np.float64)[:, None] * inv[None, :]                  # [T, dim/2]
    cos = paddle.to_tensor(np.cos(angles).astype(np.float32)).unsqueeze(1)
    sin = paddle.to_tensor(np.sin(angles).astype(np.float32)).unsqueeze(1)
    x = x.astype("float32")
    if neox:
        first, second = x[..., : dim // 2], x[..., dim // 2:]
        return paddle.concat([first * cos - second * sin, second * cos + first * sin], axis=-1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return paddle.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(x.shape)


def head_rms_norm(x: Any, weight: Any, eps: float) -> Any:
    import paddle

    x = x.astype("float32")
    return x * paddle.rsqrt((x * x).mean(axis=-1, keepdim=True) + eps) * weight.astype("float32")


class PagedAttentionBackend:
    """FastDeploy's attention backend interface (``AttentionBackend.forward``,
    layers/attention/base_attention_backend.py), computed on the CPU for a float32 model.

    Standard attention (``append_attention``, custom_ops/gpu_ops/append_attention.cu): the
    packed ``qkv`` ``[tokens, (H + 2 Hkv) D]`` is split into heads, rotary position
    embedding applied at each token's position (``layer.use_neox_rotary_style``; theta from
    the model config), q/k RMS-normed after it when the layer asks (``q_norm_weight``,
    ``k_norm_weight`` unless ``qk_norm_before_rope``), the step's keys and values written
    into the paged cache (``forward_meta.caches``, ``tests/fdcpu/attention.py``) and every
    query attends causally to its sequence's cached positions, within the layer's sliding
    window, with the layer's attention sinks in the softmax.  Positions are the tokens'
    indices in their sequence (the 1-D case; multi-axis rope positions of image tokens are
    not reproduced: the routing checks need the model to compute, not to match a GPU's
    numbers).  The MLA path (DeepSeek-V3) is :class:`MLAAttentionBackend`.
    """

    def __init__(self, fd_config: Any, block_size: int) -> None:
        self.fd_config = fd_config
        self.block_size = block_size
        self.theta = float(getattr(fd_config.model_config, "rope_theta", 10000.0) or 10000.0)

    def init_attention_metadata(self, forward_meta: Any) -> None:
        return None

    def forward(self, q: Any, k: Any, v: Any, qkv: Any, compressed_kv: Any, k_pe: Any, layer: Any,
                forward_meta: Any) -> Any:
        import paddle

        from tests.fdcpu.attention import step_layout

        CALLS["attention" + (":sliding_window" if getattr(layer, "sliding_window", 0) else "")] += 1
        heads, kv_heads, dim = layer.num_heads, layer.kv_num_heads, layer.head_dim
        tokens = int(qkv.shape[0])
        qkv = qkv.astype("float32").reshape([tokens, heads + 2 * kv_heads, dim])
        q, k, v = qkv[:, :heads], qkv[:, heads: heads + kv_heads], qkv[:, heads + kv_heads:]
        layout = step_layout(forward_meta, tokens)
        positions = layout.positions
        norm = getattr(layer, "q_norm_weight", None) is not None and not getattr(layer, "qk_norm_before_rope", False)
        neox = bool(getattr(layer, "use_neox_rotary_style", False))
        q, k = rotary(q, positions, self.theta, neox), rotary(k, positions, self.theta, neox)
        if norm:
            q = head_rms_norm(q, layer.q_norm_weight, layer.rms_norm_eps)
            k = head_rms_norm(k, layer.k_norm_weight, layer.rms_norm_eps)
        caches = forward_meta.caches
        window = int(getattr(layer, "sliding_window", 0) or 0)
        sinks = getattr(layer, "sinks", None) if getattr(layer, "with_sinks", False) else None
        write_cache(caches[2 * layer.layer_id], k, layout, self.block_size)
        write_cache(caches[2 * layer.layer_id + 1], v, layout, self.block_size)
        out = causal_attention(q, caches[2 * layer.layer_id], caches[2 * layer.layer_id + 1], layout,
                               self.block_size, 1.0 / float(np.sqrt(dim)), window=window, sinks=sinks)
        return out.reshape([tokens, heads * dim]).astype(paddle.get_default_dtype())


def write_cache(cache: Any, values: Any, layout: Any, block_size: int) -> None:
    """Store the step's ``values`` ``[tokens, H, D]`` at their positions in the paged cache
    ``[blocks, H, block_size, D]`` (block ``block_tables[b, p // block_size]``, offset
    ``p % block_size``), as the append-attention kernels' cache writes do."""

    for t in np.nonzero(layout.batch >= 0)[0]:
        b, p = int(layout.batch[t]), int(layout.positions[t])
        block = int(layout.block_tables[b, p // block_size])
        if block < 0:
            raise ValueError(f"attention stand-in: sequence {b} position {p} has no KV block")
        cache[block, :, p % block_size, :] = values[int(t)].astype(cache.dtype)


def read_cache(cache: Any, layout: Any, b: int, length: int, block_size: int) -> Any:
    """Sequence ``b``'s cached rows at positions ``0..length-1``: ``[length, H, D]``."""
    import paddle

    blocks = layout.block_tables[b, : (length + block_size - 1) // block_size].astype(np.int64)
    gathered = paddle.gather(cache, paddle.to_tensor(blocks))                     # [n, H, S, D]
    rows = paddle.transpose(gathered, [0, 2, 1, 3]).reshape([-1, cache.shape[1], cache.shape[3]])
    return rows[:length]


def causal_attention(q: Any, key_cache: Any, value_cache: Any, layout: Any, block_size: int, scale: float,
                     *, window: int = 0, sinks: Any = None) -> Any:
    """Each query ``[tokens, H, D]`` against its sequence's cached keys at positions
    ``max(0, p - window + 1)..p`` (``window`` 0: all); ``sinks`` ``[H]``: a per-head logit that
    joins the softmax's denominator (GPT-OSS).  Grouped-query heads share their kv head."""
    import paddle

    tokens, heads, dim = q.shape
    out = paddle.zeros([tokens, heads, value_cache.shape[-1]], dtype="float32")
    for b in sorted(set(int(x) for x in layout.batch if x >= 0)):
        mine = np.nonzero(layout.batch == b)[0]
        length = int(layout.positions[mine].max()) + 1
        keys = read_cache(key_cache, layout, b, length, block_size).astype("float32")
        values = read_cache(value_cache, layout, b, length, block_size).astype("float32")
        group = heads // keys.shape[1]
        if group > 1:
            keys = paddle.repeat_interleave(keys, group, axis=1)
            values = paddle.repeat_interleave(values, group, axis=1)
        query = paddle.transpose(q[int(mine[0]): int(mine[-1]) + 1].astype("float32"), [1, 0, 2])   # [H, n, D]
        scores = paddle.matmul(query, paddle.transpose(keys, [1, 2, 0])) * scale                   # [H, n, L]
        query_pos = layout.positions[mine].reshape(-1, 1)
        key_pos = np.arange(length).reshape(1, -1)
        allowed = key_pos <= query_pos
        if window > 0:
            allowed &= key_pos > query_pos - window
        mask = paddle.to_tensor(allowed).unsqueeze(0)
        scores = paddle.where(mask, scores, paddle.full_like(scores, float("-inf")))
        if sinks is not None:
            sink = sinks.astype("float32").reshape([heads, 1, 1]).expand([heads, len(mine), 1])
            weights = paddle.nn.functional.softmax(paddle.concat([scores, sink], axis=-1), axis=-1)[..., :length]
        else:
            weights = paddle.nn.functional.softmax(scores, axis=-1)
        out[int(mine[0]): int(mine[-1]) + 1] = paddle.transpose(
            paddle.matmul(weights, paddle.transpose(values, [1, 0, 2])), [1, 0, 2])
    return out


# ----------------------------------------------------------------------------- activations
def fused_bias_act(x: Any, bias: Any = None, dequant_scales: Any = None, shift: Any = None, smooth: Any = None,
                   act_method: str = "gelu", compute_dtype: str = "default", quant_scale: float = -1,
                   quant_round_type: int = 0, quant_max_bound: float = 0, quant_min_bound: float = 0) -> Any:
    """``paddle.incubate.nn.functional.fused_bias_act`` (a GPU-only Paddle kernel) without
    quantization: ``act(x + bias)``; ``swiglu``: SiLU of the first half times the second,
    ``geglu`` likewise with GELU."""
    CALLS["fused_bias_act"] += 1
    import paddle
    import paddle.nn.functional as F

    if dequant_scales is not None or shift is not None or smooth is not None or quant_scale != -1:
        raise NotImplementedError("fused_bias_act stand-in: no quantization")
    if bias is not None:
        x = x + bias
    if act_method in ("swiglu", "geglu"):
        first, second = paddle.split(x, 2, axis=-1)
        return (F.silu(first) if act_method == "swiglu" else F.gelu(first)) * second
    acts = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}
    if act_method not in acts:
        raise NotImplementedError(f"fused_bias_act stand-in: act_method {act_method!r}")
    return acts[act_method](x)


def qk_rmsnorm_fused(qkv_out: Any, q_norm_weight: Any, k_norm_weight: Any, eps: float, q_size: int,
                     kv_size: int, head_dim: int) -> Any:
    """FastDeploy's Triton ``qk_rmsnorm_fused`` (ops/triton_ops/qk_rmsnorm_fused_kernel.py):
    per head, RMS-normalise the q and k parts of the packed ``qkv`` (float32) times their
    weights, v unchanged; returns the new ``qkv`` (the kernel writes it in place)."""
    CALLS["qk_rmsnorm_fused"] += 1
    import paddle

    q, k, v = qkv_out.split([q_size, kv_size, kv_size], axis=-1)
    tokens = qkv_out.shape[0]
    q = head_rms_norm(q.reshape([tokens, -1, head_dim]), q_norm_weight, eps).reshape([tokens, q_size])
    k = head_rms_norm(k.reshape([tokens, -1, head_dim]), k_norm_weight, eps).reshape([tokens, kv_size])
    out = paddle.concat([q.astype(qkv_out.dtype), k.astype(qkv_out.dtype), v], axis=-1)
    qkv_out.copy_(out, False)
    return qkv_out


# ----------------------------------------------------------------------------- MoE selection
def moe_expert_dispatch(input: Any, gating_output: Any, gating_correction_bias: Any = None,
                        w4a8_in_scale: Any = None, moe_topk: int = 1, group_moe: bool = False,
                        moe_quant_type: str = "w16a16", topk_only_mode: bool = False) -> list:
    """``moe_expert_dispatch`` (moe/moe_dispatch.cu): ``tests/fdcpu``'s stand-in, plus the
    ``topk_only_mode`` the noaux_tc models call it with (fused_moe_cutlass_backend.py:413-450):
    the top-k of ``gating_output`` as given -- noaux_tc's sparse scores, no softmax -- and
    those values as the weights; the expert-sorted copy of the tokens as the stand-in does."""
    from tests.fdcpu import moe_ops

    CALLS["moe_expert_dispatch" + (":topk_only" if topk_only_mode else "")] += 1
    if not topk_only_mode:
        return moe_ops.moe_expert_dispatch(input, gating_output, gating_correction_bias, w4a8_in_scale,
                                           moe_topk, group_moe, moe_quant_type, topk_only_mode)
    import paddle

    gates = read(gating_output).astype(np.float32)
    ids = np.argsort(-gates, axis=1, kind="stable")[:, :moe_topk].astype(np.int32)
    weights = np.take_along_axis(gates, ids, axis=1)
    # the permutation is the stand-in's, on these ids: dispatch it with one-hot gates
    one_hot = np.full_like(gates, -1e4)
    np.put_along_axis(one_hot, ids, np.arange(moe_topk, 0, -1, dtype=np.float32)[None, :] * 10.0, axis=1)
    outputs = moe_ops.moe_expert_dispatch(input, paddle.to_tensor(one_hot), None, w4a8_in_scale, moe_topk,
                                          group_moe, moe_quant_type, False)
    if not np.array_equal(outputs[4].numpy(), ids):
        raise AssertionError("moe_expert_dispatch stand-in: topk_only_mode ids not reproduced")
    outputs[3] = paddle.to_tensor(weights.astype(np.float32))
    return outputs


def noaux_tc(scores: Any, scores_with_bias: Any, n_group: int, topk_group: int, topk: int,
             renormalize: bool, routed_scaling_factor: float) -> list:
    """``noaux_tc`` (noaux_tc.cu / noauxtc_kernel.h), DeepSeek-V3's grouped selection: a
    group's score is the sum of its two best biased scores; the ``topk_group`` best groups
    are kept; the ``topk`` best biased scores among their experts are chosen (ties: the
    lower id); the weights are the unbiased scores there, over their sum (+1e-20) when
    ``renormalize``, times ``routed_scaling_factor``.  Returns ``[scores, topk_values,
    topk_indices]``, ``scores`` zero except at the chosen experts, where it holds the weights."""
    CALLS["noaux_tc"] += 1
    import paddle

    unbiased = read(scores).astype(np.float32)
    biased = read(scores_with_bias).astype(np.float32)
    tokens, experts = biased.shape
    per_group = experts // n_group
    grouped = biased.reshape(tokens, n_group, per_group)
    group_scores = np.sort(grouped, axis=2)[:, :, -2:].sum(axis=2) if per_group > 1 else grouped[:, :, 0]
    groups = np.argsort(-group_scores, axis=1, kind="stable")[:, :topk_group]
    allowed = np.zeros((tokens, n_group), bool)
    np.put_along_axis(allowed, groups, True, axis=1)
    masked = np.where(np.repeat(allowed, per_group, axis=1), biased, -np.inf)
    ids = np.argsort(-masked, axis=1, kind="stable")[:, :topk]
    values = np.take_along_axis(unbiased, ids, axis=1)
    if renormalize:
        values = values / (values.sum(axis=1, keepdims=True) + 1e-20)
    values = (values * routed_scaling_factor).astype(np.float32)
    sparse = np.zeros_like(unbiased)
    np.put_along_axis(sparse, ids, values, axis=1)
    return [paddle.to_tensor(sparse), paddle.to_tensor(values), paddle.to_tensor(ids.astype(np.int64))]


def install_model_stand_ins() -> None:
    """Put this module's stand-ins where FastDeploy's model code looks them up (module
    globals bound at import, after ``tests.fdcpu.install``)."""
    import importlib

    activation = importlib.import_module("fastdeploy.model_executor.layers.activation")
    activation.fused_bias_act = fused_bias_act
    normalization = importlib.import_module("fastdeploy.model_executor.layers.normalization")
    normalization.qk_rmsnorm_fused = qk_rmsnorm_fused
    cutlass = importlib.import_module("fastdeploy.model_executor.layers.moe.fused_moe_cutlass_backend")
    cutlass.moe_expert_dispatch = moe_expert_dispatch
    moe = importlib.import_module("fastdeploy.model_executor.layers.moe.moe")
    moe.noaux_tc = noaux_tc
    gpu = importlib.import_module("fastdeploy.model_executor.ops.gpu")
    gpu.moe_expert_dispatch = moe_expert_dispatch
    gpu.noaux_tc = noaux_tc
    gpu.fused_rotary_position_encoding = fused_rotary_position_encoding
    rotary = importlib.import_module("fastdeploy.model_executor.layers.rotary_embedding")
    rotary.fused_rotary_position_encoding = fused_rotary_position_encoding
    gpu.text_image_index_out = text_image_index_out
    gpu.text_image_gather_scatter = text_image_gather_scatter
    vl = importlib.import_module("fastdeploy.model_executor.models.ernie4_5_vl.ernie4_5_vl_moe")
    vl.text_image_index_out, vl.text_image_gather_scatter = text_image_index_out, text_image_gather_scatter


def record_selections(selections: Any) -> None:
    """Keep the top-k each MoE selection returns (what the model computed) in ``selections``."""
    import importlib

    cutlass = importlib.import_module("fastdeploy.model_executor.layers.moe.fused_moe_cutlass_backend")
    selections.wrap(cutlass, "moe_expert_dispatch", 4)


def fused_rotary_position_encoding(query: Any, key: Any, position_ids: Any, cos_sin_cache: Any, head_size: int,
                                   is_neox: bool) -> None:
    """``fused_rotary_position_encoding`` (fused_rotary_position_encoding.cu), in place: for
    token ``t`` at position ``p``, ``cos, sin = cache[p, :rot/2], cache[p, rot/2:]`` rotate
    each head's first ``rot_dim`` values of ``query`` / ``key`` (heads of ``head_size``):
    the halves (``is_neox``) or the pairs ``(2i, 2i + 1)``."""
    CALLS["fused_rotary_position_encoding"] += 1
    import paddle

    positions = read(position_ids).reshape(-1).astype(np.int64)
    cache = read(cos_sin_cache).astype(np.float32)
    rot = cache.shape[1]
    cos, sin = cache[positions, : rot // 2], cache[positions, rot // 2:]
    for tensor in (query, key):
        values = read(tensor).astype(np.float32)
        shape = values.shape
        heads = values.reshape(shape[0], -1, head_size)
        part = heads[:, :, :rot]
        if is_neox:
            x, y = part[..., : rot // 2], part[..., rot // 2:]
            c, s = cos[:, None, :], sin[:, None, :]
            part = np.concatenate([x * c - y * s, y * c + x * s], axis=-1)
        else:
            x, y = part[..., 0::2], part[..., 1::2]
            c, s = cos[:, None, :], sin[:, None, :]
            part = np.stack([x * c - y * s, y * c + x * s], axis=-1).reshape(part.shape)
        heads = np.concatenate([part, heads[:, :, rot:]], axis=-1)
        tensor.copy_(paddle.to_tensor(heads.reshape(shape)).astype(tensor.dtype), False)


class MLAAttentionBackend:
    """DeepSeek-V3's multi-head latent attention on the CPU (FastDeploy's
    ``MLAAttentionBackend``: prefill_mla_write_cache / decode_mla_write_cache and
    multi_head_latent_attention, layers/attention/mla_attention_backend.py).

    Every call stores the step's latent rows ``[compressed_kv, k_pe]`` per layer and
    position.  Prefill (``k`` given): ordinary causal attention of ``q`` over the step's own
    keys and values (``[tokens, H, qk_head_dim]``; prefill steps here start at position 0).
    Decode (``k`` None; ``q`` absorbed, ``[tokens, H * (kv_lora + rope)]``): each query
    attends over the sequence's cached latent rows, output ``[tokens, H * kv_lora]`` (the
    model's ``kv_b_proj_bmm`` turns it into values).  Softmax scale ``qk_head_dim ** -0.5``.
    """

    def __init__(self, fd_config: Any, block_size: int) -> None:
        mc = fd_config.model_config
        self.kv_lora, self.rope = int(mc.kv_lora_rank), int(mc.qk_rope_head_dim)
        self.scale = float(int(mc.qk_nope_head_dim) + self.rope) ** -0.5
        self.latent: dict[tuple[int, int, int], np.ndarray] = {}

    def init_attention_metadata(self, forward_meta: Any) -> None:
        return None

    def forward(self, q: Any, k: Any, v: Any, qkv: Any, compressed_kv: Any, k_pe: Any, layer: Any,
                forward_meta: Any) -> Any:
        import paddle

        from tests.fdcpu.attention import step_layout

        tokens = int(compressed_kv.shape[0])
        layout = step_layout(forward_meta, tokens)
        latent = np.concatenate([read(compressed_kv).reshape(tokens, -1),
                                 read(k_pe).reshape(tokens, -1)], axis=1).astype(np.float32)
        for t in np.nonzero(layout.batch >= 0)[0]:
            self.latent[(layer.layer_id, int(layout.batch[t]), int(layout.positions[t]))] = latent[t]
        CALLS["mla:" + ("prefill" if k is not None else "decode")] += 1
        if k is not None:                                   # prefill
            if (layout.positions[layout.batch >= 0] != np.arange(tokens)[layout.batch >= 0]).any():
                raise NotImplementedError("MLA stand-in: a prefill step starts at position 0")
            query = paddle.transpose(q.astype("float32"), [1, 0, 2])
            keys = paddle.transpose(k.astype("float32"), [1, 0, 2])
            values = paddle.transpose(v.astype("float32"), [1, 0, 2])
            scores = paddle.matmul(query, keys, transpose_y=True) * self.scale
            mask = paddle.to_tensor(np.tril(np.ones((tokens, tokens), bool))).unsqueeze(0)
            scores = paddle.where(mask, scores, paddle.full_like(scores, float("-inf")))
            out = paddle.matmul(paddle.nn.functional.softmax(scores, axis=-1), values)
            return paddle.transpose(out, [1, 0, 2]).reshape([tokens, -1]).astype(q.dtype)
        width = self.kv_lora + self.rope
        query = read(q).astype(np.float32).reshape(tokens, -1, width)
        out = np.zeros((tokens, query.shape[1], self.kv_lora), np.float32)
        for t in np.nonzero(layout.batch >= 0)[0]:
            b, p = int(layout.batch[t]), int(layout.positions[t])
            cache = np.stack([self.latent[(layer.layer_id, b, i)] for i in range(p + 1)])   # [L, width]
            scores = query[t] @ cache.T * self.scale                                          # [H, L]
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            weights /= weights.sum(axis=1, keepdims=True)
            out[t] = weights @ cache[:, : self.kv_lora]
        return paddle.to_tensor(out.reshape(tokens, -1)).astype(q.dtype)


# ----------------------------------------------------------------------------- ERNIE-4.5-VL
def text_image_index_out(token_type_ids: Any, text_index: Any, image_index: Any) -> None:
    """``text_image_index_out`` (text_image_index_out.cu), in place: for each token, its
    index among the text tokens (type 0) or among the image tokens; entries of the other
    type are left as they were."""
    CALLS["text_image_index_out"] += 1
    import paddle

    types = read(token_type_ids).reshape(-1)
    text, image = read(text_index).reshape(-1), read(image_index).reshape(-1)
    text[: len(types)][types == 0] = np.arange(int((types == 0).sum()))
    image[: len(types)][types != 0] = np.arange(int((types != 0).sum()))
    text_index.copy_(paddle.to_tensor(text.astype(np.int32)), False)
    image_index.copy_(paddle.to_tensor(image.astype(np.int32)), False)


def text_image_gather_scatter(input: Any, text_input: Any, image_input: Any, token_type_ids: Any,
                              text_index: Any, image_index: Any, is_scatter: bool) -> list:
    """``text_image_gather_scatter`` (text_image_gather_scatter.cu), in place: scatter copies
    token ``t`` into row ``text_index[t]`` of ``text_input`` (type 0) or ``image_index[t]`` of
    ``image_input`` (type 1); gather copies them back into ``input``; other types (CUDA graph
    padding, -1) are skipped."""
    CALLS["text_image_gather_scatter"] += 1
    import paddle

    types = read(token_type_ids).reshape(-1)
    hidden, text, image = read(input), read(text_input), read(image_input)
    t_at, i_at = read(text_index).reshape(-1), read(image_index).reshape(-1)
    for t in range(hidden.shape[0]):
        if types[t] == 0:
            if is_scatter:
                text[t_at[t]] = hidden[t]
            else:
                hidden[t] = text[t_at[t]]
        elif types[t] == 1:
            if is_scatter:
                image[i_at[t]] = hidden[t]
            else:
                hidden[t] = image[i_at[t]]
    for tensor, values in ((input, hidden), (text_input, text), (image_input, image)):
        if values.size:
            tensor.copy_(paddle.to_tensor(values).astype(tensor.dtype), False)
    return [input, text_input, image_input]
