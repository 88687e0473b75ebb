"""The local store's declaration: its ``store.local`` config section and catalogue entry.

Light on purpose (config loads it): the store's code, :mod:`fd_routing_replay.store.local`,
is named by strings and imported only when the backend is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

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


def validate(config: Any) -> None:
    if (config.capture.record_format == RecordFormat.FASTDEPLOY_RAW
            and config.store.local.layout != "fastdeploy"):
        raise ConfigError("capture.record_format 'fastdeploy-raw' with the local store writes "
                          "FastDeploy's own .pdtensor files: set store.local.layout: fastdeploy")


BACKEND = StoreBackend(
    name="local", aliases=("file",), factory="fd_routing_replay.store.local:open_local_store",
    config_section=LocalStoreConfig,
    capabilities=frozenset({Capability.CROSS_PROCESS}), validate=validate,
    fastdeploy_type="local", fastdeploy_keys=(("local_store_dir", "root"),))
