"""FastDeploy's own local routing layout, for trainers and tools that read it.

FastDeploy's ``RoutingStoreLocal`` (2.5 and 2.6) writes each rollout into one directory of
its ``local_store_dir`` with ``paddle.save``::

    {root}/{rollout_id}/layer_{layer}.pdtensor     per layer: [max_model_len, top_k]
    {root}/{rollout_id}/{rollout_id}.pdtensor      fused:     [layers, max_model_len, top_k]

padded with FastDeploy's fill (``-1`` cast to the unsigned dtype).  This store keeps that
layout exactly: store key ``{rollout_id}`` is the fused file, ``{rollout_id}_{layer}`` a
layer file, and the files are byte-identical to what ``paddle.save`` writes
(:mod:`fd_routing_replay.codec.pdtensor`; Paddle is never imported).

``put`` takes an rr-v1 record (converted: a per-layer key's single layer becomes
``[tokens, top_k]``, tokens are padded to ``max_model_len`` when the store knows it, the
record's fill becomes FastDeploy's) or a ``.pdtensor`` stream (validated, stored as is);
raw bytes carry no dtype or shape and are refused.  ``get`` returns the file's bytes.

The rollout's directory is one unit: deleting key ``{rollout_id}`` (or a prefix matching
it) removes all its files and the directory.  FastDeploy's layout has no namespace level,
so one root serves one namespace: the first put records the namespace in
``{root}/.fdrr-namespace`` and writes or deletes under another namespace are refused.
The layout is flat, so ``list`` and ``delete_prefix`` read the root's directory entries
(O(rollouts)); exact keys cost O(1).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fd_routing_replay.codec import MAGIC, decode_record
from fd_routing_replay.codec.pdtensor import (
    PDTENSOR_SUFFIX,
    decode_pdtensor,
    encode_pdtensor,
    looks_like_pdtensor,
    pad_tokens,
)
from fd_routing_replay.core.files import TEMP_PREFIX, atomic_write
from fd_routing_replay.errors import InvalidRolloutId, PermanentStoreError, RecordError
from fd_routing_replay.keys import (
    check_prefix,
    parse_rollout_id,
    prefix_matches,
    split_layer_key,
    split_partial_key,
)
from fd_routing_replay.store.base import Buffer, RoutingStore
from fd_routing_replay.store.local.files import store_error  # one errno rule, both layouts

__all__ = ["FastDeployLocalStore", "NAMESPACE_MARKER", "StoreTarget", "parse_store_key"]

NAMESPACE_MARKER = ".fdrr-namespace"
MAX_NAME_BYTES = 255  # NAME_MAX of common file systems; FastDeploy cannot go beyond it either
_LAYER_FILE = re.compile(r"layer_(0|[1-9][0-9]*)" + re.escape(PDTENSOR_SUFFIX))


@dataclass(frozen=True)
class StoreTarget:
    """What a store key names: a rollout's fused file, or one layer's file."""

    rollout_id: str
    layer: int | None = None

    @property
    def file_name(self) -> str:
        if self.layer is None:
            return f"{self.rollout_id}{PDTENSOR_SUFFIX}"
        return f"layer_{self.layer}{PDTENSOR_SUFFIX}"


def parse_store_key(key: str) -> StoreTarget:
    """``{rollout_id}`` → the fused file, ``{rollout_id}_{layer}`` → a layer's file;
    anything else raises InvalidRolloutId."""
    rollout, layer = split_layer_key(key)
    return StoreTarget(rollout.text, layer)


class FastDeployLocalStore(RoutingStore):
    """FastDeploy's ``{root}/{rollout_id}/*.pdtensor`` files (see the module docstring)."""

    scheme = "local"

    def __init__(self, root: str | os.PathLike[str], namespace: str = "routing_replay", *,
                 fsync: bool = False, max_model_len: int | None = None) -> None:
        super().__init__(namespace)
        if max_model_len is not None and (isinstance(max_model_len, bool)
                                          or not isinstance(max_model_len, int)
                                          or max_model_len < 1):
            raise ValueError(f"max_model_len must be a positive int or None, got {max_model_len!r}")
        self.root = Path(root).expanduser().absolute()
        self.base = self.root  # FastDeploy's local_store_dir: no namespace level
        self.fsync = fsync
        self.max_model_len = max_model_len
        self._claimed = False

    # -- paths ------------------------------------------------------------------------
    def path_of(self, key: str) -> Path:
        """The file a key is stored in."""
        target = parse_store_key(key)
        return self._dir_of(target.rollout_id) / self._checked_name(key, target.file_name)

    def _dir_of(self, rollout_id: str) -> Path:
        path = self.root / self._checked_name(rollout_id, rollout_id)
        if path.parent != self.root:  # defence in depth: check_key forbids every escape
            raise PermanentStoreError(f"local store: key {rollout_id!r} maps outside {self.root}")
        return path

    @staticmethod
    def _checked_name(key: str, name: str) -> str:
        if len(name.encode("utf-8")) > MAX_NAME_BYTES:
            raise PermanentStoreError(
                f"local store (fastdeploy layout): key {key!r} needs the file name {name!r} "
                f"of {len(name.encode('utf-8'))} bytes; file systems allow {MAX_NAME_BYTES} "
                "(use shorter rollout ids, or the tree layout)")
        return name

    # -- interface --------------------------------------------------------------------
    def put(self, key: str, value: Buffer) -> None:
        target = parse_store_key(key)
        path = self.path_of(key)
        data = self._file_content(key, target, value)
        self._claim_namespace(create=True)
        for attempt in range(3):  # a concurrent delete may remove the directory under us
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(path, (data,), fsync=self.fsync)
                return
            except FileNotFoundError:
                if attempt == 2:
                    raise
            except OSError as exc:
                raise store_error("write", path, exc) from exc

    def get(self, key: str) -> bytes | None:
        path = self.path_of(key)
        try:
            with open(path, "rb") as handle:
                return handle.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise store_error("read", path, exc) from exc

    def exists(self, key: str) -> bool:
        return self.path_of(key).is_file()

    def delete(self, keys: Iterable[str]) -> int:
        """Remove keys; a rollout id removes its whole directory.  Returns files removed.

        A partial record's key (``{rollout_id}_partial``) is never stored in this layout, so
        deleting one deletes nothing (``only_last_turn`` retires a turn's partial with it)."""
        keys = [key for key in keys if split_partial_key(key) is None]
        targets = [(key, parse_store_key(key)) for key in self._keys(keys)]
        self._claim_namespace(create=False)
        removed = 0
        for key, target in targets:
            if target.layer is None:
                removed += self._remove_rollout(target.rollout_id)
            else:
                removed += self._remove_files(target.rollout_id, [self.path_of(key)])
        return removed

    def delete_prefix(self, prefixes: Iterable[str]) -> dict[str, int]:
        checked = self._prefixes(prefixes)
        self._claim_namespace(create=False)
        counts: dict[str, int] = {}
        for prefix in checked:
            removed = 0
            for rollout_id in self._rollout_ids(prefix):
                if prefix_matches(rollout_id, prefix):  # then every key of it matches
                    removed += self._remove_rollout(rollout_id)
                    continue
                paths = [self.path_of(k) for k in self._keys_of(rollout_id)
                         if prefix_matches(k, prefix)]
                removed += self._remove_files(rollout_id, paths)
            counts[prefix] = counts.get(prefix, 0) + removed
        return counts

    def list(self, prefix: str | None = None) -> list[str]:
        if prefix is not None:
            check_prefix(prefix)
        keys = [key for rollout_id in self._rollout_ids(prefix)
                for key in self._keys_of(rollout_id)
                if prefix is None or prefix_matches(key, prefix)]
        return sorted(keys)

    def clear(self) -> int:
        self._claim_namespace(create=False)
        return sum(self._remove_rollout(rollout_id) for rollout_id in self._rollout_ids(None))

    def describe(self) -> str:
        return f"local://{self.root} (fastdeploy layout, namespace {self.namespace})"

    def supports_fsync(self) -> bool:
        return self.fsync

    def supports_cross_process(self) -> bool:
        return True

    def converts_records(self) -> bool:
        return True

    def supports_list_namespaces(self) -> bool:
        return True

    def list_namespaces(self) -> list[str]:
        """The one namespace that claimed this root (FastDeploy's layout has no namespace level)."""
        try:
            return [(self.root / NAMESPACE_MARKER).read_text(encoding="utf-8").strip()]
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise store_error("read", self.root / NAMESPACE_MARKER, exc) from exc

    # -- values -------------------------------------------------------------------------
    def _file_content(self, key: str, target: StoreTarget, value: Buffer) -> bytes:
        view = memoryview(value).cast("B")
        ndim = 3 if target.layer is None else 2
        try:
            if bytes(view[:len(MAGIC)]) == MAGIC:
                return encode_pdtensor(self._fastdeploy_array(target, view))
            if looks_like_pdtensor(view):
                decode_pdtensor(view, source=f"value for key {key!r}", ndim=(ndim,))
                return bytes(view)
        except RecordError as exc:
            raise PermanentStoreError(f"local store (fastdeploy layout): cannot store key "
                                      f"{key!r}: {exc}") from exc
        raise PermanentStoreError(
            f"local store (fastdeploy layout): the value for key {key!r} ({view.nbytes} bytes) "
            "is neither an rr-v1 record nor a .pdtensor stream; raw fastdeploy-raw bytes carry "
            "no dtype or shape, so hand this store rr-v1 records (it converts them)")

    def _fastdeploy_array(self, target: StoreTarget, view: memoryview) -> np.ndarray:
        record = decode_record(view)
        if record.rollout_id != target.rollout_id:
            raise RecordError(f"the record belongs to rollout {record.rollout_id!r}, not "
                              f"{target.rollout_id!r}")
        ids = record.ids
        if target.layer is not None:
            if ids.shape[0] != 1:
                raise RecordError(f"a per-layer key holds one layer; the record has "
                                  f"{ids.shape[0]} (shape {list(ids.shape)})")
            ids = ids[0]
        return pad_tokens(ids, self.max_model_len or ids.shape[-2], record.fill_value)

    # -- namespace guard ------------------------------------------------------------------
    def _claim_namespace(self, *, create: bool) -> None:
        """Refuse writes and deletes in a root that another namespace claimed."""
        if self._claimed:
            return
        marker = self.root / NAMESPACE_MARKER
        try:
            owner = marker.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            if not create:
                return
            owner = self._write_marker(marker)
        except OSError as exc:
            raise store_error("read", marker, exc) from exc
        if owner != self.namespace:
            raise PermanentStoreError(
                f"local store (fastdeploy layout): {self.root} holds the records of namespace "
                f"{owner!r} (see {marker}), not {self.namespace!r}; FastDeploy's layout has no "
                "namespace directory, so use one store.local.root per namespace")
        self._claimed = True

    def _write_marker(self, marker: Path) -> str:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:  # another process claimed it first: compare with that
            return marker.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise store_error("create", marker, exc) from exc
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(self.namespace + "\n")
        return self.namespace

    # -- directory walking ------------------------------------------------------------------
    def _rollout_ids(self, prefix: str | None) -> Iterator[str]:
        """Rollout directories under the root that may hold keys matching ``prefix``."""
        try:
            entries = list(os.scandir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as exc:
            raise store_error("list", self.root, exc) from exc
        for entry in entries:
            name = entry.name
            if name.startswith(".") or (prefix is not None and not (
                    name.startswith(prefix) or prefix.startswith(name))):
                continue
            try:
                parse_rollout_id(name)
            except InvalidRolloutId:
                continue  # not a rollout: another tool's directory, ours never touch it
            if entry.is_dir(follow_symlinks=False):
                yield name

    def _keys_of(self, rollout_id: str) -> list[str]:
        directory = self.root / rollout_id
        try:
            names = os.listdir(directory)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise store_error("list", directory, exc) from exc
        keys = []
        for name in names:
            if name == f"{rollout_id}{PDTENSOR_SUFFIX}":
                keys.append(rollout_id)
            elif (match := _LAYER_FILE.fullmatch(name)) is not None:
                keys.append(f"{rollout_id}_{match.group(1)}")
        return keys

    def _remove_rollout(self, rollout_id: str) -> int:
        """Remove a rollout's record files, leftover temp files and its directory."""
        directory = self._dir_of(rollout_id)
        paths = [self.path_of(key) for key in self._keys_of(rollout_id)]
        removed = self._remove_files(rollout_id, paths, prune=False)
        try:
            for name in os.listdir(directory):
                if name.startswith(TEMP_PREFIX):
                    (directory / name).unlink(missing_ok=True)
        except (FileNotFoundError, NotADirectoryError):
            return removed
        except OSError as exc:
            raise store_error("delete in", directory, exc) from exc
        self._prune(directory)
        return removed

    def _remove_files(self, rollout_id: str, paths: Iterable[Path], *, prune: bool = True) -> int:
        removed = 0
        for path in paths:
            try:
                path.unlink()
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                raise store_error("delete", path, exc) from exc
            removed += 1
        if prune:
            self._prune(self._dir_of(rollout_id))
        return removed

    @staticmethod
    def _prune(directory: Path) -> None:
        try:
            directory.rmdir()
        except OSError:
            pass  # not empty (a concurrent put, or files that are not ours): keep it
