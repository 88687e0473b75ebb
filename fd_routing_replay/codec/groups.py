"""Expert groups: per-modality experts sharing one record's id space (ERNIE-4.5-VL).

A model whose MoE layers route text tokens and image tokens through separate experts
(ERNIE-4.5-VL: a text MoE and an image MoE per decoder layer) is recorded with one id space:
the image experts' ids follow the text experts' (``[0, text)`` then ``[text, text + image)``,
the ``expert_id_offset`` FastDeploy gives the image MoE).  The record's metadata names the
groups, ``"expert_groups": [{"name": "text", "first": 0, "count": 64}, {"name": "image",
"first": 64, "count": 64}]``, and ``num_experts`` (``ne``) is their sum; a token's row in a
layer belongs to the group its ids fall in.  docs/record-format.md, "Expert groups".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fd_routing_replay.errors import RecordError

__all__ = ["METADATA_KEY", "ExpertGroup", "expert_groups", "group_named"]

METADATA_KEY = "expert_groups"


@dataclass(frozen=True)
class ExpertGroup:
    """One group's experts: ids ``first .. first + count - 1`` of the record."""

    name: str
    first: int
    count: int

    def holds(self, ids: np.ndarray) -> np.ndarray:
        """Per row of ``ids`` ``[..., K]``: all K ids are this group's."""
        return ((ids >= self.first) & (ids < self.first + self.count)).all(axis=-1)


def expert_groups(record: Any) -> tuple[ExpertGroup, ...]:
    """The record's expert groups (empty when it has one id space of plain experts).

    RecordError when ``metadata["expert_groups"]`` is malformed: not a list of
    ``{"name", "first", "count"}`` with unique non-empty names, groups not contiguous from 0,
    or not covering exactly the record's ``num_experts``."""
    metadata = getattr(record, "metadata", None) or {}
    raw = metadata.get(METADATA_KEY) if isinstance(metadata, dict) else None
    if raw is None:
        return ()
    rid = getattr(record, "rollout_id", "?")
    if not isinstance(raw, (list, tuple)) or len(raw) < 2:
        raise RecordError(f"record {rid!r}: {METADATA_KEY} must be a list of at least two groups, got {raw!r}")
    groups, names, start = [], set(), 0
    for entry in raw:
        if not isinstance(entry, dict) or set(entry) != {"name", "first", "count"}:
            raise RecordError(f"record {rid!r}: {METADATA_KEY} entry {entry!r} is not "
                              "{'name', 'first', 'count'}")
        name, first, count = entry["name"], entry["first"], entry["count"]
        if not isinstance(name, str) or not name or name in names:
            raise RecordError(f"record {rid!r}: {METADATA_KEY} has a missing or repeated name {name!r}")
        if any(not isinstance(v, int) or isinstance(v, bool) for v in (first, count)) or count <= 0 or first != start:
            raise RecordError(f"record {rid!r}: {METADATA_KEY} group {name!r} must start at {start} with a "
                              f"positive count, got first={first!r} count={count!r}")
        names.add(name)
        groups.append(ExpertGroup(name, first, count))
        start = first + count
    experts = getattr(record, "num_experts", start)
    if start != experts:
        raise RecordError(f"record {rid!r}: {METADATA_KEY} cover {start} experts, the record has {experts}")
    return tuple(groups)


def group_named(record: Any, name: str) -> ExpertGroup:
    """The record's group ``name``; ValueError naming the groups it has (or that it has none)."""
    groups = expert_groups(record)
    for group in groups:
        if group.name == name:
            return group
    have = [g.name for g in groups]
    raise ValueError(f"record {getattr(record, 'rollout_id', '?')!r} has no expert group {name!r}"
                     + (f"; its groups are {have}" if have else ": its experts are one group"))
