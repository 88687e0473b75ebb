"""Where each writer keeps its journal and dead letters: one directory per rank.

Every writer locks its journal directory (:class:`~fd_routing_replay.writer.journal.
DirectoryLock`), and in FastDeploy every DP rank of an EP+DP deployment and every tp=1
server on a node runs its own writer.  So the directories are per rank, and never
relative to the engine's working directory (templates and placeholders:
:mod:`fd_routing_replay.core.paths`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from fd_routing_replay.core.paths import (
    LOCAL_STATE_DIR,
    RankIdentity,
    expand_template,
    state_dir,
)

__all__ = ["WriterDirectories", "resolve_writer_directories"]


class WriterDirectories(NamedTuple):
    """The absolute journal and dead-letter directories of one writer."""

    journal: Path
    dead_letter: Path


def _local_root(store_config: Any) -> Path | None:
    """The local store's root (absolute) when ``store_config`` selects it, else None."""
    from fd_routing_replay.store.registry import store_type_of

    if store_type_of(store_config) != "local":
        return None
    from fd_routing_replay.store.local import open_local_store

    return open_local_store(store_config).root  # builds paths only: no I/O


def resolve_writer_directories(store_config: Any, writer_config: Any,
                               identity: RankIdentity | None = None,
                               env: Mapping[str, str] | None = None) -> WriterDirectories:
    """Expand (or derive) ``writer.journal_dir`` and ``writer.dead_letter_dir`` for one rank."""
    rank = (identity or RankIdentity()).resolved(env)
    namespace = store_config.namespace
    values = rank.placeholder_values(namespace)
    root = _local_root(store_config)
    base = root / LOCAL_STATE_DIR if root is not None else state_dir(env)
    out = []
    for key, kind in (("journal_dir", "journal"), ("dead_letter_dir", "dead_letter")):
        template = getattr(writer_config, key)
        if template:
            text = expand_template(template, values, f"writer.{key}")
            path = Path(os.path.abspath(os.path.expanduser(text)))
        else:
            path = base / namespace / kind / rank.label()
        out.append(path)
    return WriterDirectories(*out)
