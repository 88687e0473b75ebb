"""The p2pstore store's declaration: its ``store.p2pstore`` config section and catalogue entry.

Light on purpose (config loads it): the store's code, :mod:`fd_routing_replay.store.p2pstore`,
is named by strings and imported only when the backend is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from fd_routing_replay.codec import RecordFormat
from fd_routing_replay.config.backends import Capability, Section, StoreBackend, option
from fd_routing_replay.core import parsing as _parse
from fd_routing_replay.errors import ConfigError

LAYOUTS = ("tree", "fastdeploy")
"""tree: rr-v1 records under escaped keys; fastdeploy: FastDeploy's own bare keys."""


@dataclass(frozen=True)
class P2PStoreConfig(Section):
    """P2PStore (RDMA through Mooncake, or its TCP transport) with Redis as metadata server."""

    _path: ClassVar[str] = "store.p2pstore"
    metadata_server: str = option(
        "", "Redis URL of P2PStore's metadata server (holds our prefix index too); required for p2pstore.",
        check=_parse.redis_url_check(_parse.METADATA_SCHEMES, allow_empty=True), url=True)
    protocol: str = option("rdma", "Transfer protocol: rdma needs an RDMA NIC, tcp works anywhere.",
                           choices=("rdma", "tcp"))
    device: str = option("auto", "RDMA NIC name(s), comma-separated, or auto to pick an active port.",
                         check=_parse.pattern_check(r"auto|[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*",
                                                    "must be 'auto' or NIC names separated by commas"))
    local_host: str = option("", "Address peers reach this node at, host or host:port; empty = $POD_IP, "
                             "else 127.0.0.1.", check=_parse.host_port_check(port_required=False,
                                                                               allow_empty=True))
    log_dir: str | None = option(None, "Directory for P2PStore's own logs (P2P_LOG_DIR); null = chosen by the "
                                 "store, never the cwd.")
    max_delete_batch: int = option(1000, "Keys per P2PStore delete_batch call (1..1000).", min=1, max=1000)
    layout: str = option("tree", "tree: rr-v1 records under escaped {namespace}/{key} keys; fastdeploy: "
                         "FastDeploy's own bare {rollout_id} / {rollout_id}_{layer} keys holding its raw padded "
                         "values (one namespace per metadata server).", choices=LAYOUTS)
    max_model_len: int | None = option(None, "layout fastdeploy: pad each record's tokens to this many, as "
                                       "FastDeploy does; null = records keep the tokens they have (the "
                                       "capture pads them to max_model_len with fastdeploy-raw).", min=1)


def validate(config: Any) -> None:
    section = config.store.p2pstore
    if not section.metadata_server:
        raise ConfigError("store.p2pstore.metadata_server is required when store.type is "
                          "'p2pstore' (a Redis URL such as redis://10.0.0.5:6379/0; FastDeploy's "
                          "rdma_store_server)")
    if config.capture.record_format == RecordFormat.FASTDEPLOY_RAW and section.layout != "fastdeploy":
        raise ConfigError("capture.record_format 'fastdeploy-raw' with P2PStore writes FastDeploy's "
                          "own bare keys: set store.p2pstore.layout: fastdeploy")


BACKEND = StoreBackend(
    name="p2pstore", factory="fd_routing_replay.store.p2pstore:open_p2pstore_store", config_section=P2PStoreConfig,
    capabilities=frozenset({Capability.INDEXED, Capability.CROSS_PROCESS}), validate=validate,
    fastdeploy_type="rdma", fastdeploy_keys=(("rdma_store_server", "metadata_server"),),
    redis_target="fd_routing_replay.store.p2pstore.doctor:redis_target",
    rdma_check="fd_routing_replay.store.p2pstore.doctor:rdma_check")

