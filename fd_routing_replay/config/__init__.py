"""Typed configuration: one dataclass tree, loaded from defaults, a file, env and a dict.

Every key's type, default and one-line doc live in exactly one place, the ``option(...)``
call that declares it in :mod:`.schema` — or, for a ``store.<backend>`` section, in the
backend's light declaration (:mod:`fd_routing_replay.config.stores`, listed by the
catalogue :mod:`.backends`); validation, environment parsing (:mod:`.loader`) and
``docs/config.md`` (:mod:`.reference`) are all derived from it, so they cannot drift apart.
Loading a config imports no store backend: their code is named by strings.

Precedence, lowest first: built-in defaults < YAML/JSON file (``path`` argument, else the
file named by ``FD_ROUTING_REPLAY_CONFIG``) < ``FD_RR_<SECTION>__<KEY>`` environment
variables < the explicit ``overrides`` dict.  A file or dict may also be FastDeploy's flat
``--routing-replay-config`` JSON; it is recognised by its keys and mapped onto the tree.
Nothing is silently ignored: unknown keys, wrong types and bad values raise
``ConfigError`` naming the dotted key, the value and the source it came from.
"""

from typing import Any

from fd_routing_replay.config.fastdeploy import config_from_fastdeploy, is_fastdeploy_flat
from fd_routing_replay.config.loader import config_from_dict, config_to_dict, load_config
from fd_routing_replay.config.reference import (
    ConfigField,
    env_var_name,
    iter_fields,
    render_config_doc,
)
from fd_routing_replay.config.schema import (
    CONFIG_ENV_VAR,
    ENV_PREFIX,
    OTHER_ENV_VARS,
    CaptureConfig,
    RetentionConfig,
    RoutingReplayConfig,
    StoreConfig,
    WriterConfig,
    section_class,
)
from fd_routing_replay.errors import ConfigError

__all__ = [
    "CONFIG_ENV_VAR", "ENV_PREFIX", "OTHER_ENV_VARS", "CaptureConfig", "ConfigError", "ConfigField",
    "RetentionConfig", "RoutingReplayConfig", "StoreConfig", "WriterConfig", "config_from_dict",
    "config_from_fastdeploy", "config_to_dict", "env_var_name", "is_fastdeploy_flat",
    "iter_fields", "load_config", "render_config_doc",
]


def __getattr__(name: str) -> Any:
    """A backend's section class by its name (``LocalStoreConfig``)."""
    return section_class(name)
