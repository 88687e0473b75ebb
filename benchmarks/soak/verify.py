"""Checks a record a trainer read against what the generator says it must be.

The reader already checks the format, the rollout id and (``get``) the payload checksum;
this compares every id, the geometry and the expert count with
:func:`~benchmarks.soak.workload.expected_ids`, so a record that is well-formed but holds
the wrong bytes (another rollout's, another version's, shifted rows) is caught too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.soak.workload import SlicePlan, expected_ids, spec_for

__all__ = ["problem_with"]


def problem_with(record: Any, rid: str, plan: SlicePlan | None = None, *,
                 experts_stored: bool = True) -> str | None:
    """Why ``record`` (a ``RoutingRecord`` from ``get`` or ``get_slice(plan)``) is not the
    record of ``rid``; None when it is, byte for byte.  ``experts_stored=False`` for
    FastDeploy's formats, which do not store the expert count."""
    if record is None:
        return "no record"
    if record.rollout_id != rid:
        return f"rollout id {record.rollout_id!r}, expected {rid!r}"
    spec = spec_for(rid)
    if experts_stored and record.num_experts != spec.num_experts:
        return f"num_experts {record.num_experts}, expected {spec.num_experts}"
    ids = np.asarray(record.ids)
    want = expected_ids(rid, plan)
    if ids.dtype != want.dtype or ids.shape != want.shape:
        return f"ids {ids.dtype}{list(ids.shape)}, expected {want.dtype}{list(want.shape)}"
    if plan is not None and tuple(record.layer_map) != plan.layers:
        return f"layer map {list(record.layer_map)[:4]}..., expected {list(plan.layers)[:4]}..."
    if not np.array_equal(ids, want):
        bad = np.argwhere(ids != want)
        first = tuple(int(v) for v in bad[0])
        return (f"{len(bad)} of {want.size} ids differ, first at {list(first)}: "
                f"{int(ids[first])} instead of {int(want[first])}")
    return None
