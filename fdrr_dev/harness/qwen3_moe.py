"""A tiny Qwen3-MoE in Paddle for the harness engine, with bf16 or fp32 activations.

Why it exists: the R3 effect (:mod:`.r3_effect`) has to be measured on a real
architecture, recomputed on the trainer side by Hugging Face ``transformers`` from the
same weights.  This is Qwen3-MoE's decoder as ``transformers.Qwen3MoeForCausalLM`` (5.24)
computes it: RMSNorm, grouped-query attention with per-head ``q_norm``/``k_norm`` before
rotary embeddings (``rope_theta``), a softmax top-k router (``norm_topk_prob``) over SwiGLU
experts without a shared expert, dense SwiGLU layers where ``mlp_only_layers`` says, and an
untied ``lm_head``.  Weights come from a seeded NumPy generator, rounded once to bfloat16
values (so a bf16 engine and an fp32 trainer hold *the same* weights), and are kept under
their Hugging Face checkpoint names (:mod:`.hf_checkpoint` writes them to safetensors).

The engine's entry point is :meth:`TinyQwen3Moe.forward_step`, the interface
:class:`~fdrr_dev.harness.model.TinyMoEModel` offers the runner: ragged tokens,
a paged KV cache addressed by slot, and the top-k hook after every router.  With
``activation_dtype="bfloat16"`` every activation an engine would hold in bf16 (each
projection's output, the attention output, norms, residual sums, router and vocabulary
logits, the KV cache) is rounded to bfloat16 (round to nearest even) and computed on in
fp32 — a faithful emulation of bf16 storage with fp32 accumulation, since Paddle's CPU
build lacks some bf16 kernels.  Softmaxes run in fp32, as in the engines.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from fdrr_dev.harness.paddle_runtime import paddle

__all__ = ["ACTIVATION_DTYPES", "Qwen3MoeForward", "TinyQwen3Config", "TinyQwen3Moe",
           "round_to_bf16"]

ACTIVATION_DTYPES = ("float32", "bfloat16")
RouterObserver = Callable[[int, Any, Any], None]


def round_to_bf16(values: np.ndarray) -> np.ndarray:
    """``values`` rounded to the nearest bfloat16 (ties to even), as float32."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) \
        & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


