"""How a config section declares and checks its keys: :func:`option`, :class:`Section`.

Shared by :mod:`fd_routing_replay.config` (the tree) and by every store backend module,
which declares its own ``store.<name>`` section with the same two tools, so a key's type,
default, one-line doc and constraints live in one ``option(...)`` call wherever the
section lives.  Validation messages name the dotted key, the value and the source.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import reprlib
import types
import typing
from dataclasses import Field, field, fields
from typing import Any, ClassVar

from fd_routing_replay.core import parsing as _parse
from fd_routing_replay.core.redact import MASK, redact_value
from fd_routing_replay.errors import ConfigError

__all__ = ["MAX_NESTING", "Section", "coerce", "config_error", "from_text", "join", "nonempty", "option",
           "resolve_annotations", "section", "shown", "type_name"]

#: How deep lists and mappings may nest inside a dict key (``store.options``).
MAX_NESTING = 32


def option(default: Any, doc: str, **meta: Any) -> Any:
    """Declare a key: its default, its one-line doc and its constraints, in one place.

    ``meta`` may hold ``choices`` (allowed values), ``size`` (int bytes, accepts "1GiB"),
    ``min`` / ``gt`` / ``max`` bounds, ``check`` (callable returning an error or None),
    ``secret`` (value hidden in messages, repr and redacted dumps) and ``url`` (a URL
    whose password is hidden in messages and redacted dumps).
    """
    metadata = {"doc": doc, **meta}
    repr_ = not meta.get("secret", False)
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=metadata, repr=repr_)
    return field(default=default, metadata=metadata, repr=repr_)


def section(cls: type) -> Any:
    """Declare a nested section (a :class:`Section` dataclass) with its defaults."""
    return field(default_factory=cls, metadata={"section": True})


def nonempty(value: Any) -> str | None:
    return None if value else "must not be empty"


class Section:
    """Base of every config section: validates each field at construction.

    Sections are frozen dataclasses; build a changed copy with ``load_config(overrides=...)``
    or ``dataclasses.replace``.  ``_path`` is the section's dotted path in the tree, so
    errors raised here name the full key.
    """

    _path: ClassVar[str] = ""

    def __post_init__(self) -> None:
        resolve_annotations(type(self))
        source = f"{type(self).__name__}()"
        for f in fields(self):  # type: ignore[arg-type]
            path = join(self._path, f.name)
            value = getattr(self, f.name)
            if f.metadata.get("section"):
                if not isinstance(value, f.type):
                    raise config_error(path, source,
                                       f"expected {f.type.__name__}, got {shown(value)}")
                continue
            object.__setattr__(self, f.name, coerce(f, value, path, source))
        self._validate()

    def _validate(self) -> None:
        """Cross-field checks; sections that need them override this."""

    def overridden(self, values: typing.Mapping[str, str], source: str) -> Any:
        """This section with ``values`` -- text, as a URL's query gives it -- in place of its
        keys, each parsed and checked as declared; ConfigError naming an unknown key or a
        bad value and ``source``."""
        known = {f.name: f for f in fields(self) if not f.metadata.get("section")}  # type: ignore[arg-type]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"{source}: unknown option(s) {', '.join(unknown)}; known: {', '.join(known)}")
        changed = {}
        for name, text in values.items():
            path = join(self._path, name)
            changed[name] = coerce(known[name], from_text(known[name], text, path, source), path, source)
        return dataclasses.replace(self, **changed)  # type: ignore[type-var]


def resolve_annotations(cls: type) -> None:
    """Turn string annotations (a module with ``from __future__ import annotations``) of a
    section's fields into types, once, so checks and docs see ``str | None``, not text."""
    if cls.__dict__.get("_annotations_resolved"):
        return
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if isinstance(f.type, str):
            f.type = hints[f.name]
    cls._annotations_resolved = True  # type: ignore[attr-defined]


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def config_error(path: str, source: str | None, message: str) -> ConfigError:
    return ConfigError(f"{path}: {message}" + (f" (from {source})" if source else ""))


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 200, 200


