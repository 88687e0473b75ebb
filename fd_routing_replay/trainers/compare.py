"""Routing mismatch between rollout and trainer: how often the trainer's router disagrees.

:func:`compare_routing` takes the recorded routing (a record or its ``[L, T, K]`` ids)
and what a trainer recomputed for the same positions, and returns plain numbers (a dict
for W&B / TensorBoard; JSON-safe):

* ``flip_rate`` / ``per_layer_flip_rate`` — share of (layer, token) decisions whose top-k
  *set* differs (order inside the top-k is not compared: engines and trainers order
  ties and scores differently, and the ``set`` encoding stores sets);
* ``token_flip_share`` — share of tokens with at least one flipped layer (R3's paper
  figure: ~10 % of decisions but ~94 % of tokens differ without replay);
* ``flipped_layers_per_token`` — mean number of flipped (layer) decisions per routed token;
* ``mean_overlap`` — mean ``|recorded ∩ recomputed| / K``;
* ``expert_load_drift`` — per expert, recomputed minus recorded share of all routed
  slots (sums to 0), with ``load_drift_l1`` and ``max_abs_load_drift``.

Only decisions the record routed count (fill-value rows are skipped and counted in
``unrouted_decisions``).  :class:`RoutingMismatchGauges` publishes a result as Prometheus
gauges in a registry the caller owns.

:func:`logprob_mismatch` compares the token log-probabilities of the two sides: the k3
estimate of KL(engine ‖ trainer) on the engine's sampled tokens and the largest
``|Δ logprob|`` (R3's paper reports both).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fd_routing_replay.codec import RoutingRecord
from fd_routing_replay.trainers._common import host_array, routed_length

__all__ = ["RoutingMismatchGauges", "compare_routing", "logprob_mismatch", "replay_topk"]


def _as_ids(value: Any, what: str) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.ndim != 3:
        raise ValueError(f"{what} must be [layers, tokens, top_k], got shape {array.shape}")
    if array.dtype.kind not in "iu":
        raise ValueError(f"{what} must hold integer expert ids, got dtype {array.dtype}")
    return array


def compare_routing(recorded: RoutingRecord | np.ndarray, recomputed: Any, *,
                    num_experts: int | None = None, fill_value: int | None = None,
                    layers: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Mismatch metrics of ``recomputed`` (``[L, T', K]`` ids, numpy or torch) against
    ``recorded`` (a record, or ``[L, T, K]`` ids with ``fill_value`` marking "no route").

    Layers must agree; tokens are compared over the common prefix ``min(T, T')`` (a trainer
    usually recomputes one more position: the last, never-forwarded token).
    ``compared_tokens`` says how many.  ``num_experts`` defaults to the record's, else to
    the largest id seen + 1.  ``layers`` labels the per-layer entries (default: the
    record's layer map, else 0..L-1).
    """
    if isinstance(recorded, RoutingRecord):
        ids = recorded.ids[:, :routed_length(recorded)]
        fill = recorded.fill_value if fill_value is None else fill_value
        num_experts = recorded.num_experts if num_experts is None else num_experts
        layers = tuple(recorded.layer_map) if layers is None else layers
    else:
        ids = _as_ids(recorded, "recorded")
        fill = fill_value
    other = _as_ids(recomputed, "recomputed")
    if ids.shape[0] != other.shape[0] or ids.shape[2] != other.shape[2]:
        raise ValueError(f"recorded {list(ids.shape)} and recomputed {list(other.shape)} "
                         "differ in layers or top_k ([layers, tokens, top_k] both)")
    num_layers, top_k = ids.shape[0], ids.shape[2]
    tokens = min(ids.shape[1], other.shape[1])
    recorded_tokens, recomputed_tokens = int(ids.shape[1]), int(other.shape[1])
    ids, other = ids[:, :tokens].astype(np.int64), other[:, :tokens].astype(np.int64)
    layers = tuple(range(num_layers)) if layers is None else tuple(int(x) for x in layers)
    if len(layers) != num_layers:
        raise ValueError(f"{len(layers)} layer labels for {num_layers} layers")
    valid = ~(ids == fill).any(axis=2) if fill is not None else np.ones(ids.shape[:2], bool)
    seen = [int(a[v].max()) for a, v in ((ids, valid), (other, valid)) if v.any()]
    if num_experts is None:
        num_experts = max(seen, default=-1) + 1
    if (other[valid] < 0).any() or (other[valid] >= num_experts).any():
        raise ValueError(f"recomputed ids must be in [0, {num_experts}) where the record "
                         "has routes")

    flipped = np.zeros(ids.shape[:2], dtype=bool)
    overlap_sum = 0
    per_layer_flip: list[float | None] = []
    load_recorded = np.zeros(num_experts, dtype=np.int64)
    load_recomputed = np.zeros(num_experts, dtype=np.int64)
    per_layer_l1: list[float | None] = []
    for layer in range(num_layers):  # one layer at a time: memory stays O(T * K * K)
        v = valid[layer]
        a, b = ids[layer][v], other[layer][v]
        if not a.size:
            per_layer_flip.append(None)
            per_layer_l1.append(None)
            continue
        same = (np.sort(a, axis=1) == np.sort(b, axis=1)).all(axis=1)
        flipped[layer, v] = ~same
        overlap_sum += int((a[:, :, None] == b[:, None, :]).any(axis=2).sum())
        per_layer_flip.append(float((~same).mean()))
        rec = np.bincount(a.reshape(-1), minlength=num_experts)
        com = np.bincount(b.reshape(-1), minlength=num_experts)
        load_recorded += rec
        load_recomputed += com
        per_layer_l1.append(float(np.abs(com - rec).sum() / a.size))
    decisions = int(valid.sum())
    routed_tokens = valid.any(axis=0)
    slots = decisions * top_k
    drift = (load_recomputed - load_recorded) / slots if slots else np.zeros(num_experts)
    return {
        "layers": list(layers),
        "compared_tokens": int(tokens),
        "recorded_tokens": recorded_tokens,
        "recomputed_tokens": recomputed_tokens,
        "decisions": decisions,
        "unrouted_decisions": int(valid.size - decisions),
        "flipped_decisions": int(flipped.sum()),
        "flip_rate": float(flipped.sum() / decisions) if decisions else 0.0,
        "per_layer_flip_rate": per_layer_flip,
        "token_flip_share": float(flipped.any(axis=0)[routed_tokens].mean())
        if routed_tokens.any() else 0.0,
        "flipped_layers_per_token": float(flipped.sum() / routed_tokens.sum())
        if routed_tokens.any() else 0.0,
        "mean_overlap": float(overlap_sum / slots) if slots else 1.0,
        "num_experts": int(num_experts),
        "expert_load_recorded": load_recorded.tolist(),
        "expert_load_recomputed": load_recomputed.tolist(),
        "expert_load_drift": [float(x) for x in drift],
        "load_drift_l1": float(np.abs(drift).sum()),
        "max_abs_load_drift": float(np.abs(drift).max()) if drift.size else 0.0,
        "per_layer_load_drift_l1": per_layer_l1,
    }


