"""``LocalStore``, the local store's tree layout: one file per record in prefix buckets.

Layout under ``{root}/{namespace}/``: a key is split into its components at the ``:``
and ``_`` separators (:func:`fd_routing_replay.keys.key_components`); each component is a
directory and the record is the file ``@`` in the key's directory::

    exp_a_7:0:1  ->  +exp/_a/_7/:0/:1/@

The first component gets a ``+`` so no name can be ``.`` or clash with the record file,
and components longer than 200 bytes continue in ``~`` directories.  A boundary-safe
prefix is always a leading run of components, so ``delete_prefix`` removes one subtree:
its cost follows the matched keys, never the total.  Writes are atomic (temp file in the
same directory, then ``os.replace``), optionally fsynced.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from fd_routing_replay.core.files import atomic_write
from fd_routing_replay.errors import PermanentStoreError
from fd_routing_replay.keys import (
    NAMESPACE_PATTERN,
    SEPARATORS,
    check_key,
    check_prefix,
    key_components,
)
from fd_routing_replay.store.base import Buffer, RoutingStore
from fd_routing_replay.store.local.files import store_error

RECORD_FILE = "@"
FIRST_MARK = "+"
CONTINUATION_MARK = "~"
MAX_NAME_BYTES = 200


def _component_names(components: Sequence[str]) -> list[str]:
    """Directory names for key components (first marked, long ones split)."""
    names: list[str] = []
    for index, component in enumerate(components):
        name = (FIRST_MARK + component) if index == 0 else component
        raw = name.encode("utf-8")
        if len(raw) <= MAX_NAME_BYTES:
            names.append(name)
            continue
        chunks = _split_utf8(raw, MAX_NAME_BYTES)
        names.append(chunks[0])
        names.extend(CONTINUATION_MARK + chunk for chunk in chunks[1:])
    return names


def _split_utf8(raw: bytes, size: int) -> list[str]:
    """Split UTF-8 bytes into decodable chunks of at most ``size`` bytes."""
    chunks, start = [], 0
    while start < len(raw):
        end = min(start + size, len(raw))
        while end < len(raw) and (raw[end] & 0xC0) == 0x80:  # never cut inside a char
            end -= 1
        chunks.append(raw[start:end].decode("utf-8"))
        start = end
    return chunks


def _name_to_text(name: str, is_first: bool) -> str:
    if name.startswith(CONTINUATION_MARK):
        return name[1:]
    if is_first:
        return name[1:] if name.startswith(FIRST_MARK) else name
    return name


class FileRangeView:
    """Byte ranges of one open record file: ``size`` from ``fstat``, ``pread`` per range
    (never asking for more than the file holds, whatever the range says)."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd = fd
        self._path = path
        try:
            self.size = os.fstat(fd).st_size
        except OSError as exc:
            os.close(fd)
            raise store_error("read", path, exc) from exc

    def read(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        try:
            return [os.pread(self._fd, max(min(length, self.size - offset), 0), offset)
                    for offset, length in ranges]
        except OSError as exc:
            raise store_error("read", self._path, exc) from exc

    def unchanged(self) -> bool:
        return True                             # one open file is one version

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __enter__(self) -> FileRangeView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalStore(RoutingStore):
    """Files under ``root/namespace``; safe for many threads and processes at once."""

    scheme = "local"

    def __init__(self, root: str | os.PathLike[str], namespace: str = "routing_replay",
                 *, fsync: bool = False) -> None:
        super().__init__(namespace)
        self.root = Path(root).expanduser().absolute()
        self.base = self.root / self.namespace
        self.fsync = fsync
        self._local = threading.local()

    # -- paths ------------------------------------------------------------------------
    def _dir_for(self, text: str) -> Path:
        path = self.base.joinpath(*_component_names(key_components(text)))
        # Defence in depth: check_key already forbids every escape.
        if os.path.commonpath([self.base, path]) != str(self.base):
            raise PermanentStoreError(f"local store: key {text!r} maps outside {self.base}")
        return path

    def _key_of(self, directory: Path) -> str:
        names = directory.relative_to(self.base).parts
        return "".join(_name_to_text(n, i == 0) for i, n in enumerate(names))

    # -- interface ----------------------------------------------------------------------
    def put(self, key: str, value: Buffer) -> None:
        self.put_parts(key, (value,))

    def put_parts(self, key: str, parts: Sequence[Buffer]) -> None:
        directory = self._dir_for(check_key(key))
        for attempt in range(3):  # a concurrent delete may prune the directory under us
            try:
                directory.mkdir(parents=True, exist_ok=True)
                atomic_write(directory / RECORD_FILE, parts, fsync=self.fsync)
                return
            except FileNotFoundError:
                if attempt == 2:
                    raise
            except OSError as exc:
                raise store_error("write", directory / RECORD_FILE, exc) from exc

    def get(self, key: str) -> bytes | None:
        path = self._dir_for(check_key(key)) / RECORD_FILE
        try:
            with open(path, "rb") as handle:
                return handle.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise store_error("read", path, exc) from exc

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes] | None:
        """``(offset, length)`` byte ranges of the value under ``key`` (one open, one
        ``pread`` each; a range past the end comes back short); None when absent."""
        view = self.open_ranges(key)
        if view is None:
            return None
        with view:
            return view.read(ranges)

    def open_ranges(self, key: str) -> FileRangeView | None:
        """The value under ``key`` opened once, to read byte ranges from (``size``, ``read``,
        ``unchanged``; a context manager), None when absent.  A put replaces the
        file (``os.replace``), so one open file is one version: sliced reads read the
        header and then the wanted rows from it."""
        path = self._dir_for(check_key(key)) / RECORD_FILE
        try:
            return FileRangeView(os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)),
                                 path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise store_error("read", path, exc) from exc

    def exists(self, key: str) -> bool:
        return (self._dir_for(check_key(key)) / RECORD_FILE).is_file()

    def delete(self, keys: Iterable[str]) -> int:
        removed = 0
        for key in self._keys(keys):
            directory = self._dir_for(key)
            try:
                (directory / RECORD_FILE).unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise store_error("delete", directory / RECORD_FILE, exc) from exc
            removed += 1
            self._prune(directory)
        return removed

    def delete_prefix(self, prefixes: Iterable[str]) -> dict[str, int]:
        counts: dict[str, int] = {}
        for prefix in self._prefixes(prefixes):
            removed = 0
            for subtree in self._subtrees(prefix):
                removed += self._remove_tree(subtree)
                self._prune(subtree.parent)
            counts[prefix] = counts.get(prefix, 0) + removed
        return counts

    def list(self, prefix: str | None = None) -> list[str]:
        if prefix is None:
            subtrees = [self.base]
        else:
            subtrees = self._subtrees(check_prefix(prefix))
        keys: list[str] = []
        for subtree in subtrees:
            for directory, _, files in os.walk(subtree):
                if RECORD_FILE in files:
                    keys.append(self._key_of(Path(directory)))
        return sorted(keys)

    def clear(self) -> int:
        if not self.base.exists():
            return 0
        return self._remove_tree(self.base)

    def describe(self) -> str:
        return f"local://{self.root} (namespace {self.namespace})"

    def supports_fsync(self) -> bool:
        return self.fsync

    def supports_cross_process(self) -> bool:
        return True

    def supports_list_namespaces(self) -> bool:
        return True

    def list_namespaces(self) -> list[str]:
        try:
            names = os.listdir(self.root)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise store_error("list", self.root, exc) from exc
        return sorted(n for n in names
                      if re.fullmatch(NAMESPACE_PATTERN, n, re.ASCII) and (self.root / n).is_dir())

    # -- internals ------------------------------------------------------------------------
    def _subtrees(self, prefix: str) -> list[Path]:
        """Directories holding exactly the keys that match ``prefix``."""
        if prefix.endswith(SEPARATORS):
            parent = self._dir_for(prefix[:-1])
            sep = prefix[-1]
            try:
                return [parent / n for n in sorted(os.listdir(parent)) if n.startswith(sep)]
            except (FileNotFoundError, NotADirectoryError):
                return []
        directory = self._dir_for(prefix)
        return [directory] if directory.is_dir() else []

    def _remove_tree(self, top: Path) -> int:
        """Delete every record under ``top`` and the emptied directories; count records."""
        removed = 0
        for directory, _, files in os.walk(top, topdown=False):
            for name in files:
                try:
                    os.unlink(os.path.join(directory, name))
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    raise store_error("delete", Path(directory) / name, exc) from exc
                if name == RECORD_FILE:
                    removed += 1
            try:
                os.rmdir(directory)
            except OSError:
                pass  # a concurrent writer put something back: keep it
        return removed

    def _prune(self, directory: Path) -> None:
        """Remove empty directories from ``directory`` up to (not including) the base."""
        while directory != self.base and self.base in directory.parents:
            try:
                os.rmdir(directory)
            except OSError:
                return
            directory = directory.parent