def shown(value: Any, secret: bool = False) -> str:
    """``value`` as a message may quote it: passwords masked, short, never recursing deep."""
    if secret and value is not None:
        return repr(MASK)
    problem = _parse.json_depth_problem(value, MAX_NESTING)
    if problem:
        return f"a {type(value).__name__} that {problem}"
    return _REPR.repr(redact_value(value))


def annotation(f: Field) -> tuple[type, bool]:
    """Return (base type, optional) of a field's annotation."""
    declared = f.type
    if isinstance(declared, types.UnionType):
        args = [a for a in declared.__args__ if a is not type(None)]
        return args[0], True
    return typing.get_origin(declared) or declared, False


def type_name(f: Field) -> str:
    base, optional = annotation(f)
    choices = f.metadata.get("choices")
    name = "size" if f.metadata.get("size") else "enum: " + ", ".join(choices) if choices else base.__name__
    return f"{name} or null" if optional else name


def coerce(f: Field, value: Any, path: str, source: str) -> Any:
    """Check a value against its field's declaration; return it normalised."""
    base, optional = annotation(f)
    meta = f.metadata
    quoted = shown(value, bool(meta.get("secret")))
    expected = type_name(f)
    if value is None:
        if optional:
            return None
        raise config_error(path, source, f"expected {expected}, got null")
    if meta.get("size"):
        try:
            value = _parse.parse_size(value)
        except ValueError as exc:
            raise config_error(path, source, str(exc)) from None
    elif base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise config_error(path, source, f"expected float, got {type(value).__name__} {quoted}")
        value = float(value)
        if not math.isfinite(value):
            raise config_error(path, source, f"must be a finite number, got {quoted}")
    elif base is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise config_error(path, source, f"expected int, got {type(value).__name__} {quoted}")
    elif not isinstance(value, base):
        raise config_error(path, source, f"expected {expected}, got {type(value).__name__} {quoted}")
    if base is dict:
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise config_error(path, source, f"keys must be strings, got {shown(bad[0])}")
        problem = _parse.json_depth_problem(value, MAX_NESTING)
        if problem:
            raise config_error(path, source, problem)
        value = copy.deepcopy(dict(value))
    choices = meta.get("choices")
    if choices and value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise config_error(path, source, f"invalid value {quoted}; allowed: {allowed}")
    if "min" in meta and value < meta["min"]:
        raise config_error(path, source, f"must be >= {meta['min']}, got {quoted}")
    if "gt" in meta and value <= meta["gt"]:
        raise config_error(path, source, f"must be > {meta['gt']}, got {quoted}")
    if "max" in meta and value > meta["max"]:
        bound = f"{meta['max']} ({_parse.format_size(meta['max'])})" if meta.get("size") else meta["max"]
        raise config_error(path, source, f"must be <= {bound}, got {quoted}")
    problem = meta.get("check") and meta["check"](value)
    if problem:
        raise config_error(path, source, f"{problem}, got {quoted}")
    return value


def from_text(f: Field, text: str, path: str, source: str) -> Any:
    """A key's value from text (an environment variable, a URL's query): parsed as the
    field's type says; the value is checked by :func:`coerce`."""
    base, optional = annotation(f)
    try:
        if optional and text == "":
            return None
        if f.metadata.get("size"):
            return _parse.parse_size(text)
        if base is bool:
            return _parse.parse_bool(text)
        if base is int:
            return _parse.parse_int(text)
        if base is float:
            return _parse.parse_float(text)
        if base is dict:
            parsed = json.loads(text)
            if not isinstance(parsed, dict):
                raise ValueError(f"expected a JSON object, got {shown(text)}")
            return parsed
    except RecursionError:
        raise config_error(path, source, f"nests more than {MAX_NESTING} levels of lists and "
                                   "mappings") from None
    except ValueError as exc:
        raise config_error(path, source, str(exc)) from None
    return text
