"""``fd-rr``: inspect and manage stored routing records from a shell.

The console script ``fd-rr`` is :func:`main` (``python -m fd_routing_replay.cli`` runs it
too); the command table and the parser live in :mod:`fd_routing_replay.cli.app`.
"""

from __future__ import annotations

from fd_routing_replay.cli.app import main

__all__ = ["main"]
