"""The live rig's model: a tiny float32 MoE language model that FastDeploy builds and runs.

Registered through FastDeploy's ``fastdeploy.model_register_plugins`` entry-point group
(model_executor/models/__init__.py:68; the rig's test-only dist-info in
``tests/live/site/`` declares it) and built by FastDeploy's own ``load_model`` with
``--load-choices dummy`` (model_loader/dummy_loader.py:32-105), which fills every weight
with ``2e-3 * randn - 1e-3`` from FastDeploy's seeded generator.  Its MoE layers are
FastDeploy's ``FusedMoE`` (layers/moe/moe.py), so FastDeploy's routing replay call site
(``FusedMoE.forward`` binding ``save_routing_to_buffer_v2``, moe.py:745-760) and its default
Cutlass MoE method (whose kernels ``tests/fdcpu/moe_ops.py`` stands in for) are the ones
that run.

Architecture (per decoder layer ``l``; ``norm`` is an RMS normalisation without weights, so
the tiny dummy weights still give O(1) activations; every linear map is scaled by
``gain(fan_in) = 1 / (0.002 * sqrt(fan_in))``, the inverse of the dummy weights' spread, and
the first forward pass centres every weight tensor in place -- the dummy values have mean
``-1e-3``, a shared offset that would otherwise dominate every activation and make every
token alike):

    x_0 = norm(embed[token]) + sinusoid(position)
    h   = x + attention(norm(x))            # causal, paged KV cache (tests/fdcpu/attention.py)
    x'  = h + ffn_l(norm(h))                 # dense SwiGLU MLP for l < moe_layer_start_index,
                                             # else FusedMoE on m = norm(h) * gain(hidden) with
                                             # gate logits m @ gate, times gain(moe_intermediate)
    logits = norm(x_L) @ lm_head * gain,     # ids >= the tokenizer's vocabulary masked

plus one deterministic rule that bounds generation: the end-of-sequence logit is raised
above every other when the next position is a multiple of ``fdrr.eos_period`` (a request's
``min_tokens`` still suppresses it: FastDeploy's penalty kernel runs after the model).

``fdrr.weights_out`` (config.json) or ``FDRR_LIVE_WEIGHTS`` names a ``.npz`` the worker
writes the weights to at its first forward pass, for the independent recompute
(``tests/live/reference.py``).
"""

from __future__ import annotations

import inspect
import math
import os
from typing import Any

import numpy as np
import paddle
from fastdeploy.model_executor.models.model_base import ModelForCasualLM, ModelRegistry
from paddle import nn

ARCHITECTURE = "FdrrTinyMoeForCausalLM"
DUMMY_SPREAD = 2e-3            # dummy_loader.py:44-69: (high - low) * randn + low, high - low = 2e-3


def gain(fan_in: int) -> float:
    """The scale that brings a dummy-initialised linear map's outputs to O(1)."""
    return 1.0 / (DUMMY_SPREAD * math.sqrt(fan_in))


def rms_norm(x: Any, eps: float) -> Any:
    return x * paddle.rsqrt(paddle.mean(x * x, axis=-1, keepdim=True) + eps)


