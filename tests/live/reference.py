"""The independent recompute: the tiny model's routes for a token sequence, in one process.

A teacher-forced forward pass of :mod:`tests.live.tiny_moe`'s architecture written again in
NumPy float64 from the weights the worker exported (``weights.npz``): no FastDeploy, no
paged KV cache, no batching, no CPU stand-in -- one sequence, every position at once, a
dense causal mask.  It gives, for every forwarded position of a request (prompt + generated
- 1) and every MoE layer, the top-k experts in the order the gate ranks them, which is what
a record must hold.

The server computes in float32, so a position whose k-th and (k+1)-th gate logits (or two
adjacent ranks inside the top-k) lie closer than :data:`NEAR_TIE` may legitimately rank
differently; :meth:`TinyReference.compare` reports such rows apart from mismatches.  The
gate logits are O(1) and their adjacent ranks typically ~1e-1 apart, so near ties are rare
(none in most runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["NEAR_TIE", "Comparison", "TinyReference"]

NEAR_TIE = 1e-4
"""Gate logits closer than this may swap between the float32 server and this recompute
(float32 rounding of O(1) logits is ~1e-6)."""

DUMMY_SPREAD = 2e-3


def _gain(fan_in: int) -> float:
    return 1.0 / (DUMMY_SPREAD * math.sqrt(fan_in))


def _norm(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _sinusoid(positions: np.ndarray, width: int) -> np.ndarray:
    half = np.arange(width // 2, dtype=np.float64)
    angles = positions.astype(np.float64)[:, None] / (10000.0 ** (2.0 * half / width))[None, :]
    out = np.zeros((len(positions), width))
    out[:, 0::2] = np.sin(angles)
    out[:, 1::2] = np.cos(angles)
    return out


def _swiglu(h: np.ndarray) -> np.ndarray:
    gate, up = np.split(h, 2, axis=-1)
    return gate / (1.0 + np.exp(-gate)) * up


@dataclass
class Comparison:
    """A record's rows against the recompute."""

    rows: int = 0                                     # position x layer rows compared
    mismatches: list[tuple[int, int, list, list]] = field(default_factory=list)   # (pos, layer, got, want)
    near_ties: list[tuple[int, int]] = field(default_factory=list)               # differing rows at a near tie

    @property
    def exact(self) -> bool:
        return not self.mismatches

    def describe(self, limit: int = 5) -> str:
        shown = "; ".join(f"position {p} MoE layer row {layer}: recorded {got}, recomputed {want}"
                          for p, layer, got, want in self.mismatches[:limit])
        return (f"{len(self.mismatches)} of {self.rows} rows differ ({len(self.near_ties)} more at near ties)"
                + (f": {shown}" if shown else ""))


class TinyReference:
    """The tiny model's forward pass from its exported weights."""

    def __init__(self, weights: Path | dict) -> None:
        data = dict(np.load(weights)) if not isinstance(weights, dict) else weights
        self.w = {k: v.astype(np.float64) for k, v in data.items() if not k.startswith("meta.")}
        meta = {k[5:]: v.item() for k, v in data.items() if k.startswith("meta.")}
        self.heads, self.kv_heads, self.head_dim = int(meta["heads"]), int(meta["kv_heads"]), int(meta["head_dim"])
        self.moe_start, self.top_k, self.eps = int(meta["moe_start"]), int(meta["top_k"]), float(meta["eps"])
        self.layers = int(meta["layers"])
        self.hidden = self.w["embed"].shape[1]

    @property
    def moe_layers(self) -> list[int]:
        """Decoder-layer index of each record row."""
        return list(range(self.moe_start, self.layers))

    def _attention(self, n: np.ndarray, prefix: str) -> np.ndarray:
        tokens = n.shape[0]
        g = _gain(self.hidden)
        q = (n @ self.w[prefix + "q_proj"] * g).reshape(tokens, self.heads, self.head_dim)
        k = (n @ self.w[prefix + "k_proj"] * g).reshape(tokens, self.kv_heads, self.head_dim)
        v = (n @ self.w[prefix + "v_proj"] * g).reshape(tokens, self.kv_heads, self.head_dim)
        group = self.heads // self.kv_heads
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.head_dim)
        scores = np.where(np.tril(np.ones((tokens, tokens), dtype=bool))[None], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        weights = np.exp(scores)
        weights /= weights.sum(axis=-1, keepdims=True)
        out = np.einsum("hqk,khd->qhd", weights, v).reshape(tokens, -1)
        return out @ self.w[prefix + "o_proj"] * _gain(self.heads * self.head_dim)

    def forward(self, token_ids: list[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Routes of every position: ``(ids [moe_layers, T, K] in rank order, gate logits
        [moe_layers, T, experts])`` (softmax preserves the logits' order)."""
        ids = np.asarray(token_ids, dtype=np.int64)
        x = _norm(self.w["embed"][ids], self.eps) + _sinusoid(np.arange(len(ids)), self.hidden)
        ranked, probs = [], []
        for layer in range(self.layers):
            prefix = f"l{layer}."
            h = x + self._attention(_norm(x, self.eps), prefix)
            n = _norm(h, self.eps)
            if layer >= self.moe_start:
                inp = n * _gain(self.hidden)
                logits = inp @ self.w[prefix + "gate"]
                p = np.exp(logits - logits.max(axis=-1, keepdims=True))
                p /= p.sum(axis=-1, keepdims=True)
                order = np.argsort(-logits, axis=-1, kind="stable")[:, : self.top_k]
                ranked.append(order)
                probs.append(logits)
                chosen = np.take_along_axis(p, order, axis=-1)
                chosen /= chosen.sum(axis=-1, keepdims=True)
                ffn = np.zeros_like(inp)
                for j in range(self.top_k):
                    for expert in np.unique(order[:, j]):
                        rows = order[:, j] == expert
                        out = _swiglu(inp[rows] @ self.w[prefix + "up_gate"][expert]) @ self.w[prefix + "down"][expert]
                        ffn[rows] += chosen[rows, j:j + 1] * out
                ffn *= _gain(self.w[prefix + "down"].shape[1])
            else:
                up = n @ self.w[prefix + "up_gate"] * _gain(self.hidden)
                ffn = _swiglu(up) @ self.w[prefix + "down"] * _gain(self.w[prefix + "down"].shape[0])
            x = h + ffn
        return np.stack(ranked), np.stack(probs)

    def routes(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """``[moe_layers, T, top_k]`` expert ids of every position of ``token_ids``."""
        return self.forward(token_ids)[0]

    def compare(self, recorded: np.ndarray, token_ids: list[int] | np.ndarray) -> Comparison:
        """Compare a record's ``[layers, tokens, top_k]`` rows with the recompute of the
        request's tokens (the record covers ``len(token_ids) - 1`` forwarded positions)."""
        want, probs = self.forward(np.asarray(token_ids)[: recorded.shape[1]])
        result = Comparison(rows=recorded.shape[0] * recorded.shape[1])
        got = np.asarray(recorded).astype(np.int64)
        for layer, pos in zip(*np.nonzero((got != want).any(axis=-1)), strict=True):
            ranked = np.sort(probs[layer, pos])[::-1][: self.top_k + 1]
            if np.min(-np.diff(ranked)) < NEAR_TIE:
                result.near_ties.append((int(pos), int(layer)))
            else:
                result.mismatches.append((int(pos), int(layer), got[layer, pos].tolist(),
                                          want[layer, pos].tolist()))
        return result