@dataclass(frozen=True)
class TinyQwen3Config:
    """Shape, seed and activation precision of the tiny Qwen3-MoE (field names follow the
    harness; :mod:`.hf_checkpoint` maps them to ``Qwen3MoeConfig``'s)."""

    vocab_size: int = 96
    hidden_size: int = 64
    num_layers: int = 12
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128          # the dense layers of mlp_only_layers
    moe_intermediate_size: int = 32
    num_experts: int = 128                # Qwen3-30B-A3B's experts and top-k
    top_k: int = 8
    norm_topk_prob: bool = True
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_model_len: int = 512
    eos_token_id: int = 0
    seed: int = 1234
    activation_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.activation_dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"activation_dtype must be one of {ACTIVATION_DTYPES}, "
                             f"got {self.activation_dtype!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary embeddings)")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        bad = [layer for layer in self.mlp_only_layers if not 0 <= layer < self.num_layers]
        if bad or not self.moe_layers:
            raise ValueError(f"mlp_only_layers={list(self.mlp_only_layers)} must name layers in "
                             f"[0, {self.num_layers}) and leave at least one MoE layer")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The decoder layers with a router (all but ``mlp_only_layers``)."""
        return tuple(i for i in range(self.num_layers) if i not in self.mlp_only_layers)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def num_shared_experts(self) -> int:
        """Qwen3-MoE has no shared expert (the capture geometry asks)."""
        return 0


@dataclass
class Qwen3MoeForward:
    """A teacher-forced forward of one sequence: what the trainer-side checks compare."""

    logits: np.ndarray         # [S, vocab]
    gate_logits: np.ndarray    # [L_moe, S, E] router logits
    topk_ids: np.ndarray       # [L_moe, S, K] the router's top-k, by descending probability


def _rms_norm(x: Any, weight: Any, eps: float) -> Any:
    variance = (x * x).mean(axis=-1, keepdim=True)
    return x * paddle.rsqrt(variance + eps) * weight


def _rotate_half(x: Any) -> Any:
    half = x.shape[-1] // 2
    return paddle.concat([-x[..., half:], x[..., :half]], axis=-1)


class TinyQwen3Moe:
    """Seeded weights (by Hugging Face name) plus the engine forward; stateless otherwise."""

    def __init__(self, config: TinyQwen3Config | None = None, *, weights_version: int = 0) -> None:
        self.config = config or TinyQwen3Config()
        self.weights_version = weights_version
        self.state_dict = self._seeded_weights()
        cfg = self.config
        if cfg.activation_dtype == "bfloat16":
            self._round: Callable[[Any], Any] = \
                lambda x: x.astype("bfloat16").astype("float32")
        else:
            self._round = lambda x: x
        # the engine's layout: [in, out] matrices, each MoE layer's experts stacked
        self._params = {name: paddle.to_tensor(np.ascontiguousarray(
            value.T if value.ndim == 2 and not name.endswith("embed_tokens.weight") else value))
            for name, value in self.state_dict.items() if ".mlp.experts." not in name}
        for layer in cfg.moe_layers:
            prefix = f"model.layers.{layer}.mlp.experts."
            for part in ("gate_proj", "up_proj", "down_proj"):
                self._params[f"{prefix}{part}"] = paddle.to_tensor(np.stack(
                    [self.state_dict[f"{prefix}{e}.{part}.weight"].T
                     for e in range(cfg.num_experts)]))
        # inverse frequencies as transformers' default rope computes them (float32)
        self._inv_freq = (1.0 / (np.float32(cfg.rope_theta) ** (
            np.arange(0, cfg.head_dim, 2, dtype=np.float32) / np.float32(cfg.head_dim))))\
            .astype(np.float32)

    # ------------------------------------------------------------------ weights
    def _seeded_weights(self) -> dict[str, np.ndarray]:
        """Every tensor under its Hugging Face checkpoint name (``nn.Linear`` layout
        ``[out, in]``; experts one by one, as Qwen3-MoE checkpoints store them)."""
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, self.weights_version])
        h, d = cfg.hidden_size, cfg.head_dim

        def normal(*shape: int, scale: float) -> np.ndarray:
            return round_to_bf16(rng.standard_normal(shape).astype(np.float32) * scale)

        def norm_weight(size: int) -> np.ndarray:
            return round_to_bf16(1.0 + 0.1 * rng.standard_normal(size).astype(np.float32))

        state = {"model.embed_tokens.weight": normal(cfg.vocab_size, h, scale=1.0)}
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            state[p + "input_layernorm.weight"] = norm_weight(h)
            state[p + "post_attention_layernorm.weight"] = norm_weight(h)
            state[p + "self_attn.q_proj.weight"] = normal(cfg.num_attention_heads * d, h,
                                                          scale=1 / math.sqrt(h))
            state[p + "self_attn.k_proj.weight"] = normal(cfg.num_key_value_heads * d, h,
                                                          scale=1 / math.sqrt(h))
            state[p + "self_attn.v_proj.weight"] = normal(cfg.num_key_value_heads * d, h,
                                                          scale=1 / math.sqrt(h))
            state[p + "self_attn.o_proj.weight"] = normal(h, cfg.num_attention_heads * d,
                                                          scale=0.5 / math.sqrt(h))
            state[p + "self_attn.q_norm.weight"] = norm_weight(d)
            state[p + "self_attn.k_norm.weight"] = norm_weight(d)
            if i in cfg.moe_layers:
                inter = cfg.moe_intermediate_size
                # router logits spread ~1.5: close calls between the k-th and (k+1)-th
                # expert happen, as in trained models, without being the rule
                state[p + "mlp.gate.weight"] = normal(cfg.num_experts, h, scale=1.5 / math.sqrt(h))
                for e in range(cfg.num_experts):
                    q = f"{p}mlp.experts.{e}."
                    state[q + "gate_proj.weight"] = normal(inter, h, scale=1 / math.sqrt(h))
                    state[q + "up_proj.weight"] = normal(inter, h, scale=1 / math.sqrt(h))
                    state[q + "down_proj.weight"] = normal(h, inter, scale=0.5 / math.sqrt(inter))
            else:
                inter = cfg.intermediate_size
                state[p + "mlp.gate_proj.weight"] = normal(inter, h, scale=1 / math.sqrt(h))
                state[p + "mlp.up_proj.weight"] = normal(inter, h, scale=1 / math.sqrt(h))
                state[p + "mlp.down_proj.weight"] = normal(h, inter, scale=0.5 / math.sqrt(inter))
        state["model.norm.weight"] = norm_weight(h)
        state["lm_head.weight"] = normal(cfg.vocab_size, h, scale=2.0 / math.sqrt(h))
        return state

    # ------------------------------------------------------------------ blocks
    def _linear(self, x: Any, name: str) -> Any:
        return self._round(paddle.matmul(x, self._params[name]))

    def _swiglu(self, x: Any, prefix: str) -> Any:
        gate = self._linear(x, prefix + "gate_proj.weight")
        up = self._linear(x, prefix + "up_proj.weight")
        hidden = self._round(paddle.nn.functional.silu(gate) * up)
        return self._linear(hidden, prefix + "down_proj.weight")

    def _moe(self, layer: int, x: Any) -> tuple[Any, Any, Any]:
        """The sparse MoE block on ``x [T, H]``: (output, router logits, top-k ids)."""
        cfg, params = self.config, self._params
        logits = self._linear(x, f"model.layers.{layer}.mlp.gate.weight")           # [T, E]
        probs = paddle.nn.functional.softmax(logits, axis=-1)
        top_vals, top_ids = paddle.topk(probs, cfg.top_k, axis=-1)
        if cfg.norm_topk_prob:
            top_vals = top_vals / top_vals.sum(axis=-1, keepdim=True)
        dense = paddle.put_along_axis(paddle.zeros_like(probs), top_ids, top_vals, axis=-1)
        # every expert on every token: cheap at this size; unchosen ones weigh exactly 0
        experts = f"model.layers.{layer}.mlp.experts."
        gate = self._round(paddle.einsum("th,ehi->tei", x, params[experts + "gate_proj"]))
        up = self._round(paddle.einsum("th,ehi->tei", x, params[experts + "up_proj"]))
        hidden = self._round(paddle.nn.functional.silu(gate) * up)
        out = self._round(paddle.einsum("tei,eih->teh", hidden, params[experts + "down_proj"]))
        return self._round((out * dense.unsqueeze(-1)).sum(axis=1)), logits, top_ids

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:
        """``x [T, heads, D]`` rotated by the positions' ``cos``/``sin`` ``[T, 1, D]``."""
        return self._round(x * cos + _rotate_half(x) * sin)

    def _rope_tables(self, positions: np.ndarray) -> tuple[Any, Any]:
        freqs = np.asarray(positions, dtype=np.float32)[:, None] * self._inv_freq[None, :]
        emb = np.concatenate([freqs, freqs], axis=-1)
        return (paddle.to_tensor(np.cos(emb)[:, None, :].astype(np.float32)),
                paddle.to_tensor(np.sin(emb)[:, None, :].astype(np.float32)))

    # ------------------------------------------------------------------ engine forward
    def new_kv_cache(self, num_slots: int) -> list[tuple[Any, Any]]:
        """One (key, value) pair of ``[num_slots, kv_heads, head_dim]`` tensors per layer."""
        cfg = self.config
        shape = [num_slots, cfg.num_key_value_heads, cfg.head_dim]
        return [(paddle.zeros(shape, dtype="float32"), paddle.zeros(shape, dtype="float32"))
                for _ in range(cfg.num_layers)]

    def forward_step(self, token_ids: np.ndarray, positions: np.ndarray, token_slots: np.ndarray,
                     context_slots: np.ndarray, context_mask: np.ndarray,
                     kv_cache: list[tuple[Any, Any]], topk_hook: Callable[..., None] | None = None,
                     *, on_router: RouterObserver | None = None) -> Any:
        """One engine step over ragged tokens with a paged KV cache (the contract of
        :meth:`~fdrr_dev.harness.model.TinyMoEModel.forward_step`): token ``t``
        writes its key and value to slot ``token_slots[t]`` and attends to
        ``context_slots[t]`` where ``context_mask`` is True.  ``topk_hook(layer_idx=,
        topk_ids=)`` runs after every router with the MoE layer's row index;
        ``on_router(row, logits, ids)`` sees the router logits too.  Returns the logits
        ``[T, vocab]`` (a Paddle tensor)."""
        cfg, params = self.config, self._params
        num_tokens, width = len(token_ids), context_slots.shape[1]
        x = self._round(paddle.gather(params["model.embed_tokens.weight"],
                                      paddle.to_tensor(np.asarray(token_ids, dtype=np.int64))))
        cos, sin = self._rope_tables(positions)
        slots = paddle.to_tensor(np.asarray(token_slots, dtype=np.int64))
        context = paddle.to_tensor(np.asarray(context_slots, dtype=np.int64).reshape(-1))
        visible = paddle.to_tensor(np.asarray(context_mask, dtype=bool)).unsqueeze(1)  # [T, 1, C]
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        kv_shape = [num_tokens, width, cfg.num_key_value_heads, cfg.head_dim]
        for layer in range(cfg.num_layers):
            p = f"model.layers.{layer}."
            h = self._round(_rms_norm(x, params[p + "input_layernorm.weight"], cfg.rms_norm_eps))
            q = self._linear(h, p + "self_attn.q_proj.weight").reshape([num_tokens, -1, cfg.head_dim])
            k = self._linear(h, p + "self_attn.k_proj.weight").reshape([num_tokens, -1, cfg.head_dim])
            v = self._linear(h, p + "self_attn.v_proj.weight").reshape([num_tokens, -1, cfg.head_dim])
            q = self._rope(self._round(_rms_norm(q, params[p + "self_attn.q_norm.weight"],
                                                 cfg.rms_norm_eps)), cos, sin)
            k = self._rope(self._round(_rms_norm(k, params[p + "self_attn.k_norm.weight"],
                                                 cfg.rms_norm_eps)), cos, sin)
            key_cache, value_cache = kv_cache[layer]
            paddle.scatter_(key_cache, slots, k, overwrite=True)
            paddle.scatter_(value_cache, slots, v, overwrite=True)
            keys = paddle.repeat_interleave(paddle.gather(key_cache, context).reshape(kv_shape),
                                            groups, axis=2)
            values = paddle.repeat_interleave(paddle.gather(value_cache, context).reshape(kv_shape),
                                              groups, axis=2)
            scores = paddle.einsum("thd,tchd->thc", q, keys) * (cfg.head_dim ** -0.5)
            scores = paddle.where(visible, scores, paddle.full_like(scores, -1e30))
            attn = paddle.nn.functional.softmax(scores, axis=-1)
            out = self._round(paddle.einsum("thc,tchd->thd", attn, values))
            x = self._round(x + self._linear(out.reshape([num_tokens, -1]), p + "self_attn.o_proj.weight"))
            h = self._round(_rms_norm(x, params[p + "post_attention_layernorm.weight"],
                                      cfg.rms_norm_eps))
            if layer in cfg.moe_layers:
                mlp, logits, top_ids = self._moe(layer, h)
                row = cfg.moe_layers.index(layer)
                if topk_hook is not None:
                    topk_hook(layer_idx=row, topk_ids=top_ids)
                if on_router is not None:
                    on_router(row, logits, top_ids)
            else:
                mlp = self._swiglu(h, p + "mlp.")
            x = self._round(x + mlp)
        h = self._round(_rms_norm(x, params["model.norm.weight"], cfg.rms_norm_eps))
        return self._linear(h, "lm_head.weight")

    # ------------------------------------------------------------------ one sequence
    def forward_full(self, token_ids: np.ndarray) -> Qwen3MoeForward:
        """Teacher-forced forward of one sequence through :meth:`forward_step` itself (a
        fresh cache, slot = position, causal mask): the engine path, for the checks."""
        seq_len = len(token_ids)
        if not 0 < seq_len <= self.config.max_model_len:
            raise ValueError(f"sequence of {seq_len} tokens: need 1..max_model_len="
                             f"{self.config.max_model_len}")
        positions = np.arange(seq_len, dtype=np.int64)
        gate_logits: dict[int, np.ndarray] = {}
        topk_ids: dict[int, np.ndarray] = {}

        def observe(row: int, logits: Any, ids: Any) -> None:
            gate_logits[row], topk_ids[row] = logits.numpy(), ids.numpy()

        logits = self.forward_step(
            np.asarray(token_ids, dtype=np.int64), positions, positions,
            np.broadcast_to(positions, (seq_len, seq_len)),
            positions[None, :] <= positions[:, None], self.new_kv_cache(seq_len),
            on_router=observe)
        rows = range(self.config.num_moe_layers)
        return Qwen3MoeForward(logits=logits.numpy(),
                               gate_logits=np.stack([gate_logits[r] for r in rows]),
                               topk_ids=np.stack([topk_ids[r] for r in rows]))
