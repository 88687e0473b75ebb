"""Every key of the configuration tree: dotted paths, environment variable names, the
generated ``docs/config.md`` table, and spelling suggestions for unknown keys."""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterator
from dataclasses import MISSING, Field, fields
from typing import Any, NamedTuple

from fd_routing_replay.config.options import join as _join
from fd_routing_replay.config.options import type_name as _type_name
from fd_routing_replay.config.schema import ENV_PREFIX, RoutingReplayConfig
from fd_routing_replay.core import parsing as _parse

__all__ = ["ENV_NAMES", "LEAVES", "ConfigField", "env_var_name", "iter_fields", "render_config_doc",
           "suggest"]


def _iter_leaves(cls: type, prefix: str) -> Iterator[tuple[str, Field]]:
    for f in fields(cls):
        path = _join(prefix, f.name)
        if f.metadata.get("section"):
            yield from _iter_leaves(f.type, path)
        else:
            yield path, f


LEAVES: dict[str, Field] = dict(_iter_leaves(RoutingReplayConfig, ""))


def env_var_name(path: str) -> str:
    """The env var overriding a dotted key: ``store.local.root`` -> ``FD_RR_STORE__LOCAL__ROOT``."""
    return ENV_PREFIX + "__".join(part.upper() for part in path.split("."))


ENV_NAMES: dict[str, str] = {env_var_name(path): path for path in LEAVES}


class ConfigField(NamedTuple):
    """One documented key: dotted path, type name, default value and one-line doc."""

    path: str
    type: str
    default: Any
    doc: str

    @property
    def env_var(self) -> str:
        return env_var_name(self.path)


def iter_fields() -> Iterator[ConfigField]:
    """Yield every key of the tree in declaration order (used to generate docs/config.md)."""
    for path, f in LEAVES.items():
        default = f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]
        yield ConfigField(path, _type_name(f), default, f.metadata["doc"])


def suggest(key: str, candidates: list[str], prefix: str = "") -> str:
    """``"; did you mean 'x'?"`` for the closest candidate, or an empty string."""
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return f"; did you mean {_join(prefix, close[0])!r}?" if close else ""


def render_config_doc() -> str:
    """Render the key table of docs/config.md from the dataclass tree."""
    lines = [
        "| Key | Type | Default | Environment variable | Description |",
        "|---|---|---|---|---|",
    ]
    for item in iter_fields():
        is_size = LEAVES[item.path].metadata.get("size")
        default = _parse.format_size(item.default) if is_size else json.dumps(item.default)
        doc = item.doc.replace("|", "\\|")
        lines.append(f"| `{item.path}` | {item.type} | `{default}` | `{item.env_var}` | {doc} |")
    return "\n".join(lines) + "\n"
