"""Strict parsers for configuration text: sizes, booleans, numbers, addresses, YAML/JSON.

Configuration arrives as text from environment variables and as loosely typed YAML
scalars.  These parsers accept one documented spelling per value and raise
``ValueError`` with the offending text otherwise, so a typo never turns into a silent
default.  ``fd_routing_replay.config`` wraps the ``ValueError`` into a ``ConfigError``
naming the key and where the value came from.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
import reprlib
from collections.abc import Callable, Hashable
from decimal import Decimal
from typing import Any

import yaml

__all__ = [
    "MAX_SIZE",
    "METADATA_SCHEMES",
    "REDIS_SCHEMES",
    "SIZE_UNITS",
    "format_size",
    "host_port_check",
    "json_depth_problem",
    "load_json_text",
    "load_yaml_text",
    "parse_bool",
    "parse_float",
    "parse_int",
    "parse_size",
    "pattern_check",
    "redis_url_check",
    "redis_url_problem",
    "store_url_problem",
    "url_problem",
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

#: The largest size any key takes: what a signed 64-bit integer holds (8 EiB - 1).
MAX_SIZE = 2**63 - 1

# ASCII digits only: ``\d`` would also match "٣" or "１", which ``int()`` then accepts.
_SIZE_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?) ?([A-Za-z]*)")
_INT_RE = re.compile(r"-?[0-9]+")
_FLOAT_RE = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})


def parse_size(value: int | str) -> int:
    """Return a byte count from an int or a string such as ``"512MiB"`` or ``"1.5GB"``.

    A bare number means bytes; fractional values are allowed only when they come to a
    whole number of bytes.  Negative sizes, booleans, unknown units, surrounding
    whitespace, non-ASCII digits and sizes above :data:`MAX_SIZE` are rejected.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size, got boolean {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return _bounded_size(value, value)
    if not isinstance(value, str):
        raise ValueError(f"expected a size (int or string like '512MiB'), got "
                         f"{type(value).__name__} {reprlib.repr(value)}")
    match = _SIZE_RE.fullmatch(value)
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
    return _bounded_size(int(total), value)


def _bounded_size(n_bytes: int, given: int | str) -> int:
    if n_bytes > MAX_SIZE:
        raise ValueError(f"size {given!r} is too large: at most {MAX_SIZE} bytes "
                         f"(8 EiB - 1) are allowed")
    return n_bytes


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
    """Parse a decimal integer written with ASCII digits and an optional ``-``.

    ``"1.0"``, ``"1e3"``, ``"0x10"``, ``"+80"``, ``" 80"``, ``"1_000"`` and non-ASCII
    digits (``"٣"``, ``"１"``) are rejected, although ``int()`` accepts several of them.
    """
    if not _INT_RE.fullmatch(text):
        raise ValueError(f"invalid integer {text!r}: use ASCII digits 0-9 only, optionally "
                         "after '-', with no sign '+', spaces or '_'")
    return int(text)


def parse_float(text: str) -> float:
    """Parse a finite decimal number written with ASCII digits (``"2.5"``, ``"1e-3"``).

    ``nan``, ``inf``, ``"+1"``, ``" 1"``, ``"1_0"`` and non-ASCII digits are rejected.
    """
    if not _FLOAT_RE.fullmatch(text):
        raise ValueError(f"invalid number {text!r}: use a decimal number with ASCII digits "
                         "(e.g. 2.5 or 1e-3), with no sign '+', spaces or '_'")
    result = float(text)
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


_HOSTNAME_RE = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?")


def bind_address_problem(value: Any) -> str | None:
    """What is wrong with an address to listen on (an IPv4/IPv6 literal or a host name,
    no port, no brackets), or None."""
    try:
        ipaddress.ip_address(value)
        return None
    except ValueError:
        pass
    if _HOSTNAME_RE.fullmatch(value) and not value.replace(".", "").isdigit():
        return None
    return "must be an IP address such as 0.0.0.0, 127.0.0.1 or ::, or a host name (no port)"
_PORT_RE = re.compile(r"[0-9]{1,5}")
_REDIS_DB_PATH_RE = re.compile(r"(?:/[0-9]*)?/?")


def _node_problem(node: str) -> str | None:
    """What is wrong with one ``host[:port]`` / ``[v6][:port]`` of a URL, or None."""
    if node.startswith("["):
        end = node.find("]")
        if end == -1:
            return "unclosed '[' in the host (an IPv6 address is written [::1]:6379)"
        host, rest = node[1:end], node[end + 1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return f"invalid IPv6 address {host!r} in brackets"
        if rest and not rest.startswith(":"):
            return f"unexpected {rest!r} after the IPv6 address"
        port: str | None = rest[1:] if rest else None
    else:
        host, colon, port_text = node.partition(":")
        if colon and ":" in port_text:
            return "an IPv6 address must be in brackets, e.g. redis://[::1]:6379/0"
        if "[" in node or "]" in node:
            return f"stray bracket in host {node!r}"
        if not host:
            return "no host (expected scheme://host:port/...)"
        if not _HOSTNAME_RE.fullmatch(host):
            return f"invalid host name {host!r}"
        port = port_text if colon else None
    if port is not None and (not _PORT_RE.fullmatch(port) or not 1 <= int(port) <= 65535):
        return f"invalid port {port!r}: expected a number in 1..65535"
    return None


def _authority(url: str) -> tuple[str, str, str, str] | str:
    """``(scheme, hostports, path, query)`` of ``scheme://[userinfo@]hostports/path?query``,
    or what is wrong.  Problems never quote the userinfo, so no password leaks."""
    scheme, sep, rest = url.partition("://")
    if not sep or not scheme:
        return "must be a URL with a scheme, like redis://host:6379/0"
    cut = next((i for i, char in enumerate(rest) if char in "/?#"), len(rest))
    authority, tail = rest[:cut], rest[cut:]
    if "@" in tail:
        return ("has an '@' after the host: percent-encode '/', '?', '#' and '@' in the user "
                "name and password (e.g. %2F for '/')")
    hostports = authority.rpartition("@")[2]
    path, _, query = tail.partition("?")
    return scheme, hostports, path.partition("#")[0], query.partition("#")[0]


def url_problem(url: str) -> str | None:
    """What is wrong with a URL's syntax (host and port, when it has them), or None.

    Catches what makes ``urllib.parse.urlsplit`` or its ``port`` raise later: an unclosed
    IPv6 bracket, a port that is not a number or not in 1..65535.  A URL with an empty
    host (``local:///data``, ``memory://``) is fine.
    """
    parts = _authority(url)
    if isinstance(parts, str):
        return parts
    hostports = parts[1]
    if not hostports:
        return None
    return _node_problem(hostports)


def redis_url_problem(url: str, schemes: tuple[str, ...] = ("redis", "rediss", "redis+cluster")
                      ) -> str | None:
    """What is wrong with a Redis URL, or None.

    ``redis://[[user]:password@]host[:port][/db][?options]`` for each scheme in
    ``schemes``, and P2PStore's ``redis+sentinel://[password@]h:p[,h:p…]/service[/db]``
    when ``redis+sentinel`` is among them.  The host is required, a port must be in
    1..65535 and the database a number; the problem named never quotes a password.
    """
    allowed = ", ".join(f"{scheme}://" for scheme in schemes)
    parts = _authority(url)
    if isinstance(parts, str):
        return parts
    scheme, hostports, path, _ = parts
    if scheme not in schemes:
        return f"must start with {allowed}"
    if scheme == "redis+sentinel":
        nodes = hostports.split(",")
        problems = [_node_problem(node.strip()) for node in nodes]
        problem = next((p for p in problems if p), None)
        if problem:
            return problem
        db = path.lstrip("/").partition("/")[2].strip("/")
        if db and not re.fullmatch(r"[0-9]+", db):
            return f"invalid database {db!r}: expected /service[/db] with a numeric db"
        return None
    if "," in hostports:
        return f"several hosts are only allowed in redis+sentinel:// URLs, got {hostports!r}"
    problem = _node_problem(hostports)
    if problem:
        return problem
    if not _REDIS_DB_PATH_RE.fullmatch(path):
        return f"invalid database path {path!r}: expected /N with a number N, e.g. /0"
    return None


#: Schemes of a Redis server URL, and those P2PStore's metadata server may also use.
REDIS_SCHEMES = ("redis", "rediss", "redis+cluster")
METADATA_SCHEMES = ("redis", "rediss", "redis+sentinel", "redis+cluster")
_URL_SCHEME_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://.*", re.DOTALL)


def redis_url_check(schemes: tuple[str, ...], *, allow_empty: bool = False
                    ) -> Callable[[Any], str | None]:
    """Return a validator of Redis URLs with one of ``schemes`` (see redis_url_problem)."""
    def check(value: Any) -> str | None:
        if value == "" and allow_empty:
            return None
        return redis_url_problem(value, schemes)

    return check


def store_url_problem(value: str) -> str | None:
    """``store.url``: a URL with a scheme; Redis and P2PStore URLs are checked like Redis
    URLs (``p2pstore://[user:password@]host:port/db?options`` names the metadata Redis)."""
    if not _URL_SCHEME_RE.fullmatch(value):
        return "must be a URL with a scheme, like redis://host"
    scheme = value.partition("://")[0]
    if scheme in REDIS_SCHEMES:
        return redis_url_problem(value, REDIS_SCHEMES)
    if scheme == "p2pstore" and value[len("p2pstore://"):][:1] not in ("", "/", "?"):
        return redis_url_problem("redis" + value[len("p2pstore"):], ("redis",))
    return url_problem(value)


def json_depth_problem(value: Any, max_depth: int) -> str | None:
    """None when lists and mappings in ``value`` nest at most ``max_depth`` levels deep.

    Iterative, so it cannot itself hit the recursion limit that deeper values would hit
    in ``copy.deepcopy``, ``repr`` or ``yaml.safe_dump``; shared sub-values (YAML aliases)
    are measured once, and a value that contains itself is reported.
    """
    heights: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        item, leaving = stack.pop()
        if not isinstance(item, (dict, list, tuple)):
            continue
        key = id(item)
        children = list(item.values() if isinstance(item, dict) else item)
        if leaving:
            on_path.discard(key)
            heights[key] = 1 + max((heights.get(id(child), 0) for child in children
                                    if isinstance(child, (dict, list, tuple))), default=0)
            if heights[key] > max_depth:
                return f"nests more than {max_depth} levels of lists and mappings"
            continue
        if key in heights:
            continue
        if key in on_path:
            return "contains itself (a recursive YAML alias)"
        on_path.add(key)
        stack.append((item, True))
        stack.extend((child, False) for child in children)
    return None


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
