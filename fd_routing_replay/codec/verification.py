"""Verification records: the known expert ids verification mode records, and the mark that
keeps such records away from training.

Verification mode (``capture.verify``; ``fd-rr selftest`` drives it) replaces every token's
top-k in the MoE hook with a known function of where the token is, so that every stored
row can be checked end to end, after the store, against where it claims to be.  For the
token at position ``p`` of its request, routed in MoE row ``l`` (the record's row, 0-based)
by TP rank ``r`` of ``R`` ranks::

    code     = ((p mod P) * L + l) * S + s          S = 2 * R symbols
    s        = r                                     placed where FastDeploy's split puts it
             = R + r                                 the TP x EP all-gather put another rank's
                                                     row in rank r's share (a placement fault)
    f(p,l,s) = the code-th K-subset of [0, E) in colex order (combinatorial number system)
    P        = min(C(E, K), 2**62) // (L * S)         the position period

So the ``K`` ids are distinct and below ``num_experts`` (every op, set encoding and adapter
accepts them), fit the routing dtype, and a row decodes back to exactly one
``(p mod P, l, s)``: a row moved to another layer, another rank's share, or by fewer than
``P`` positions always decodes to the wrong place.  ``P`` is large for real models
(ERNIE-4.5-21B-A3B: E 64, K 6, 27 MoE layers, TP 1 gives P = 1,388,414) and small for toy
ones (the harness's E 16, K 4, 3 layers: P = 303); a shift by a multiple of ``P`` is the
one misplacement this cannot see.  Order inside the top-k carries nothing (the ``set``
encoding drops it), so rows are compared as sets.

FastDeploy 2.6's own ``debug_mode`` writes the position id into all ``K`` slots of every
layer after the TP all-gather and checks it in the worker's flush and the engine's gather
(routing_indices_cache.py:88-92, :262-300; routing_cache_manager.py:241-270): it cannot see
a layer written into another layer's row, never checks the all-gather, stores ids that are
not distinct and exceed ``num_experts``, and checks nothing after the store.

A verification record carries ``metadata["verification"]`` (:func:`marker`): trainer
adapters refuse it and the reader warns (:func:`refuse_for_training`, :func:`warn_once`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from fd_routing_replay.errors import ConfigError, RecordError

__all__ = ["MARKER_KEY", "SCHEME", "DecodedRows", "VerificationCode", "is_verification_record",
           "marker", "refuse_for_training", "verification_of", "warn_once"]

logger = logging.getLogger(__name__)

SCHEME = "fdrr-verify-1"
MARKER_KEY = "verification"
"""The record metadata key that marks a verification record."""

_CAPACITY_LIMIT = 2**62          # codes stay in int64 on every device
MIN_PERIOD = 2


@dataclass(frozen=True)
class DecodedRows:
    """What rows ``[..., K]`` decode to; meaningful where ``valid``."""

    valid: np.ndarray            # bool: distinct ids below E forming a code in range
    position: np.ndarray         # int64: position modulo the period
    layer: np.ndarray            # int64: MoE row
    symbol: np.ndarray           # int64: s (rank r, or R + r for a placement fault)


@dataclass(frozen=True)
class VerificationCode:
    """The function verification mode records (see the module docstring)."""

    num_experts: int
    top_k: int
    num_layers: int
    ranks: int = 1

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "num_layers", "ranks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"verification code: {name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"verification code: top_k {self.top_k} exceeds num_experts "
                              f"{self.num_experts}")
        if self.period < MIN_PERIOD:
            raise ConfigError(
                f"capture.verify cannot tell positions apart for this model: C({self.num_experts}, "
                f"{self.top_k}) = {math.comb(self.num_experts, self.top_k)} expert sets hold fewer "
                f"than {MIN_PERIOD} positions for each of {self.num_layers} MoE layers x "
                f"{self.symbols} rank symbols (TP {self.ranks})")

    @property
    def symbols(self) -> int:
        """S: a rank, or a rank flagged as misplaced by the TP x EP all-gather."""
        return 2 * self.ranks

    @cached_property
    def capacity(self) -> int:
        return min(math.comb(self.num_experts, self.top_k), _CAPACITY_LIMIT)

    @cached_property
    def period(self) -> int:
        """P: positions are told apart modulo P."""
        return self.capacity // (self.num_layers * self.symbols)

    @cached_property
    def table(self) -> np.ndarray:
        """``table[k, x] = C(x, k)`` for k in [0, K], x in [0, E), int64 clamped at 2**62
        (a clamped entry exceeds every code, so it is never chosen; columns stay sorted)."""
        out = np.empty((self.top_k + 1, self.num_experts), dtype=np.int64)
        for k in range(self.top_k + 1):
            out[k] = [min(math.comb(x, k), _CAPACITY_LIMIT) for x in range(self.num_experts)]
        out.flags.writeable = False
        return out

    # ------------------------------------------------------------------ the function
    def codes(self, positions: Any, layers: Any, symbols: Any) -> np.ndarray:
        """The code of each (position, layer, symbol), broadcast together (int64)."""
        positions = np.asarray(positions, dtype=np.int64)
        return ((np.mod(positions, self.period) * self.num_layers + np.asarray(layers, dtype=np.int64))
                * self.symbols + np.asarray(symbols, dtype=np.int64))

    def encode(self, positions: Any, layers: Any, symbols: Any) -> np.ndarray:
        """f: the ``K`` expert ids ``[..., K]`` (int64, descending) for each (p, l, s)."""
        code = np.array(self.codes(positions, layers, symbols), dtype=np.int64, copy=True)
        out = np.empty(code.shape + (self.top_k,), dtype=np.int64)
        for column, k in enumerate(range(self.top_k, 0, -1)):
            x = np.searchsorted(self.table[k], code, side="right") - 1
            out[..., column] = x
            code -= self.table[k][x]
        return out

    def decode(self, ids: Any) -> DecodedRows:
        """f's inverse on rows ``[..., K]``: invalid where the ids are not a code's set
        (repeated, out of range, the fill value, real routing)."""
        ids = np.asarray(ids)
        rows = np.sort(ids.astype(np.int64, copy=False), axis=-1)
        valid = (rows[..., 0] >= 0) & (rows[..., -1] < self.num_experts)
        if self.top_k > 1:
            valid &= (np.diff(rows, axis=-1) > 0).all(axis=-1)
        clipped = np.clip(rows, 0, self.num_experts - 1)
        code = np.zeros(rows.shape[:-1], dtype=np.int64)
        for k in range(1, self.top_k + 1):
            code += self.table[k][clipped[..., k - 1]]
        valid &= code < self.period * self.num_layers * self.symbols
        code = np.where(valid, code, 0)
        symbol = code % self.symbols
        rest = code // self.symbols
        return DecodedRows(valid, rest // self.num_layers, rest % self.num_layers, symbol)

    def marker(self) -> dict[str, Any]:
        return marker(self)


def marker(code: VerificationCode) -> dict[str, Any]:
    """The ``metadata["verification"]`` value of a record written with ``code``."""
    return {"scheme": SCHEME, "ranks": code.ranks, "period": code.period}


def verification_of(record: Any) -> dict[str, Any] | None:
    """The record's verification marker, or None for a record of real routing."""
    metadata = getattr(record, "metadata", None)
    value = metadata.get(MARKER_KEY) if isinstance(metadata, dict) else None
    return value if isinstance(value, dict) else ({"scheme": str(value)} if value is not None else None)


def is_verification_record(record: Any) -> bool:
    """Whether ``record`` was written in verification mode (its ids are not routing)."""
    return verification_of(record) is not None


def refuse_for_training(record: Any) -> None:
    """RecordError for a verification record: its ids are a test pattern, not routing."""
    if is_verification_record(record):
        raise RecordError(
            f"record {getattr(record, 'rollout_id', '?')!r} was written in verification mode "
            "(capture.verify, fd-rr selftest): its expert ids are a test pattern, not the "
            "rollout's routing, and must not be replayed; turn capture.verify off for rollouts")


_WARNED: set[str] = set()


def warn_once(record: Any) -> None:
    """Log one WARNING per process the first time a verification record is read."""
    if is_verification_record(record) and "read" not in _WARNED:
        _WARNED.add("read")
        logger.warning("routing replay: record %r is a verification record (capture.verify): "
                       "its ids are a test pattern, not routing; trainer adapters refuse it",
                       getattr(record, "rollout_id", "?"))