def logprob_mismatch(engine_logprobs: Any, trainer_logprobs: Any) -> dict[str, Any]:
    """How far the trainer's token log-probabilities are from the engine's, on the tokens
    the engine sampled (``[N]`` each, natural log, same tokens in the same order).

    With ``d = logp_trainer - logp_engine``: ``k3_kl = mean(exp(d) - 1 - d)``, Schulman's
    k3 estimator of KL(π_engine ‖ π_trainer) from samples of π_engine (non-negative per
    token, unbiased); ``max_abs_logprob_diff = max |d|``; ``mean_abs_logprob_diff``.
    """
    engine = host_array(engine_logprobs, np.float64).reshape(-1)
    trainer = host_array(trainer_logprobs, np.float64).reshape(-1)
    if engine.shape != trainer.shape:
        raise ValueError(f"{engine.size} engine logprobs but {trainer.size} trainer logprobs: "
                         "they must be of the same tokens")
    if not (np.isfinite(engine).all() and np.isfinite(trainer).all()):
        raise ValueError("logprobs must be finite (a sampled token has probability > 0)")
    diff = trainer - engine
    return {
        "tokens": int(diff.size),
        "k3_kl": float(np.mean(np.expm1(diff) - diff)) if diff.size else 0.0,
        "max_abs_logprob_diff": float(np.abs(diff).max()) if diff.size else 0.0,
        "mean_abs_logprob_diff": float(np.abs(diff).mean()) if diff.size else 0.0,
    }




