"""A tiny, deterministic Mixture-of-Experts transformer in Paddle (CPU).

Why it exists: to prove on a real forward pass that what capture records is what the
model routed.  The model has the shape of the models FastDeploy serves — the first layer
dense, the rest MoE with softmax top-k gating over real hidden states plus a shared
expert — but is small enough that a whole multi-turn rollout batch runs in seconds on
two CPU cores.  Weights come from a seeded NumPy generator: nothing is downloaded.

Two entry points share every weight and every layer function:

* :meth:`TinyMoEModel.forward_step` — the engine's forward: ragged tokens of many
  sequences, a paged KV cache addressed through a block table, and a hook called right
  after top-k in every MoE layer (FastDeploy's ``topk_ids_hookfunc``).
* :meth:`TinyMoEModel.forward_full` — the trainer's forward: one sequence, teacher
  forced, full causal attention without any KV cache; optionally *replaying* given
  routing (R3) while still reporting what its own gate would have picked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fdrr_dev.harness.paddle_runtime import paddle

TopkHook = Callable[..., None]


@dataclass(frozen=True)
class TinyMoEConfig:
    """Shape and seed of the tiny model; the defaults run fast on two CPU cores."""

    vocab_size: int = 96
    hidden_size: int = 32
    num_heads: int = 2
    num_layers: int = 4            # layer 0 dense, layers 1.. MoE
    moe_layer_start_index: int = 1
    num_experts: int = 16
    num_shared_experts: int = 1
    top_k: int = 4
    expert_intermediate_size: int = 16
    dense_intermediate_size: int = 64
    max_model_len: int = 512
    eos_token_id: int = 0
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")
        if not 0 < self.moe_layer_start_index < self.num_layers:
            raise ValueError(
                f"moe_layer_start_index={self.moe_layer_start_index} must be in "
                f"[1, num_layers={self.num_layers}): the first layer is dense")
        if not 0 < self.top_k < self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts})")

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.moe_layer_start_index

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass
class FullForward:
    """What the teacher-forced forward reports for one sequence."""

    logits: np.ndarray         # [S, vocab] next-token logits
    gate_logits: np.ndarray    # [L_moe, S, E] router logits (pre-softmax)
    topk_ids: np.ndarray       # [L_moe, S, K] the router's own top-k (sorted by score)


def _rms_norm(x, weight, eps: float = 1e-6):
    variance = (x * x).mean(axis=-1, keepdim=True)
    return x * paddle.rsqrt(variance + eps) * weight


class TinyMoEModel:
    """Weights plus the two forwards; stateless apart from the weights."""

    def __init__(self, config: TinyMoEConfig | None = None, *, weights_version: int = 0) -> None:
        self.config = config or TinyMoEConfig()
        self.weights_version = weights_version
        self._build_weights()

    # ------------------------------------------------------------------ weights
    def _build_weights(self) -> None:
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, self.weights_version])

        def tensor(*shape: int, scale: float) -> object:
            return paddle.to_tensor(rng.standard_normal(shape).astype(np.float32) * scale)

        h, inter = cfg.hidden_size, cfg.dense_intermediate_size
        self.embedding = tensor(cfg.vocab_size, h, scale=1.0)
        self.position_embedding = tensor(cfg.max_model_len, h, scale=0.3)
        self.lm_head = tensor(h, cfg.vocab_size, scale=2.0 / math.sqrt(h))
        self.final_norm = paddle.ones([h], dtype="float32")
        self.layers: list[dict[str, object]] = []
        for index in range(cfg.num_layers):
            layer: dict[str, object] = {
                "attn_norm": paddle.ones([h], dtype="float32"),
                "ffn_norm": paddle.ones([h], dtype="float32"),
                "wqkv": tensor(h, 3 * h, scale=1.0 / math.sqrt(h)),
                "wo": tensor(h, h, scale=0.5 / math.sqrt(h)),
            }
            if index < cfg.moe_layer_start_index:
                layer["w_up"] = tensor(h, 2 * inter, scale=1.0 / math.sqrt(h))
                layer["w_down"] = tensor(inter, h, scale=0.5 / math.sqrt(inter))
            else:
                e, ei = cfg.num_experts, cfg.expert_intermediate_size
                shared = cfg.num_shared_experts * ei
                # gate scale chosen so router logits have a spread of ~1.5: near-ties
                # (k-th vs k+1-th within 1e-3) stay rare but do occur.
                layer["gate"] = tensor(h, e, scale=1.5 / math.sqrt(h))
                layer["experts_up"] = tensor(e, h, 2 * ei, scale=1.0 / math.sqrt(h))
                layer["experts_down"] = tensor(e, ei, h, scale=0.5 / math.sqrt(ei))
                layer["shared_up"] = tensor(h, 2 * shared, scale=1.0 / math.sqrt(h))
                layer["shared_down"] = tensor(shared, h, scale=0.5 / math.sqrt(shared))
            self.layers.append(layer)

    # ------------------------------------------------------------------ blocks
    @staticmethod
    def _swiglu(x, w_up, w_down):
        gate_up = paddle.matmul(x, w_up)
        gate, up = paddle.split(gate_up, 2, axis=-1)
        return paddle.matmul(paddle.nn.functional.silu(gate) * up, w_down)

    def _moe(self, layer: dict[str, object], x, replay_ids=None):
        """MoE FFN for ``x`` [T, H]: returns (output, gate logits, top-k ids used)."""
        cfg = self.config
        gate_logits = paddle.matmul(x, layer["gate"])                      # [T, E]
        probs = paddle.nn.functional.softmax(gate_logits, axis=-1)
        top_vals, top_ids = paddle.topk(probs, cfg.top_k, axis=-1)         # [T, K]
        if replay_ids is not None:
            route_ids = replay_ids
            route_vals = paddle.take_along_axis(probs, replay_ids, axis=-1)
        else:
            route_ids, route_vals = top_ids, top_vals
        weights = route_vals / route_vals.sum(axis=-1, keepdim=True)
        dense_weights = paddle.zeros_like(probs)
        dense_weights = paddle.put_along_axis(dense_weights, route_ids, weights, axis=-1)
        # Every expert on every token is cheap at these sizes and keeps the math exact.
        up = paddle.einsum("th,ehi->tei", x, layer["experts_up"])          # [T, E, 2I]
        gate, lin = paddle.split(up, 2, axis=-1)
        expert_out = paddle.einsum(
            "tei,eih->teh", paddle.nn.functional.silu(gate) * lin, layer["experts_down"])
        routed = (expert_out * dense_weights.unsqueeze(-1)).sum(axis=1)
        shared = self._swiglu(x, layer["shared_up"], layer["shared_down"])
        return routed + shared, gate_logits, top_ids

    def _qkv(self, layer: dict[str, object], x):
        cfg = self.config
        qkv = paddle.matmul(_rms_norm(x, layer["attn_norm"]), layer["wqkv"])
        q, k, v = paddle.split(qkv, 3, axis=-1)
        shape = [-1, cfg.num_heads, cfg.head_dim]
        return q.reshape(shape), k.reshape(shape), v.reshape(shape)

    @staticmethod
    def _attend(q, keys, values, mask):
        """q [T, H, D]; keys/values [T, C, H, D]; mask [T, C] bool (True = visible)."""
        scale = 1.0 / math.sqrt(q.shape[-1])
        scores = paddle.einsum("thd,tchd->thc", q, keys) * scale
        neg = paddle.full_like(scores, -1e30)
        scores = paddle.where(mask.unsqueeze(1), scores, neg)
        attn = paddle.nn.functional.softmax(scores, axis=-1)
        return paddle.einsum("thc,tchd->thd", attn, values)

    def _ffn(self, index: int, layer: dict[str, object], x, replay_ids=None):
        h = _rms_norm(x, layer["ffn_norm"])
        if index < self.config.moe_layer_start_index:
            return self._swiglu(h, layer["w_up"], layer["w_down"]), None, None
        return self._moe(layer, h, replay_ids)

    # ------------------------------------------------------------------ engine forward
    def new_kv_cache(self, num_slots: int) -> list[tuple[object, object]]:
        """One (key, value) pair of ``[num_slots, heads, head_dim]`` tensors per layer."""
        cfg = self.config
        shape = [num_slots, cfg.num_heads, cfg.head_dim]
        return [(paddle.zeros(shape, dtype="float32"), paddle.zeros(shape, dtype="float32"))
                for _ in range(cfg.num_layers)]

    def forward_step(
        self,
        token_ids: np.ndarray,
        positions: np.ndarray,
        token_slots: np.ndarray,
        context_slots: np.ndarray,
        context_mask: np.ndarray,
        kv_cache: list[tuple[object, object]],
        topk_hook: TopkHook | None = None,
    ):
        """One engine step over ragged tokens with a paged KV cache.

        ``token_slots[t]`` is the KV slot token t writes; ``context_slots[t, c]`` the
        slot of context position c it attends to (``context_mask`` marks valid ones,
        the token's own position included).  ``topk_hook(layer_idx=, topk_ids=)`` is
        called after top-k in every MoE layer with the MoE layer index.  Returns the
        next-token logits ``[T, vocab]`` as a Paddle tensor.
        """
        cfg = self.config
        num_tokens = len(token_ids)
        x = (paddle.gather(self.embedding, paddle.to_tensor(token_ids, dtype="int64"))
             + paddle.gather(self.position_embedding, paddle.to_tensor(positions, dtype="int64")))
        slots_t = paddle.to_tensor(token_slots, dtype="int64")
        ctx_t = paddle.to_tensor(context_slots.reshape(-1), dtype="int64")
        mask_t = paddle.to_tensor(context_mask)
        ctx_len = context_slots.shape[1]
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x)
            key_cache, value_cache = kv_cache[index]
            paddle.scatter_(key_cache, slots_t, k, overwrite=True)
            paddle.scatter_(value_cache, slots_t, v, overwrite=True)
            keys = paddle.gather(key_cache, ctx_t).reshape(
                [num_tokens, ctx_len, cfg.num_heads, cfg.head_dim])
            values = paddle.gather(value_cache, ctx_t).reshape(
                [num_tokens, ctx_len, cfg.num_heads, cfg.head_dim])
            attn = self._attend(q, keys, values, mask_t).reshape([num_tokens, cfg.hidden_size])
            x = x + paddle.matmul(attn, layer["wo"])
            out, _, top_ids = self._ffn(index, layer, x)
            if top_ids is not None and topk_hook is not None:
                topk_hook(layer_idx=index - cfg.moe_layer_start_index, topk_ids=top_ids)
            x = x + out
        return paddle.matmul(_rms_norm(x, self.final_norm), self.lm_head)

    # ------------------------------------------------------------------ trainer forward
    def forward_full(self, token_ids: np.ndarray, replay: np.ndarray | None = None) -> FullForward:
        """Teacher-forced forward of one whole sequence, no KV cache.

        With ``replay`` (``[L_moe, S, K]`` expert ids, as a routing record holds) the
        MoE layers mix the replayed experts — what an R3 trainer does — so one near-tie
        cannot cascade into later layers; the reported ``topk_ids`` are still the
        router's own choice, which is what the fidelity check compares.
        """
        cfg = self.config
        seq_len = len(token_ids)
        if seq_len > cfg.max_model_len:
            raise ValueError(f"sequence of {seq_len} tokens exceeds max_model_len={cfg.max_model_len}")
        x = (paddle.gather(self.embedding, paddle.to_tensor(token_ids, dtype="int64"))
             + self.position_embedding[:seq_len])
        causal = np.tril(np.ones((seq_len, seq_len), dtype=bool))
        mask_t = paddle.to_tensor(causal)
        gate_logits, topk_ids = [], []
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x)
            keys = paddle.expand(k.unsqueeze(0), [seq_len, seq_len, cfg.num_heads, cfg.head_dim])
            values = paddle.expand(v.unsqueeze(0), [seq_len, seq_len, cfg.num_heads, cfg.head_dim])
            attn = self._attend(q, keys, values, mask_t).reshape([seq_len, cfg.hidden_size])
            x = x + paddle.matmul(attn, layer["wo"])
            replay_ids = None
            moe_index = index - cfg.moe_layer_start_index
            if replay is not None and moe_index >= 0:
                replay_ids = paddle.to_tensor(replay[moe_index].astype(np.int64))
            out, logits, top_ids = self._ffn(index, layer, x, replay_ids)
            if logits is not None:
                gate_logits.append(logits.numpy())
                topk_ids.append(top_ids.numpy())
            x = x + out
        final = paddle.matmul(_rms_norm(x, self.final_norm), self.lm_head)
        return FullForward(logits=final.numpy(), gate_logits=np.stack(gate_logits),
                           topk_ids=np.stack(topk_ids))
