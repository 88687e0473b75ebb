"""What the soak's producers submit: rollout ids, the size mix, and records generated from
the rollout id alone, so any reader checks every byte without asking anyone.

Rollout ids are ``{run}_s{step}_p{producer}{kind}_r{rollout}:{turn}:0``: the training step
(the time slot in which the rollout started, :func:`schedule`) is the first component after
the run tag, so the driver deletes a finished step with the boundary-safe prefix
``{run}_s{step}`` (never ``{run}_s{step}0``).  ``kind`` is one letter:

* ``a``: single-turn rollouts, plain encoding;
* ``m``: multi-turn rollouts (``only_last_turn``), plain;
* ``e``: single-turn, ``set`` encoding;
* ``x``: multi-turn and ``set``.

The size mix: a rollout's first turn has prompt + response tokens drawn log-uniformly
from 1k to 32k, each later turn adds 256-4,096 tokens (capped at 32k); 48-60 MoE layers;
top-8; 64, 128 or 160 experts; uint8 ids.  A record is 0.4-15.7 MB, 3.9 MB on average.

Ids: each row (one token in one layer) is ``base + offsets``, with a random ``base`` below
``experts - experts // 2`` per row and 8 distinct ``offsets`` below ``experts // 2`` per
record.  Plain records keep the offsets in a random order (a writer that reorders a row
is caught); set-encoded records are generated ascending, which is how the set encoding
returns them.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["KINDS", "MAX_TOKENS", "MIN_TOKENS", "RecordSpec", "SlicePlan", "base_of",
           "expected_ids", "make_ids", "owner_of", "parse_rollout", "rollout_id", "schedule",
           "slice_plan", "spec_for", "step_prefix"]

TOP_K = 8
MIN_TOKENS, MAX_TOKENS = 1024, 32768
MIN_LAYERS, MAX_LAYERS = 48, 60
EXPERT_CHOICES = (64, 128, 160)
TURN_GROWTH = (256, 4096)

KINDS = {"a": (False, "plain"), "m": (True, "plain"), "e": (False, "set"), "x": (True, "set")}
"""kind letter -> (multi-turn with only_last_turn, encoding)."""

_ID = re.compile(r"(?P<run>[A-Za-z0-9]+)_s(?P<step>\d+)_p(?P<producer>\d+)(?P<kind>[amex])"
                 r"_r(?P<rollout>\d+):(?P<turn>\d+):0")


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def rollout_id(run: str, step: int, producer: int, kind: str, rollout: int, turn: int) -> str:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    if not run.isalnum():
        raise ValueError(f"run tag must be alphanumeric, got {run!r}")
    return f"{run}_s{step}_p{producer}{kind}_r{rollout}:{turn}:0"


def step_prefix(run: str, step: int) -> str:
    """The boundary-safe prefix of every record of one training step."""
    return f"{run}_s{step}"


def schedule(run: str, producer: int, kind: str, turns: int, step_now: Callable[[], int]):
    """The producer's records in submission order: ``(step, rollout id)``, forever.
    Multi-turn kinds submit ``turns`` turns of a rollout one after another.  A rollout
    belongs to the training step ``step_now()`` says when it starts (never an earlier one
    than the last rollout's): every producer moves through the steps at the same pace
    whatever its records' sizes and turns, as engines sharing an RL step do."""
    multi = KINDS[kind][0]
    rollout = step = 0
    while True:
        step = max(step, step_now())
        for turn in range(turns if multi else 1):
            yield step, rollout_id(run, step, producer, kind, rollout, turn)
        rollout += 1


@dataclass(frozen=True)
class Rollout:
    run: str
    step: int
    producer: int
    kind: str
    rollout: int
    turn: int

    @property
    def base(self) -> str:
        return f"{self.run}_s{self.step}_p{self.producer}{self.kind}_r{self.rollout}"

    @property
    def multi_turn(self) -> bool:
        return KINDS[self.kind][0]

    @property
    def encoding(self) -> str:
        return KINDS[self.kind][1]


def parse_rollout(rid: str) -> Rollout:
    match = _ID.fullmatch(rid)
    if match is None:
        raise ValueError(f"not a soak rollout id: {rid!r}")
    g = match.groupdict()
    return Rollout(g["run"], int(g["step"]), int(g["producer"]), g["kind"], int(g["rollout"]),
                   int(g["turn"]))


def base_of(rid: str) -> str:
    return parse_rollout(rid).base


def owner_of(rid: str, trainers: int) -> int:
    """Which of ``trainers`` trainer processes reads ``rid`` (every turn of a rollout goes
    to the same one)."""
    return _hash("owner:" + base_of(rid)) % trainers


@dataclass(frozen=True)
class RecordSpec:
    """Everything about one record that follows from its rollout id."""

    rollout_id: str
    layers: int
    tokens: int
    num_experts: int
    ascending: bool
    top_k: int = TOP_K

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.layers, self.tokens, self.top_k)

    @property
    def nbytes(self) -> int:
        return self.layers * self.tokens * self.top_k


