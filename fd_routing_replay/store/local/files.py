"""What both local layouts share: how an ``OSError`` on a record file becomes a store error.

One rule for both layouts, so the writer retries (or spills) the same conditions whether
records go into our prefix-bucket tree or into FastDeploy's own ``.pdtensor`` files.
"""

from __future__ import annotations

import errno
from pathlib import Path

from fd_routing_replay.errors import PermanentStoreError, StoreError, TransientStoreError

TRANSIENT_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EROFS, errno.EIO,
                              errno.EAGAIN, errno.ENOENT, errno.EDQUOT, errno.ENOTDIR})
"""Conditions an operator can fix (permissions, full or read-only disk, a path that is
briefly not a directory): transient, so the writer retries, then spills."""


def store_error(action: str, path: Path, exc: OSError) -> StoreError:
    """The store error for ``exc`` raised while trying to ``action`` ``path``."""
    cls = TransientStoreError if exc.errno in TRANSIENT_ERRNOS else PermanentStoreError
    return cls(f"local store: cannot {action} {path}: {exc.strerror or exc}")
