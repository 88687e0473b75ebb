"""Python face of the compiled routing ops: the step buffer, its recorder and offload, the
per-step host bookkeeping and the pack of a finished request.

One implementation, the library built from custom_ops/ (ahead of time by ``make ops``, else
just in time on first use).  Every argument is checked once, in the library; every problem
is an ``OpsError`` naming the argument, and a library that did not load is an ``OpsError``
naming why at the first ``bind_*`` / ``request_packer`` call.  See docs/ops.md.
"""

from __future__ import annotations

from fd_routing_replay.ops.backend import ops_backend, ops_backend_reason
from fd_routing_replay.ops.dtypes import fill_value, routing_dtype
from fd_routing_replay.ops.step import (
    bind_step_flush,
    bind_step_ledger,
    bind_step_recorder,
    new_step_buffer,
    request_packer,
)

__all__ = [
    "bind_step_flush",
    "bind_step_ledger",
    "bind_step_recorder",
    "fill_value",
    "new_step_buffer",
    "ops_backend",
    "ops_backend_reason",
    "request_packer",
    "routing_dtype",
]