def spec_for(rid: str) -> RecordSpec:
    """The record of ``rid``: geometry from its base (turns of a rollout agree on layers and
    experts and grow in tokens), content seeded by the whole id."""
    rollout = parse_rollout(rid)
    h = _hash(rollout.base)
    layers = MIN_LAYERS + h % (MAX_LAYERS - MIN_LAYERS + 1)
    experts = EXPERT_CHOICES[(h >> 8) % len(EXPERT_CHOICES)]
    unit = ((h >> 16) & 0xFFFFFF) / float(1 << 24)
    first = int(math.exp(math.log(MIN_TOKENS) + unit * math.log(MAX_TOKENS / MIN_TOKENS)))
    growth = TURN_GROWTH[0] + (h >> 40) % (TURN_GROWTH[1] - TURN_GROWTH[0] + 1)
    tokens = min(MAX_TOKENS, max(MIN_TOKENS, first + rollout.turn * growth))
    return RecordSpec(rid, layers, tokens, experts, ascending=rollout.encoding == "set")


def make_ids(spec: RecordSpec) -> np.ndarray:
    """The ``[layers, tokens, top_k]`` uint8 ids of ``spec`` (deterministic; see the module
    docstring).  Every row holds ``top_k`` distinct expert ids below ``num_experts``."""
    if spec.top_k != 8:
        raise ValueError(f"the generator packs 8 ids per row into one uint64, got top_k {spec.top_k}")
    rng = np.random.default_rng(_hash(spec.rollout_id))
    half = spec.num_experts // 2
    offsets = rng.choice(half, size=spec.top_k, replace=False).astype(np.uint8)
    if spec.ascending:
        offsets.sort()
    rows = spec.layers * spec.tokens
    # base + offsets for 8 lanes at once: each lane's sum stays below 256, so no carry
    # crosses a lane (about 1.6 GB/s here; generating must not be what limits a soak)
    lanes = rng.integers(0, spec.num_experts - half, size=rows, dtype=np.uint64)
    lanes *= np.uint64(0x0101010101010101)
    lanes += offsets.view(np.uint64)[0]
    return lanes.view(np.uint8).reshape(spec.shape)


@dataclass(frozen=True)
class SlicePlan:
    """What a trainer rank reads of a record: its pipeline stage's layers and its
    context-parallel chunk of the tokens."""

    layers: tuple[int, ...]
    tokens: slice


def slice_plan(rid: str, stages: int = 4, chunks: int = 4) -> SlicePlan | None:
    """None: read the record whole (``get``); else the slice to read (``get_slice``).
    Half the records are read each way."""
    spec = spec_for(rid)
    h = _hash("slice:" + rid)
    if h & 1:
        return None
    stage, chunk = (h >> 1) % stages, (h >> 8) % chunks
    first, last = stage * spec.layers // stages, (stage + 1) * spec.layers // stages
    start, stop = chunk * spec.tokens // chunks, (chunk + 1) * spec.tokens // chunks
    return SlicePlan(tuple(range(first, last)), slice(start, stop))


def expected_ids(rid: str, plan: SlicePlan | None = None) -> np.ndarray:
    """What a read of ``rid`` (whole, or sliced by ``plan``) must return."""
    ids = make_ids(spec_for(rid))
    if plan is None:
        return ids
    return np.ascontiguousarray(ids[list(plan.layers), plan.tokens])
