"""Loading a configuration: defaults < file (YAML/JSON) < ``FD_RR_*`` environment < an
explicit dict, each value checked and traced to its source; and back to a plain dict."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from fd_routing_replay.config.fastdeploy import fastdeploy_pairs, is_fastdeploy_flat
from fd_routing_replay.config.options import MAX_NESTING
from fd_routing_replay.config.options import coerce as _coerce
from fd_routing_replay.config.options import config_error as _error
from fd_routing_replay.config.options import from_text as _from_text
from fd_routing_replay.config.options import join as _join
from fd_routing_replay.config.options import shown as _shown
from fd_routing_replay.config.reference import ENV_NAMES, LEAVES, suggest
from fd_routing_replay.config.schema import (
    CONFIG_ENV_VAR,
    ENV_PREFIX,
    OTHER_ENV_VARS,
    RoutingReplayConfig,
)
from fd_routing_replay.core import parsing as _parse
from fd_routing_replay.core.redact import MASK, redact_url, redact_value
from fd_routing_replay.errors import ConfigError

__all__ = ["config_from_dict", "config_to_dict", "load_config"]


def _walk(
    data: Mapping[Any, Any], cls: type, prefix: str, source: str, out: dict[str, tuple[Any, str]]
) -> None:
    by_name = {f.name: f for f in fields(cls)}
    for key, value in data.items():
        if not isinstance(key, str):
            raise _error(_join(prefix, _shown(key)), source, "keys must be strings")
        f = by_name.get(key)
        path = _join(prefix, key)
        if f is None:
            hint = suggest(key, list(by_name), prefix)
            if not hint:
                elsewhere = [p for p in LEAVES if p.rsplit(".", 1)[-1] == key]
                hint = f"; did you mean {elsewhere[0]!r}?" if elsewhere else ""
            raise _error(path, source, f"unknown key{hint} (valid keys here: {', '.join(by_name)})")
        if f.metadata.get("section"):
            if value is None:  # a section whose keys are all commented out
                continue
            if not isinstance(value, Mapping):
                raise _error(path, source, f"is a section and needs a mapping of keys, got {_shown(value)}")
            _walk(value, f.type, path, source, out)
        else:
            out[path] = (_coerce(f, value, path, source), source)


def _layer_from_mapping(data: Any, source: str) -> dict[str, tuple[Any, str]]:
    """Validate one dict source (nested or FastDeploy flat) into {dotted path: (value, source)}."""
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"configuration must be a mapping of keys, got {type(data).__name__} (from {source})"
        )
    out: dict[str, tuple[Any, str]] = {}
    if is_fastdeploy_flat(data):
        for path, value, key in fastdeploy_pairs(data, source):
            where = f"{source}, FastDeploy key {key!r}"
            out[path] = (_coerce(LEAVES[path], value, path, where), where)
    else:
        _walk(data, RoutingReplayConfig, "", source, out)
    return out


def _env_layer(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    out: dict[str, tuple[Any, str]] = {}
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in OTHER_ENV_VARS:
            continue
        source = f"environment variable {name}"
        path = ENV_NAMES.get(name)
        if path is None:
            raise ConfigError(f"unknown environment variable {name}{suggest(name, list(ENV_NAMES))}")
        f = LEAVES[path]
        out[path] = (_coerce(f, _from_text(f, env[name], path, source), path, source), source)
    return out


def _read_file(path: str | os.PathLike[str], named_by: str | None) -> tuple[Any, str]:
    file_path = Path(path)
    named = f" (named by {named_by})" if named_by else ""
    source = f"file {file_path}{named}"
    try:
        text = file_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {file_path}{named}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {file_path}: {exc}") from None
    try:
        if file_path.suffix.lower() == ".json":
            data = _parse.load_json_text(text)
        else:
            data = _parse.load_yaml_text(text)
    except (ValueError, yaml.YAMLError) as exc:
        kind = "JSON" if file_path.suffix.lower() == ".json" else "YAML"
        raise ConfigError(f"invalid {kind} in config file {file_path}: {exc}") from None
    except RecursionError:
        raise ConfigError(f"config file {file_path}: lists or mappings nest too deeply to parse; "
                          f"a config has at most 3 levels of sections, and store.options at most "
                          f"{MAX_NESTING} levels") from None
    return ({} if data is None else data), source


def _build(cls: type, values: Mapping[str, tuple[Any, str]], prefix: str) -> Any:
    kwargs = {}
    for f in fields(cls):
        path = _join(prefix, f.name)
        if f.metadata.get("section"):
            kwargs[f.name] = _build(f.type, values, path)
        elif path in values:
            kwargs[f.name] = values[path][0]
    return cls(**kwargs)


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> RoutingReplayConfig:
    """Build the effective configuration from defaults, a file, the environment and a dict.

    ``path`` names a YAML (or ``.json``) file; without it the file named by
    ``FD_ROUTING_REPLAY_CONFIG`` in ``env`` is used, if any.  ``env`` defaults to
    ``os.environ``; pass a dict to make loading independent of the process environment.
    ``overrides`` is a nested dict (or FastDeploy's flat form) applied last.
    """
    env = os.environ if env is None else env
    values: dict[str, tuple[Any, str]] = {}
    named_by = None
    if path is None and env.get(CONFIG_ENV_VAR, ""):
        path, named_by = env[CONFIG_ENV_VAR], CONFIG_ENV_VAR
    if path is not None:
        data, source = _read_file(path, named_by)
        values.update(_layer_from_mapping(data, source))
    values.update(_env_layer(env))
    if overrides is not None:
        values.update(_layer_from_mapping(overrides, "overrides"))
    return _build(RoutingReplayConfig, values, "")


def config_from_dict(data: Mapping[str, Any], *, source: str = "dict") -> RoutingReplayConfig:
    """Validate a nested (or FastDeploy flat) dict alone: no file, no environment.

    The inverse of ``config_to_dict``; use it to hand a config to another process
    without pickling.
    """
    return _build(RoutingReplayConfig, _layer_from_mapping(data, source), "")


def config_to_dict(cfg: Any, *, redact: bool = False) -> dict[str, Any]:
    """Return a config (or one section) as a nested dict of plain values.

    With ``redact=True`` the result can be printed or logged: secret values (passwords)
    become ``"***"``, and so do passwords inside URLs and inside ``store.options``
    (see :mod:`fd_routing_replay.core.redact`).
    """
    result: dict[str, Any] = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.metadata.get("section"):
            result[f.name] = config_to_dict(value, redact=redact)
        elif redact and f.metadata.get("secret") and value is not None:
            result[f.name] = MASK
        elif redact and f.metadata.get("url") and isinstance(value, str):
            result[f.name] = redact_url(value)
        elif redact:
            result[f.name] = redact_value(copy.deepcopy(value))
        else:
            result[f.name] = copy.deepcopy(value)
    return result


