"""Strict parsers for configuration text: sizes, booleans, numbers, addresses, YAML/JSON.

Configuration arrives as text from environment variables and as loosely typed YAML
scalars.  These parsers accept one documented spelling per value and raise
``ValueError`` with the offending text otherwise, so a typo never turns into a silent
default.  ``fd_routing_replay.config`` wraps the ``ValueError`` into a ``ConfigError``
naming the key and where the value came from.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Hashable
from decimal import Decimal
from typing import Any

import yaml

__all__ = [
    "SIZE_UNITS",
    "format_size",
    "host_port_check",
    "load_json_text",
    "load_yaml_text",
    "parse_bool",
    "parse_float",
    "parse_int",
    "parse_size",
    "pattern_check",
]

#: Accepted size suffixes.  SI units are powers of 1000, IEC units powers of 1024.
#: Spellings are case-sensitive: ``Mb`` (megabit) or ``mib`` are rejected, not guessed.
SIZE_UNITS: dict[str, int] = {
    "B": 1,
    "kB": 1000,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "TiB": 1024**4,
}

_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([A-Za-z]*)")
_INT_RE = re.compile(r"[+-]?\d+")
_FLOAT_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})


def parse_size(value: int | str) -> int:
    """Return a byte count from an int or a string such as ``"512MiB"`` or ``"1.5GB"``.

    A bare number means bytes; fractional values are allowed only when they come to a
    whole number of bytes.  Negative sizes, booleans and unknown units are rejected.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size, got boolean {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a size (int or string like '512MiB'), got {value!r}")
    match = _SIZE_RE.fullmatch(value.strip())
    if match is None:
        raise ValueError(
            f"invalid size {value!r}: expected a non-negative number with an optional unit, "
            f"e.g. '4096', '512MiB', '1GiB'"
        )
    number, unit = match.groups()
    if unit and unit not in SIZE_UNITS:
        raise ValueError(
            f"invalid size {value!r}: unknown unit {unit!r}; use one of {', '.join(SIZE_UNITS)}"
        )
    total = Decimal(number) * SIZE_UNITS[unit or "B"]
    if total != total.to_integral_value():
        raise ValueError(f"invalid size {value!r}: not a whole number of bytes")
    return int(total)


def format_size(n_bytes: int) -> str:
    """Render a byte count with the largest IEC unit that divides it exactly."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        factor = SIZE_UNITS[unit]
        if n_bytes and n_bytes % factor == 0:
            return f"{n_bytes // factor}{unit}"
    return str(n_bytes)


def parse_bool(text: str) -> bool:
    """Parse ``true/false/1/0/yes/no`` (any letter case); reject everything else."""
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"invalid boolean {text!r}: use true/false, 1/0 or yes/no")


def parse_int(text: str) -> int:
    """Parse a decimal integer; ``"1.0"``, ``"1e3"`` and ``"0x10"`` are rejected."""
    stripped = text.strip()
    if not _INT_RE.fullmatch(stripped):
        raise ValueError(f"invalid integer {text!r}")
    return int(stripped)


def parse_float(text: str) -> float:
    """Parse a finite decimal float; ``nan``, ``inf`` and ``1_0`` are rejected."""
    stripped = text.strip()
    if not _FLOAT_RE.fullmatch(stripped):
        raise ValueError(f"invalid number {text!r}")
    result = float(stripped)
    if not math.isfinite(result):
        raise ValueError(f"number out of range: {text!r}")
    return result


def pattern_check(regex: str, rule: str) -> Callable[[Any], str | None]:
    """Return a validator: None when a string fully matches ``regex``, else ``rule``."""
    compiled = re.compile(regex)

    def check(value: Any) -> str | None:
        return None if value is None or compiled.fullmatch(value) else rule

    return check


_HOST_PORT_RE = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*)(?::(\d{1,5}))?")


def host_port_check(*, port_required: bool, allow_empty: bool) -> Callable[[Any], str | None]:
    """Return a validator for ``host``, ``host:port`` or ``[v6]:port`` addresses."""
    rule = "must be host:port" if port_required else "must be host or host:port"
    rule += " (or empty)" if allow_empty else ""

    def check(value: Any) -> str | None:
        if value == "" and allow_empty:
            return None
        match = _HOST_PORT_RE.fullmatch(value)
        if match is None or (port_required and match.group(2) is None):
            return rule
        if match.group(2) is not None and not 1 <= int(match.group(2)) <= 65535:
            return "port must be in 1..65535"
        return None

    return check


class _StrictYamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that rejects duplicate keys instead of keeping the last one."""


def _construct_unique_mapping(
    loader: _StrictYamlLoader, node: yaml.MappingNode, deep: bool = False
) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` merges may be overridden
            continue
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, Hashable):
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictYamlLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


def load_yaml_text(text: str) -> Any:
    """``yaml.safe_load`` that also rejects duplicate keys; raises ``yaml.YAMLError``."""
    return yaml.load(text, Loader=_StrictYamlLoader)  # noqa: S506 - a SafeLoader subclass


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def load_json_text(text: str) -> Any:
    """``json.loads`` that rejects duplicate keys; raises ``ValueError``."""
    return json.loads(text, object_pairs_hook=_unique_pairs)