def sinusoid(positions: np.ndarray, width: int) -> np.ndarray:
    """Absolute position signal ``[tokens, width]`` (float64)."""
    half = np.arange(width // 2, dtype=np.float64)
    angles = positions.astype(np.float64)[:, None] / (10000.0 ** (2.0 * half / width))[None, :]
    out = np.zeros((len(positions), width), dtype=np.float64)
    out[:, 0::2] = np.sin(angles)
    out[:, 1::2] = np.cos(angles)
    return out


class TinyGate(nn.Layer):
    """The MoE gate ``FusedMoE`` calls (``gate(x)``, fused_moe_cutlass_backend.py:342); its
    input already carries ``gain(hidden)``, so the logits are O(1)."""

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.weight = self.create_parameter([hidden, experts], dtype="float32")

    def forward(self, x: Any) -> Any:
        return paddle.matmul(x, self.weight)


class TinyDecoderLayer(nn.Layer):
    def __init__(self, fd_config: Any, layer_idx: int) -> None:
        super().__init__()
        from fastdeploy.model_executor.layers.moe.moe import FusedMoE

        mc = fd_config.model_config
        self.layer_idx = layer_idx
        self.eps = float(mc.rms_norm_eps)
        hidden, heads, kv_heads, head_dim = mc.hidden_size, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
        self.heads, self.kv_heads, self.head_dim, self.hidden = heads, kv_heads, head_dim, hidden
        self.block_size = fd_config.cache_config.block_size
        self.q_proj = self.create_parameter([hidden, heads * head_dim], dtype="float32")
        self.k_proj = self.create_parameter([hidden, kv_heads * head_dim], dtype="float32")
        self.v_proj = self.create_parameter([hidden, kv_heads * head_dim], dtype="float32")
        self.o_proj = self.create_parameter([heads * head_dim, hidden], dtype="float32")
        self.is_moe = layer_idx >= mc.moe_layer_start_index
        if self.is_moe:
            self.gate = TinyGate(hidden, mc.moe_num_experts)
            sizes = {"hidden_size": hidden} if "hidden_size" in inspect.signature(FusedMoE).parameters else {}
            self.experts = FusedMoE(fd_config, reduce_results=True, moe_intermediate_size=mc.moe_intermediate_size,
                                    num_experts=mc.moe_num_experts, top_k=mc.moe_k, layer_idx=layer_idx,
                                    weight_key_map={}, **sizes)      # develop-2026-04 takes hidden_size
            self.moe_in = gain(hidden)
            self.moe_out = gain(mc.moe_intermediate_size)
        else:
            self.up_gate_proj = self.create_parameter([hidden, 2 * mc.intermediate_size], dtype="float32")
            self.down_proj = self.create_parameter([mc.intermediate_size, hidden], dtype="float32")
            self.intermediate = mc.intermediate_size

    def forward(self, x: Any, forward_meta: Any, layout: Any) -> Any:
        from tests.fdcpu.attention import paged_attention

        tokens = x.shape[0]
        n = rms_norm(x, self.eps)
        q = (paddle.matmul(n, self.q_proj) * gain(self.hidden)).reshape([tokens, self.heads, self.head_dim])
        k = (paddle.matmul(n, self.k_proj) * gain(self.hidden)).reshape([tokens, self.kv_heads, self.head_dim])
        v = (paddle.matmul(n, self.v_proj) * gain(self.hidden)).reshape([tokens, self.kv_heads, self.head_dim])
        attended = paged_attention(q, k, v, forward_meta.caches[2 * self.layer_idx],
                                   forward_meta.caches[2 * self.layer_idx + 1], layout, self.block_size,
                                   1.0 / math.sqrt(self.head_dim))
        h = x + paddle.matmul(attended, self.o_proj) * gain(self.heads * self.head_dim)
        n = rms_norm(h, self.eps)
        if self.is_moe:
            ffn = self.experts(n * self.moe_in, self.gate, forward_meta) * self.moe_out
        else:
            up = paddle.matmul(n, self.up_gate_proj) * gain(self.hidden)
            g, u = paddle.split(up, 2, axis=-1)
            ffn = paddle.matmul(nn.functional.silu(g) * u, self.down_proj) * gain(self.intermediate)
        return h + ffn


class TinyMoeForCausalLM(ModelForCasualLM):
    """The rig's model class (FastDeploy's ``ModelForCasualLM`` interface)."""

    def __init__(self, fd_config: Any) -> None:
        super().__init__(fd_config)
        mc = fd_config.model_config
        extra = dict(getattr(mc, "fdrr", None) or {})
        self.vocab = int(mc.vocab_size)
        self.usable_vocab = int(getattr(mc, "ori_vocab_size", None) or self.vocab)
        self.hidden = int(mc.hidden_size)
        self.eps = float(mc.rms_norm_eps)
        self.eos = int(extra.get("eos_token_id", 2))
        self.eos_period = int(extra.get("eos_period", 0))
        self.weights_out = os.environ.get("FDRR_LIVE_WEIGHTS") or extra.get("weights_out")
        self.prepared = False
        self.embed_tokens = self.create_parameter([self.vocab, self.hidden], dtype="float32")
        self.layers = nn.LayerList([TinyDecoderLayer(fd_config, i) for i in range(mc.num_hidden_layers)])
        self.lm_head = self.create_parameter([self.hidden, self.vocab], dtype="float32")

    @classmethod
    def name(cls) -> str:
        return ARCHITECTURE

    def load_weights(self, weights_iterator: Any) -> None:
        raise NotImplementedError(f"{ARCHITECTURE} is built with --load-choices dummy only")

    def set_state_dict(self, state_dict: Any) -> None:
        raise NotImplementedError(f"{ARCHITECTURE} is built with --load-choices dummy only")

    def forward(self, inputs: dict, forward_meta: Any) -> Any:
        from tests.fdcpu.attention import step_layout

        ids = inputs["ids_remove_padding"]
        layout = step_layout(forward_meta, ids.shape[0])
        if not self.prepared:
            self._prepare()
        x = rms_norm(paddle.gather(self.embed_tokens, ids), self.eps)
        x = x + paddle.to_tensor(sinusoid(layout.positions, self.hidden).astype(np.float32))
        for layer in self.layers:
            x = layer(x, forward_meta, layout)
        return x

    def compute_logits(self, hidden_states: Any, forward_meta: Any = None) -> Any:
        logits = paddle.matmul(rms_norm(hidden_states, self.eps), self.lm_head) * gain(self.hidden)
        if self.usable_vocab < self.vocab:
            logits[:, self.usable_vocab:] = -1e9
        if self.eos_period and forward_meta is not None:
            # row b samples the token after the step's last position of sequence b
            this_time = forward_meta.seq_lens_this_time.numpy().reshape(-1)
            decoded = forward_meta.seq_lens_decoder.numpy().reshape(-1)
            rows = np.nonzero(this_time[: logits.shape[0]] > 0)[0]
            next_pos = decoded[rows] + this_time[rows]
            due = rows[next_pos % self.eos_period == 0]
            if len(due):
                index = paddle.to_tensor(due.astype(np.int64))
                top = paddle.max(paddle.gather(logits, index), axis=-1)
                logits[index, self.eos] = top + 50.0
        return logits

    # ------------------------------------------------------------------ for the recompute
    def weights(self) -> dict[str, np.ndarray]:
        """Every weight as a float32 array, named for ``tests/live/reference.py``."""
        out = {"embed": self.embed_tokens.numpy(), "lm_head": self.lm_head.numpy()}
        for layer in self.layers:
            prefix = f"l{layer.layer_idx}."
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out[prefix + name] = getattr(layer, name).numpy()
            if layer.is_moe:
                out[prefix + "gate"] = layer.gate.weight.numpy()
                out[prefix + "up_gate"] = layer.experts.up_gate_proj_weight.numpy()
                out[prefix + "down"] = layer.experts.down_proj_weight.numpy()
            else:
                out[prefix + "up_gate"] = layer.up_gate_proj.numpy()
                out[prefix + "down"] = layer.down_proj.numpy()
        return out

    def _prepare(self) -> None:
        """Centre every weight (once, before the first forward) and export them when asked."""
        with paddle.no_grad():
            for param in self.parameters():
                param.set_value(param - paddle.mean(param))
        self.prepared = True
        if self.weights_out:
            self._export_weights(self.weights_out)

    def _export_weights(self, path: str) -> None:
        if os.path.exists(path):
            return
        mc = self.fd_config.model_config
        meta = {"heads": mc.num_attention_heads, "kv_heads": mc.num_key_value_heads, "head_dim": mc.head_dim,
                "moe_start": mc.moe_layer_start_index, "top_k": mc.moe_k, "eps": self.eps,
                "layers": mc.num_hidden_layers, "vocab": self.vocab, "usable_vocab": self.usable_vocab,
                "eos": self.eos, "eos_period": self.eos_period}
        tmp = f"{path}.{os.getpid()}.tmp.npz"
        np.savez(tmp, **self.weights(), **{f"meta.{k}": np.asarray(v) for k, v in meta.items()})
        os.replace(tmp, path)


def register() -> None:
    """Entry point of ``fastdeploy.model_register_plugins`` (FastDeploy calls it when
    ``fastdeploy.model_executor.models`` is imported and ``FD_PLUGINS`` names it)."""
    ModelRegistry.register_model_class(TinyMoeForCausalLM, architecture=ARCHITECTURE, module_name="tiny_moe",
                                       module_path="tests.live")
