"""Per-rank path templates and the state directory (what config validates, the writer expands).

Every writer locks its journal directory (:class:`~fd_routing_replay.writer.journal.
DirectoryLock`), and in FastDeploy every DP rank of an EP+DP deployment and every tp=1
server on a node runs its own writer.  So the directories are per rank, and never
relative to the engine's working directory:

* ``writer.journal_dir`` / ``writer.dead_letter_dir`` may hold placeholders
  (:data:`PLACEHOLDERS`), expanded once when the writer starts from a
  :class:`RankIdentity` and the store's namespace;
* left empty (the default) they are derived: under the local store's root
  (``{root}/.fdrr/{namespace}/journal/dp{dp_rank}-tp{tp_rank}-dev{device_id}``; a
  dot-directory no store key can name, outside every namespace directory), and for
  other stores under a state directory (:func:`state_dir`).

The default leaves out ``{pid}`` and ``{host}`` on purpose: a restarted engine on the
same rank finds and replays the journal its predecessor left.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from fd_routing_replay.errors import ConfigError

__all__ = [
    "LOCAL_STATE_DIR", "PLACEHOLDERS", "STATE_DIR_ENV", "RankIdentity",
    "expand_template", "state_dir", "template_problem",
]

log = logging.getLogger("fd_routing_replay.writer")

PLACEHOLDERS = ("dp_rank", "tp_rank", "device_id", "pid", "host", "namespace")
"""Names allowed inside ``{...}`` in ``writer.journal_dir`` and ``writer.dead_letter_dir``."""

STATE_DIR_ENV = "FD_RR_STATE_DIR"
"""Environment variable naming the state directory of writers of non-local stores."""

LOCAL_STATE_DIR = ".fdrr"
"""Directory under a local store's root holding writer state (keys never start with '.')."""

_STATE_DIR_NAME = "fd-routing-replay"
_TOKEN_RE = re.compile(r"\{([^{}]*)\}|[{}]")
_SAFE_COMPONENT = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_SAFE_COMPONENT_RE = re.compile(_SAFE_COMPONENT, re.ASCII)
_UNSAFE_CHAR_RE = re.compile(r"[^A-Za-z0-9._-]", re.ASCII)
_KNOWN = ", ".join("{" + name + "}" for name in PLACEHOLDERS)


def template_problem(text: str) -> str | None:
    """What is wrong with the placeholders of a directory template, or None.

    A placeholder is ``{name}`` with ``name`` one of :data:`PLACEHOLDERS`; braces mean
    nothing else (no format specs, no escapes).
    """
    for match in _TOKEN_RE.finditer(text):
        name = match.group(1)
        if name is None:
            return (f"unmatched {match.group(0)!r} at position {match.start()} (braces only "
                    f"enclose placeholders: {_KNOWN})")
        if name not in PLACEHOLDERS:
            return f"unknown placeholder {match.group(0)!r} (known: {_KNOWN})"
    return None


def expand_template(template: str, values: Mapping[str, str], key: str) -> str:
    """Replace every ``{name}`` of ``template``; ConfigError naming ``key`` if malformed."""
    problem = template_problem(template)
    if problem:
        raise ConfigError(f"{key}: {problem}, got {template!r}")
    return _TOKEN_RE.sub(lambda match: values[match.group(1)], template)


def _is_safe_component(text: str) -> bool:
    return _SAFE_COMPONENT_RE.fullmatch(text) is not None  # so never "", "." or ".."