def replay_topk(scores: np.ndarray, recorded: np.ndarray, mask: np.ndarray | None = None,
                top_k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """NumPy reference of a replaying router for one layer: ``(probs, ids)``.

    ``scores [T, E]``; where ``mask`` is True (default everywhere) the ids are the
    ``recorded [T, K]`` ones and the probabilities the scores gathered there (as
    Megatron's ``RouterReplay`` does); elsewhere the router's own top-k.
    """
    scores = np.asarray(scores)
    recorded = np.asarray(recorded, dtype=np.int64)
    k = recorded.shape[1] if top_k is None else top_k
    own = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    use = np.ones(scores.shape[0], dtype=bool) if mask is None else np.asarray(mask, bool)
    ids = np.where(use[:, None], recorded, own)
    return np.take_along_axis(scores, ids, axis=1), ids


class RoutingMismatchGauges:
    """Prometheus gauges for :func:`compare_routing` results, in the caller's registry.

    ``prefix_flip_rate``, ``prefix_token_flip_share``, ``prefix_mean_overlap``,
    ``prefix_load_drift_l1`` (labels: ``labelnames``), ``prefix_layer_flip_rate``
    (+ ``layer``: the decoder layer) and ``prefix_expert_load_drift`` (+ ``expert``).
    Create it once per registry; call :meth:`update` after each comparison.
    """

    def __init__(self, registry: Any, *, prefix: str = "fd_rr_routing",
                 labelnames: tuple[str, ...] = ()) -> None:
        from prometheus_client import Gauge

        labels = tuple(labelnames)
        self.labelnames = labels
        self.flip_rate = Gauge(f"{prefix}_flip_rate", "Share of (layer, token) routing "
                               "decisions whose top-k set differs from the rollout's",
                               labels, registry=registry)
        self.token_flip_share = Gauge(f"{prefix}_token_flip_share", "Share of tokens with "
                                      "at least one flipped layer", labels, registry=registry)
        self.mean_overlap = Gauge(f"{prefix}_mean_overlap", "Mean share of the rollout's "
                                  "top-k experts the trainer also picked", labels,
                                  registry=registry)
        self.load_drift_l1 = Gauge(f"{prefix}_load_drift_l1", "L1 distance between the "
                                   "trainer's and the rollout's expert load shares", labels,
                                   registry=registry)
        self.layer_flip_rate = Gauge(f"{prefix}_layer_flip_rate", "Flip rate per decoder "
                                     "layer", labels + ("layer",), registry=registry)
        self.expert_load_drift = Gauge(f"{prefix}_expert_load_drift", "Trainer minus "
                                       "rollout share of routed slots, per expert",
                                       labels + ("expert",), registry=registry)

    def update(self, result: dict[str, Any], **labels: str) -> None:
        """Set every gauge from one :func:`compare_routing` result."""
        values = [str(labels[name]) for name in self.labelnames]
        for gauge, key in ((self.flip_rate, "flip_rate"),
                           (self.token_flip_share, "token_flip_share"),
                           (self.mean_overlap, "mean_overlap"),
                           (self.load_drift_l1, "load_drift_l1")):
            (gauge.labels(*values) if values else gauge).set(result[key])
        for layer, rate in zip(result["layers"], result["per_layer_flip_rate"], strict=True):
            if rate is not None:
                self.layer_flip_rate.labels(*values, str(layer)).set(rate)
        for expert, drift in enumerate(result["expert_load_drift"]):
            self.expert_load_drift.labels(*values, str(expert)).set(drift)
