"""The local store's declaration: its ``store.local`` config section and catalogue entry.

Light on purpose (config loads it): the store's code, :mod:`fd_routing_replay.store.local`,
is named by strings and imported only when the backend is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import parse_qsl, unquote, urlsplit

from fd_routing_replay.codec import RecordFormat
from fd_routing_replay.config.backends import Capability, Section, StoreBackend, option
from fd_routing_replay.config.options import nonempty
from fd_routing_replay.errors import ConfigError

LAYOUTS = ("tree", "fastdeploy")
"""tree: rr-v1 records in prefix buckets; fastdeploy: FastDeploy's own .pdtensor files."""


@dataclass(frozen=True)
class LocalStoreConfig(Section):
    """The embedded default store: one file per record under ``root``."""

    _path: ClassVar[str] = "store.local"
    root: str = option("./routing_replay_output", "Directory holding one sub-directory per namespace "
                       "(relative to the working directory).", check=nonempty)
    fsync: bool = option(False, "fsync each record file and its directory before a put is acknowledged.")
    layout: str = option("tree", "tree: rr-v1 records in prefix buckets under root/namespace; fastdeploy: "
                         "FastDeploy's own root/{rollout_id}/layer_{i}.pdtensor or {rollout_id}.pdtensor "
                         "files (paddle.save format, no namespace directory).", choices=LAYOUTS)
    max_model_len: int | None = option(None, "layout fastdeploy: pad each record's tokens to this many, as "
                                       "FastDeploy does; null = records keep the tokens they have.", min=1)

    def _validate(self) -> None:
        if self.max_model_len is not None and self.layout != "fastdeploy":
            raise ConfigError("store.local.max_model_len only applies to layout fastdeploy (the tree "
                              "layout stores records as they come)")


def local_settings(store: Any) -> LocalStoreConfig:
    """The effective ``store.local``: the section with a ``local://`` URL over it, checked.

    ``local:///abs/path`` or ``local://./relative/path`` names the root; its query may set
    any other key of the section (``?layout=fastdeploy&max_model_len=N``).
    """
    section = store.local
    parts = urlsplit(store.url or "")
    if parts.scheme in ("local", "file"):
        values = dict(parse_qsl(parts.query, keep_blank_values=True))
        root = unquote(parts.netloc + parts.path)
        if root:
            values["root"] = root
        section = section.overridden(values, f"store.url {store.url!r}")
    return section


def validate(config: Any) -> None:
    if (config.capture.record_format == RecordFormat.FASTDEPLOY_RAW
            and local_settings(config.store).layout != "fastdeploy"):
        raise ConfigError("capture.record_format 'fastdeploy-raw' with the local store writes "
                          "FastDeploy's own .pdtensor files: set store.local.layout: fastdeploy")


BACKEND = StoreBackend(
    name="local", aliases=("file",), factory="fd_routing_replay.store.local:open_local_store",
    config_section=LocalStoreConfig,
    capabilities=frozenset({Capability.CROSS_PROCESS}), validate=validate,
    fastdeploy_type="local", fastdeploy_keys=(("local_store_dir", "root"),))