def _check_value(name: str, value: Any) -> None:
    if name in ("dp_rank", "tp_rank", "pid") or (name == "device_id" and not isinstance(value, str)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            kind = "a str or a non-negative int" if name == "device_id" else "a non-negative int"
            raise ConfigError(f"rank identity: {name} must be {kind}, got {value!r}")
        return
    if not isinstance(value, str) or not _is_safe_component(value):
        raise ConfigError(
            f"rank identity: {name} {value!r} is not a safe path component (an ASCII letter "
            f"or digit, then up to 127 of letters, digits, '.', '_', '-')")


@dataclass(frozen=True)
class RankIdentity:
    """Who a writer is: the values of the directory placeholders.

    FastDeploy's glue passes ``dp_rank``, ``tp_rank`` and ``device_id`` from its
    parallel config; a field left as None is taken from the environment by
    :meth:`resolved` (``device_id`` from ``FLAGS_selected_gpus`` / ``CUDA_VISIBLE_DEVICES``
    as FastDeploy reads them; FastDeploy exports no DP or TP rank, so those become 0),
    ``pid`` and ``host`` from this process.  Given values are checked at construction.
    """

    dp_rank: int | None = None
    tp_rank: int | None = None
    device_id: int | str | None = None
    pid: int | None = None
    host: str | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                _check_value(f.name, value)

    def resolved(self, env: Mapping[str, str] | None = None) -> RankIdentity:
        """A copy with every field set (see the class docstring for where each comes from)."""
        env = os.environ if env is None else env
        return RankIdentity(
            dp_rank=0 if self.dp_rank is None else self.dp_rank,
            tp_rank=0 if self.tp_rank is None else self.tp_rank,
            device_id=_device_from_env(env) if self.device_id is None else self.device_id,
            pid=os.getpid() if self.pid is None else self.pid,
            host=_host_name() if self.host is None else self.host,
        )

    def placeholder_values(self, namespace: str) -> dict[str, str]:
        """``{placeholder: text}`` for a resolved identity and the store's namespace
        (already checked by ``store.namespace``'s pattern, a subset of safe names)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        missing = [name for name, value in values.items() if value is None]
        if missing:
            raise ValueError(f"rank identity is not resolved ({', '.join(missing)} unset); "
                             f"call resolved() first")
        return {**{name: str(value) for name, value in values.items()}, "namespace": namespace}

    def label(self) -> str:
        """The per-rank leaf name of the default directories."""
        return f"dp{self.dp_rank}-tp{self.tp_rank}-dev{self.device_id}"


def _device_from_env(env: Mapping[str, str]) -> int | str:
    """The physical device as FastDeploy computes it: ``CUDA_VISIBLE_DEVICES[FLAGS_selected_gpus]``."""
    selected = env.get("FLAGS_selected_gpus", "").split(",")[0].strip()
    visible = [item.strip() for item in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if item.strip()]
    index = int(selected) if selected.isdigit() else 0
    if not visible:
        return index
    device = visible[index] if index < len(visible) else selected or visible[0]
    if device.isdigit():
        return int(device)
    cleaned = _UNSAFE_CHAR_RE.sub("_", device)  # a GPU or MIG UUID: keep it readable
    return cleaned if _is_safe_component(cleaned) else index


def _host_name() -> str:
    name = _UNSAFE_CHAR_RE.sub("_", socket.gethostname().split(".")[0])[:128]
    return name if _is_safe_component(name) else "localhost"


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$FD_RR_STATE_DIR``, else ``$XDG_STATE_HOME/fd-routing-replay``, else
    ``~/.local/state/fd-routing-replay`` (absolute)."""
    env = os.environ if env is None else env
    explicit = env.get(STATE_DIR_ENV, "")
    if explicit:
        return Path(os.path.abspath(os.path.expanduser(explicit)))
    xdg = env.get("XDG_STATE_HOME", "")
    if xdg and os.path.isabs(xdg):  # the XDG spec: relative values are ignored
        return Path(xdg) / _STATE_DIR_NAME
    try:
        home = Path.home()
    except RuntimeError as exc:
        raise ConfigError(
            f"cannot find a state directory for the routing writer (no home directory: {exc}); "
            f"set ${STATE_DIR_ENV} or writer.journal_dir and writer.dead_letter_dir") from None
    return home / ".local" / "state" / _STATE_DIR_NAME
