"""Trainer-side fidelity check: is the stored routing what the model routed?

For every finished request the record is read back through
:class:`~fd_routing_replay.reader.RoutingReader` and the model is run teacher-forced over
the request's forwarded tokens in one forward pass without KV cache — as a trainer
recomputes a rollout — replaying the recorded experts (R3).  Per token and MoE layer the
router's own top-k *set* is compared with the record.

Required: 100% agreement wherever the gate's k-th and (k+1)-th logits differ by more
than ``margin`` (1e-3); closer calls are *near-ties*, where the engine's batched,
paged arithmetic and the trainer's full forward may legitimately round to different
experts.  They are counted and reported, as is the overall agreement.  Replaying the
record keeps a near-tie flip from cascading into later layers and tokens, so one
legitimate flip cannot hide or fake anything else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from fdrr_dev.harness.model import TinyMoEModel
from fdrr_dev.harness.rollouts import TurnResult

DEFAULT_MARGIN = 1e-3


@dataclass
class FidelityReport:
    """Totals over all checked requests; ``passed`` is the verdict."""

    margin: float = DEFAULT_MARGIN
    requests: int = 0
    tokens: int = 0
    decisions: int = 0            # (token, layer) pairs compared
    agreements: int = 0
    near_ties: int = 0
    near_tie_disagreements: int = 0
    decisive_disagreements: int = 0
    missing_records: int = 0
    wrong_lengths: int = 0
    unrouted_tokens: int = 0      # fill values inside a record
    failures: list[str] = field(default_factory=list)

    @property
    def agreement(self) -> float:
        return self.agreements / self.decisions if self.decisions else 1.0

    @property
    def passed(self) -> bool:
        return (self.requests > 0 and self.decisive_disagreements == 0 and self.missing_records == 0
                and self.wrong_lengths == 0 and self.unrouted_tokens == 0)

    def fail(self, message: str) -> None:
        if len(self.failures) < 20:
            self.failures.append(message)

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (f"fidelity {verdict}: {self.requests} requests, {self.tokens} tokens, "
                f"{self.decisions} decisions, agreement {self.agreement:.4%}, "
                f"{self.near_ties} near-ties ({self.near_tie_disagreements} flipped), "
                f"{self.decisive_disagreements} decisive disagreements, "
                f"{self.missing_records} missing, {self.wrong_lengths} wrong lengths, "
                f"{self.unrouted_tokens} unrouted tokens")


def topk_margins(gate_logits: np.ndarray, top_k: int) -> np.ndarray:
    """Gap between the k-th and (k+1)-th largest gate logit, per ``[..., experts]`` row."""
    part = -np.partition(-gate_logits, top_k, axis=-1)[..., : top_k + 1]
    part = -np.sort(-part, axis=-1)
    return part[..., top_k - 1] - part[..., top_k]


def check_record(model: TinyMoEModel, tokens: np.ndarray, ids: np.ndarray, fill_value: int,
                 report: FidelityReport, label: str) -> None:
    """Compare one record ``ids [L, T, K]`` with the teacher-forced forward of ``tokens``."""
    cfg = model.config
    report.requests += 1
    report.tokens += len(tokens)
    expected = (cfg.num_moe_layers, len(tokens), cfg.top_k)
    if tuple(ids.shape) != expected:
        report.wrong_lengths += 1
        report.fail(f"{label}: record shape {tuple(ids.shape)}, expected {expected}")
        return
    holes = (ids == fill_value).any(axis=(0, 2))
    if holes.any():
        report.unrouted_tokens += int(holes.sum())
        report.fail(f"{label}: {int(holes.sum())} tokens without routing "
                    f"(first at position {int(np.argmax(holes))})")
        return
    recorded = ids.astype(np.int64)
    full = model.forward_full(tokens, replay=recorded)
    same = (np.sort(full.topk_ids, axis=-1) == np.sort(recorded, axis=-1)).all(axis=-1)   # [L, T]
    near = topk_margins(full.gate_logits, cfg.top_k) <= report.margin
    report.decisions += same.size
    report.agreements += int(same.sum())
    report.near_ties += int(near.sum())
    report.near_tie_disagreements += int((~same & near).sum())
    decisive = ~same & ~near
    if decisive.any():
        report.decisive_disagreements += int(decisive.sum())
        layer, token = (int(v) for v in np.argwhere(decisive)[0])
        report.fail(f"{label}: layer {layer} token {token}: recorded "
                    f"{sorted(recorded[layer, token].tolist())}, model routes "
                    f"{sorted(full.topk_ids[layer, token].tolist())}")


def check_results(
    results: Iterable[TurnResult],
    get_record: Callable[[str], object | None],
    model_for_version: Callable[[int], TinyMoEModel],
    *,
    margin: float = DEFAULT_MARGIN,
    expect_present: Callable[[TurnResult], bool] = lambda r: True,
) -> FidelityReport:
    """Check every result whose record should exist (``expect_present``)."""
    report = FidelityReport(margin=margin)
    for result in results:
        if not expect_present(result):
            continue
        record = get_record(result.rollout_id)
        if record is None:
            report.missing_records += 1
            report.fail(f"{result.rollout_id}: no record")
            continue
        model = model_for_version(result.weights_version)
        check_record(model, np.asarray(result.forwarded_tokens, dtype=np.int64),
                     np.asarray(record.ids), int(record.fill_value), report, result.rollout_id)
    return report
