"""Python face of the routing custom ops: capture, offload, pack, clear.

The compiled ops of custom_ops/ when they load, else their NumPy reference (CPU tensors
only), with one warning that says why (``FD_RR_OPS=reference|compiled`` forces either).
Arguments are validated before any op runs; every problem is an ``OpsError`` naming
the argument.  See docs/ops.md.
"""

from __future__ import annotations

from fd_routing_replay.ops.backend import bound_backend, ops_backend, ops_backend_reason
from fd_routing_replay.ops.dtypes import fill_value, routing_dtype
from fd_routing_replay.ops.step import (
    bind_step_flush,
    bind_step_ledger,
    bind_step_recorder,
    count_unrouted,
    new_step_buffer,
    plan_step,
    record_rows,
    request_packer,
    scatter_rows,
)
from fd_routing_replay.ops.table import (
    SMALL_PACK_BYTES,
    clear_routing_rows,
    gather_routing_rows,
    new_routing_table,
    pack_routing,
    record_routing,
)

__all__ = [
    "SMALL_PACK_BYTES",
    "bind_step_flush",
    "bind_step_ledger",
    "bind_step_recorder",
    "bound_backend",
    "clear_routing_rows",
    "count_unrouted",
    "fill_value",
    "gather_routing_rows",
    "new_routing_table",
    "new_step_buffer",
    "ops_backend",
    "ops_backend_reason",
    "pack_routing",
    "plan_step",
    "record_routing",
    "record_rows",
    "request_packer",
    "routing_dtype",
    "scatter_rows",
]
