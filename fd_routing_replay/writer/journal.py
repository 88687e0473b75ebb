"""What a writer keeps on disk for later: the journal, the dead letters, and their directories.

One operation is one *entry* named ``{seq:020d}.{sub}`` (``seq`` is the writer's global
submission number, ``sub`` 1 marks a follow-up delete the writer generated):

* ``NAME.rr`` -- the record as submitted, in our own ``rr-v1`` format; only for puts (the writer
  builds the stored record from it when it replays the entry);
* ``NAME.json`` -- the sidecar: :meth:`Operation.sidecar
  <fd_routing_replay.writer.operation.Operation.sidecar>`, checked on reading by
  :func:`~fd_routing_replay.writer.operation.check_sidecar`.

Every file is written atomically (temporary file + ``os.replace``) and the sidecar is written
last, so an entry exists exactly when its sidecar does; a lone ``.rr`` is debris from a crash
and is removed at start.  Entries are replayed in ``(seq, sub)`` order, which is submission
order.  Nothing is pickled.  Dead letters use the same two files plus ``NAME.reason``
(human-readable) and the error in the sidecar; ``fd-rr dead-letters replay`` submits them to a
writer again.

Each writer locks its journal directory (:class:`DirectoryLock`), and in FastDeploy every DP
rank of an EP+DP deployment and every tp=1 server on a node runs its own writer, so the
directories are per rank (:func:`resolve_writer_directories`), never relative to the engine's
working directory (templates and placeholders: :mod:`fd_routing_replay.core.paths`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from fd_routing_replay.core.files import TEMP_PREFIX, atomic_write
from fd_routing_replay.core.paths import (
    LOCAL_STATE_DIR,
    RankIdentity,
    expand_template,
    state_dir,
)
from fd_routing_replay.errors import ConfigError, RecordError
from fd_routing_replay.writer.operation import check_sidecar

__all__ = ["DeadLetters", "DirectoryLock", "Journal", "JournalEntry", "WriterDirectories",
           "atomic_write", "entry_name", "parse_entry_name", "resolve_writer_directories"]


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


Buffer = bytes | bytearray | memoryview


RECORD_SUFFIX = ".rr"


OP_SUFFIX = ".json"


REASON_SUFFIX = ".reason"


LOCK_FILE = ".lock"


_ENTRY_RE = re.compile(r"(\d{20})\.(\d+)(-[0-9a-f]{8})?", re.ASCII)


def entry_name(seq: int, sub: int = 0) -> str:
    """The file stem of operation ``seq`` (``sub`` > 0 for writer-generated follow-ups)."""
    return f"{seq:020d}.{sub}"


@dataclass(frozen=True, order=True)
class JournalEntry:
    """One journal entry; sorts in replay order."""

    seq: int
    sub: int
    name: str = field(compare=True)


def parse_entry_name(stem: str) -> JournalEntry | None:
    match = _ENTRY_RE.fullmatch(stem)
    if match is None:
        return None
    return JournalEntry(int(match.group(1)), int(match.group(2)), stem)


def _json_bytes(op: dict[str, Any]) -> bytes:
    return json.dumps(op, sort_keys=True, ensure_ascii=False).encode("utf-8")


def _complete_entries(directory: Path) -> list[JournalEntry]:
    """Entries of ``directory`` that have their sidecar (so are complete), in order."""
    entries = []
    for name in os.listdir(directory):
        if name.endswith(OP_SUFFIX) and not name.startswith("."):
            entry = parse_entry_name(name[: -len(OP_SUFFIX)])
            if entry is not None:
                entries.append(entry)
    entries.sort()
    return entries


class Journal:
    """The spill directory of one writer (see the module docstring for the layout)."""

    def __init__(self, directory: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.directory = Path(directory).expanduser().absolute()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync

    def _path(self, name: str, suffix: str) -> Path:
        return self.directory / f"{name}{suffix}"

    def write(self, name: str, op: dict[str, Any], parts: Sequence[Buffer] | None = None) -> None:
        """Add entry ``name``: the record (when ``parts``) first, then the sidecar."""
        if parts is not None:
            atomic_write(self._path(name, RECORD_SUFFIX), parts, fsync=self.fsync)
        atomic_write(self._path(name, OP_SUFFIX), [_json_bytes(op)], fsync=self.fsync)

    def scan(self) -> list[JournalEntry]:
        """Every complete entry (one with a sidecar), in replay order."""
        return _complete_entries(self.directory)

    def exists(self, entry: JournalEntry) -> bool:
        return self._path(entry.name, OP_SUFFIX).exists()

    def load_op(self, entry: JournalEntry) -> dict[str, Any]:
        """The entry's sidecar; RecordError when it is unreadable or malformed."""
        path = self._path(entry.name, OP_SUFFIX)
        try:
            op = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise
        except (OSError, ValueError) as exc:
            raise RecordError(f"journal sidecar {path} is unreadable: {exc}") from exc
        return check_sidecar(op, str(path))

    def read_record(self, entry: JournalEntry) -> bytes:
        """The entry's record bytes; RecordError when the file is missing."""
        path = self._path(entry.name, RECORD_SUFFIX)
        try:
            return path.read_bytes()
        except FileNotFoundError as exc:
            raise RecordError(f"journal record file {path} is missing") from exc

    def remove(self, entry: JournalEntry) -> None:
        """Drop an applied entry: sidecar first, so a crash in between leaves only debris."""
        for suffix in (OP_SUFFIX, RECORD_SUFFIX):
            try:
                self._path(entry.name, suffix).unlink()
            except FileNotFoundError:
                pass

    def remove_debris(self) -> int:
        """Delete record files without a sidecar and temporary files; return how many.

        Only safe while no one else writes the journal (the writer holds its lock and has
        not started its worker yet).
        """
        removed = 0
        names = set(os.listdir(self.directory))
        for name in names:
            debris = name.startswith(TEMP_PREFIX) or (
                name.endswith(RECORD_SUFFIX)
                and f"{name[: -len(RECORD_SUFFIX)]}{OP_SUFFIX}" not in names)
            if debris:
                try:
                    os.unlink(self.directory / name)
                    removed += 1
                except OSError:
                    pass
        return removed

    def max_seq(self) -> int:
        """The largest ``seq`` of any entry (0 when empty)."""
        entries = self.scan()
        return entries[-1].seq if entries else 0


