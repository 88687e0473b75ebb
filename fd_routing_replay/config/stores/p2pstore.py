"""The p2pstore store's declaration: its ``store.p2pstore`` config section and catalogue entry.

Light on purpose (config loads it): the store's code, :mod:`fd_routing_replay.store.p2pstore`,
is named by strings and imported only when the backend is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import parse_qsl, urlsplit

from fd_routing_replay.codec import RecordFormat
from fd_routing_replay.config.backends import Capability, Section, StoreBackend, option
from fd_routing_replay.core import parsing as _parse
from fd_routing_replay.errors import ConfigError

LAYOUTS = ("tree", "fastdeploy")
"""tree: rr-v1 records under escaped keys; fastdeploy: FastDeploy's own bare keys."""


_METADATA_URL = _parse.redis_url_check(_parse.METADATA_SCHEMES, allow_empty=True)


def _metadata_server_problem(url: str) -> str | None:
    problem = _METADATA_URL(url)
    if problem is None and urlsplit(url).scheme in ("rediss", "redis+cluster"):
        return ("P2PStore's metadata server must be redis:// or redis+sentinel:// (its Redis Cluster "
                "mode fails at client start and runs scripts across slots; rediss:// is not parsed)")
    return problem


@dataclass(frozen=True)
class P2PStoreConfig(Section):
    """P2PStore (RDMA through Mooncake, or its TCP transport) with Redis as metadata server."""

    _path: ClassVar[str] = "store.p2pstore"
    metadata_server: str = option(
        "", "Redis URL of P2PStore's metadata server (holds our prefix index too); required for p2pstore.",
        check=_metadata_server_problem, url=True)
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


    def _validate(self) -> None:
        if self.max_model_len is not None and self.layout != "fastdeploy":
            raise ConfigError("store.p2pstore.max_model_len only applies to layout fastdeploy (the tree "
                              "layout stores records as they come)")


def p2pstore_settings(store: Any) -> P2PStoreConfig:
    """The effective ``store.p2pstore``: the section with a ``p2pstore://`` URL over it, checked.

    ``p2pstore://[user:password@]host:port/db?protocol=tcp&device=mlx5_0&local_host=…`` names
    the metadata Redis (as ``redis://…``); its query may set any other key of the section
    (``layout=fastdeploy&max_model_len=N``), parsed and checked as the section declares it.
    """
    section = store.p2pstore
    parts = urlsplit(store.url or "")
    if parts.scheme == "p2pstore":
        values = dict(parse_qsl(parts.query, keep_blank_values=True))
        source = f"store.url p2pstore://{parts.hostname or ''}…"
        if "metadata_server" in values:
            raise ConfigError(f"{source}: the metadata server is the URL's host, not an option")
        if parts.netloc:
            values["metadata_server"] = f"redis://{parts.netloc}{parts.path or '/0'}"
        section = section.overridden(values, source)
    if not section.metadata_server:
        raise ConfigError("store.p2pstore.metadata_server is required for the p2pstore store (a Redis "
                          "URL such as redis://10.0.0.5:6379/0; FastDeploy's rdma_store_server), or use "
                          "store.url: p2pstore://host:port/db")
    return section


def validate(config: Any) -> None:
    section = p2pstore_settings(config.store)
    if config.capture.record_format == RecordFormat.FASTDEPLOY_RAW and section.layout != "fastdeploy":
        raise ConfigError("capture.record_format 'fastdeploy-raw' with P2PStore writes FastDeploy's "
                          "own bare keys: set store.p2pstore.layout: fastdeploy")


BACKEND = StoreBackend(
    name="p2pstore", factory="fd_routing_replay.store.p2pstore:open_p2pstore_store", config_section=P2PStoreConfig,
    capabilities=frozenset({Capability.INDEXED, Capability.CROSS_PROCESS}), validate=validate,
    fastdeploy_type="rdma", fastdeploy_keys=(("rdma_store_server", "metadata_server"),),
    redis_target="fd_routing_replay.store.p2pstore.doctor:redis_target",
    rdma_check="fd_routing_replay.store.p2pstore.doctor:rdma_check")

