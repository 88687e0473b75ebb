"""All-or-nothing file writes, shared by the local store and the writer's journal."""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from pathlib import Path

TEMP_PREFIX = ".tmp-"

Buffer = bytes | bytearray | memoryview


def atomic_write(path: Path, parts: Sequence[Buffer], *, fsync: bool = False) -> None:
    """Write the concatenation of ``parts`` to ``path``: a temporary file in the same
    directory, then ``os.replace``.  Readers see the old file or the new one, never a
    torn one; on failure the temporary file is removed.  With ``fsync`` the file and its
    directory are flushed to disk before returning.
    """
    temp = path.with_name(f"{TEMP_PREFIX}{uuid.uuid4().hex}")
    try:
        with open(temp, "wb") as handle:
            for part in parts:
                handle.write(part)
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        try:
            temp.unlink()
        except OSError:
            pass
        raise
    if fsync:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