class DeadLetters:
    """Operations the store rejected for good, each with the reason (never deleted here)."""

    def __init__(self, directory: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.directory = Path(directory).expanduser().absolute()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync

    def _free_stem(self, name: str) -> str:
        if not (self.directory / f"{name}{OP_SUFFIX}").exists():
            return name
        return f"{name}-{uuid.uuid4().hex[:8]}"

    def add(self, name: str, op: dict[str, Any], reason: str, *,
            error: BaseException | None = None, parts: Sequence[Buffer] | None = None,
            record_file: Path | None = None) -> Path:
        """File one dead letter; the record comes from ``parts`` or is moved from
        ``record_file``.  Returns the sidecar's path."""
        stem = self._free_stem(name)
        if parts is not None:
            atomic_write(self.directory / f"{stem}{RECORD_SUFFIX}", parts, fsync=self.fsync)
        elif record_file is not None and record_file.exists():
            shutil.move(str(record_file), self.directory / f"{stem}{RECORD_SUFFIX}")
        sidecar = dict(op)
        sidecar.update({"reason": reason, "failed_at": time.time()})
        if error is not None:
            sidecar["error_type"] = type(error).__name__
            sidecar["error"] = str(error)
        text = f"{reason}\n"
        if error is not None:
            text += f"{type(error).__name__}: {error}\n"
        atomic_write(self.directory / f"{stem}{REASON_SUFFIX}", [text.encode("utf-8")],
                     fsync=self.fsync)
        path = self.directory / f"{stem}{OP_SUFFIX}"
        atomic_write(path, [_json_bytes(sidecar)], fsync=self.fsync)
        return path

    def adopt(self, journal: Journal, entry: JournalEntry, op: dict[str, Any] | None,
              reason: str, error: BaseException | None = None) -> Path:
        """Move a journal entry here (its record file too), recording why."""
        sidecar = op if op is not None else {"op": "unknown", "journal_entry": entry.name}
        path = self.add(entry.name, sidecar, reason, error=error,
                        record_file=journal.directory / f"{entry.name}{RECORD_SUFFIX}")
        journal.remove(entry)
        return path

    def count(self) -> int:
        return len(self.names())

    def names(self) -> list[str]:
        """The stem of every dead letter (one with a sidecar), oldest first."""
        return [entry.name for entry in _complete_entries(self.directory)]

    def path(self, name: str, suffix: str) -> Path:
        """``NAME{suffix}`` in this directory; ValueError for a name that is no entry's."""
        if parse_entry_name(name) is None:
            raise ValueError(f"{name!r} is not a dead-letter name (expected "
                             f"{{seq:020d}}.{{sub}}, as listed by 'fd-rr dead-letters ls')")
        return self.directory / f"{name}{suffix}"

    def load(self, name: str) -> dict[str, Any]:
        """The sidecar of dead letter ``name`` (FileNotFoundError when there is none;
        RecordError when it is not JSON)."""
        path = self.path(name, OP_SUFFIX)
        try:
            op = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise
        except (OSError, ValueError) as exc:
            raise RecordError(f"dead-letter sidecar {path} is unreadable: {exc}") from exc
        if not isinstance(op, dict):
            raise RecordError(f"dead-letter sidecar {path} is not a JSON object")
        return op

    def update(self, name: str, sidecar: dict[str, Any], reason: str,
               error: str | None = None) -> None:
        """Rewrite the sidecar and ``.reason`` of ``name`` (a replay that failed again)."""
        text = f"{reason}\n" + (f"{error}\n" if error else "")
        atomic_write(self.path(name, REASON_SUFFIX), [text.encode("utf-8")], fsync=self.fsync)
        atomic_write(self.path(name, OP_SUFFIX), [_json_bytes(sidecar)], fsync=self.fsync)

    def remove(self, name: str) -> None:
        """Delete dead letter ``name``: sidecar first (so it stops being an entry), then
        its record and its ``.reason``."""
        for suffix in (OP_SUFFIX, RECORD_SUFFIX, REASON_SUFFIX):
            try:
                self.path(name, suffix).unlink()
            except FileNotFoundError:
                pass


class DirectoryLock:
    """An exclusive ``flock`` on ``directory/.lock``: one writer per journal directory.

    The writer process inherits the descriptor, so the lock holds until both the engine
    side and its writer process are gone (a new writer cannot replay a journal an old
    writer process is still appending to).
    """

    def __init__(self, directory: Path, config_key: str = "writer.journal_dir") -> None:
        self.path = directory / LOCK_FILE
        self.config_key = config_key
        self.fd: int | None = None

    def acquire(self, timeout_s: float) -> None:
        """Take the lock, waiting up to ``timeout_s``; ConfigError naming the key if busy."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    os.close(fd)
                    raise
                if time.monotonic() >= deadline:
                    holder = ""
                    try:
                        holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
                    except OSError:
                        pass
                    os.close(fd)
                    raise ConfigError(
                        f"{self.config_key}: {self.path.parent} is in use by another routing "
                        f"writer (pid {holder or '?'}); every writer needs its own "
                        f"{self.config_key}: give each rank its own rank identity (dp_rank, "
                        f"tp_rank, device_id) or put placeholders such as {{dp_rank}} and "
                        f"{{device_id}} in {self.config_key}") from None
                time.sleep(delay)  # waiting for another process to let go; not test sync
                delay = min(delay * 2, 0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode("ascii"), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            finally:
                os.close(self.fd)
                self.fd = None
