"""Rollout ids, FastDeploy request ids, store keys and boundary-safe prefixes.

Every record is stored under a key derived from a *rollout id* that arrives from the RL
driver (through the OpenAI ``user`` field), so every rule here is a guard against an
untrusted string becoming a path, a wrong delete, or a silently mis-keyed record.

Grammar
-------
A rollout id is ``{base}:{turn}:{segment}`` (parsed from the right; ``base`` may itself
contain ``:`` and ``_``, typically ``{experiment}_{data_id}:{gen_id}``):

* ``turn`` and ``segment`` are canonical non-negative decimal integers: ASCII digits only,
  no sign, no leading zero (``0`` is fine, ``01`` is not — two spellings of one turn would
  make ``only_last_turn`` delete the wrong key);
* ``base`` is non-empty.

Safe-character rules (shared by rollout ids, store keys and prefixes; checked in this
order and the first broken rule is reported — rules 4-6 for the first offending
character):

1. must be a ``str`` and not empty;
2. must be encodable as UTF-8 (no lone surrogates);
3. at most 512 bytes of UTF-8 (rollout ids, store keys — including a ``_{layer}``
   suffix — and prefixes alike);
4. no control or format characters (Unicode categories Cc, Cf, e.g. NUL, ``\\n``,
   zero-width space) — ``\\t`` and ``\\n`` are reported under this rule;
5. no whitespace (anything ``str.isspace`` accepts, including non-breaking spaces);
6. no ``/`` or ``\\`` (path separators);
7. no ``..``;
8. must not start with ``.`` (a lone ``.`` would name a store's directory itself, and
   dot-names are what temporary and hidden files use).

Rule 8 is an addition to DESIGN.md's list; it only rejects ids no real RL driver
produces, and every store applies the same rules (a key valid for one backend is valid
for all).  Long buckets are allowed: the local store splits names that exceed a file
system's limit.

Prefix buckets
--------------
:data:`SEPARATORS` (``:`` and ``_``) split a key into buckets; :func:`prefix_matches`
only matches at those boundaries, so ``exp:1`` never matches ``exp:10``.

Partial records
---------------
A running request's periodic partial record is stored under ``{rollout_id}_partial``
(:func:`partial_key`).  No rollout id ends in ``_partial`` (its last part is a decimal
segment) and no per-layer key does either (its suffix is a decimal layer), so a partial
key never names a final record of any rollout; it continues its rollout id at a
separator, so every prefix that selects the rollout selects its partial too.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from fd_routing_replay.errors import InvalidRolloutId

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_ROLLOUT_ID_BYTES",
    "PARTIAL_SUFFIX",
    "REQUEST_ID_PREFIXES",
    "SEPARATORS",
    "RolloutId",
    "check_key",
    "check_namespace",
    "check_prefix",
    "key_components",
    "layer_key",
    "parse_request_id",
    "parse_rollout_id",
    "partial_key",
    "prefix_matches",
    "previous_turn",
    "split_layer_key",
    "split_partial_key",
]

SEPARATORS: tuple[str, str] = (":", "_")
"""Characters at which prefixes may end; each starts a new prefix bucket."""

MAX_ROLLOUT_ID_BYTES = 512
"""Longest rollout id, in bytes of UTF-8 (DESIGN.md)."""

MAX_KEY_BYTES = MAX_ROLLOUT_ID_BYTES
"""Longest store key or prefix, in bytes of UTF-8 (a ``_{layer}`` suffix counts)."""

MAX_REQUEST_ID_CHARS = 1024
"""Longest request id looked at; anything longer cannot hold a valid rollout id."""

PARTIAL_SUFFIX = "_partial"
"""What a partial record's key adds to its rollout id (see "Partial records" above)."""

REQUEST_ID_PREFIXES: tuple[str, str] = ("chatcmpl-", "cmpl-")
"""Request-id prefixes FastDeploy's OpenAI server adds (chat and text completions)."""

#: Namespaces: an ASCII letter or digit, then up to 63 of letters, digits and ``._-``.
NAMESPACE_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
_NAMESPACE_RE = re.compile(NAMESPACE_PATTERN, re.ASCII)
_DECIMAL_RE = re.compile(r"0|[1-9][0-9]*", re.ASCII)
# Fast path: an ASCII string without any of these is clean for rules 4-7.
_ASCII_SUSPECT_RE = re.compile(r"[\x00-\x20\x7f/\\]|\.\.", re.ASCII)
_SPLIT_RE = re.compile(r"(?=[:_])")
_UUID = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
_REQUEST_ID_RE = re.compile(
    rf"(?P<kind>chatcmpl|cmpl)-(?P<user>.+)-(?P<uuid>{_UUID})(?:_(?P<index>[0-9]+))?",
    re.ASCII | re.DOTALL,
)
_USERLESS_REQUEST_ID_RE = re.compile(rf"(?:chatcmpl|cmpl)--?{_UUID}(?:_[0-9]+)?", re.ASCII)
# A client that sends its own ``request_id`` gets ``chatcmpl-{request_id}[_N]`` (FastDeploy's
# serving_chat.py:134-137, serving_completion.py:105-108): no uuid, no user part.
_CLIENT_REQUEST_ID_RE = re.compile(r"(?P<kind>chatcmpl|cmpl)-(?P<rid>.+?)(?:_(?P<index>[0-9]+))?",
                                   re.ASCII | re.DOTALL)

_SHOW_CHARS = 120


@dataclass(frozen=True)
class RolloutId:
    """A parsed rollout id ``{base}:{turn}:{segment}``; ``text`` is the original string."""

    base: str
    turn: int
    segment: int
    text: str

    def __str__(self) -> str:
        return self.text


def _show(text: object) -> str:
    """``repr`` of ``text`` (control characters visible), shortened when huge."""
    if not isinstance(text, str):
        return f"<{type(text).__name__}>"
    if len(text) <= _SHOW_CHARS:
        return repr(text)
    head, tail = text[:80], text[-30:]
    return f"{head!r}...{tail!r} ({len(text)} chars)"


def _fail(kind: str, text: object, rule: str) -> InvalidRolloutId:
    return InvalidRolloutId(f"invalid {kind} {_show(text)}: {rule}")


def _char_rule(ch: str) -> str | None:
    """The safe-character rule ``ch`` breaks on its own, or None."""
    category = unicodedata.category(ch)
    if category in ("Cc", "Cf"):
        return f"must not contain control or format characters (found {ch!r})"
    if ch.isspace():
        return f"must not contain whitespace (found {ch!r})"
    if ch in "/\\":
        return f"must not contain path separators '/' or '\\' (found {ch!r})"
    return None


def _check_safe(text: object, kind: str, max_bytes: int) -> str:
    """Apply the safe-character rules 1-8; return ``text`` or raise InvalidRolloutId."""
    if not isinstance(text, str):
        raise _fail(kind, text, f"must be a str, got {type(text).__name__}")
    if not text:
        raise _fail(kind, text, "must not be empty")
    if text.isascii():
        size = len(text)
        suspect = _ASCII_SUSPECT_RE.search(text) is not None
    else:
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise _fail(kind, text, "must be valid Unicode (contains a lone surrogate)") from exc
        suspect = True
    if size > max_bytes:
        raise _fail(kind, text, f"must be at most {max_bytes} bytes of UTF-8 (got {size})")
    if suspect:
        for ch in text:
            rule = _char_rule(ch)
            if rule is not None:
                raise _fail(kind, text, rule)
        if ".." in text:
            raise _fail(kind, text, "must not contain '..'")
    if text[0] == ".":
        raise _fail(kind, text, "must not start with '.'")
    return text


def _check_decimal(kind: str, text: str, name: str, value: str) -> int:
    if not value:
        raise _fail(kind, text, f"{name} must not be empty (grammar {{base}}:{{turn}}:{{segment}})")
    if _DECIMAL_RE.fullmatch(value) is None:
        raise _fail(
            kind,
            text,
            f"{name} must be a non-negative decimal integer without sign or leading zeros, "
            f"got {value!r}",
        )
    return int(value)


def parse_rollout_id(text: str) -> RolloutId:
    """Parse ``{base}:{turn}:{segment}`` strictly, from the right.

    Raises InvalidRolloutId naming the offending text (escaped) and the broken rule; never
    evaluates anything.  See the module docstring for the rules.
    """
    kind = "rollout id"
    _check_safe(text, kind, MAX_ROLLOUT_ID_BYTES)
    rest, sep, segment_text = text.rpartition(":")
    if not sep:
        raise _fail(kind, text, "must end with ':{turn}:{segment}' (grammar {base}:{turn}:{segment})")
    base, sep, turn_text = rest.rpartition(":")
    if not sep:
        raise _fail(kind, text, "must end with ':{turn}:{segment}' (grammar {base}:{turn}:{segment})")
    turn = _check_decimal(kind, text, "turn", turn_text)
    segment = _check_decimal(kind, text, "segment", segment_text)
    if not base:
        raise _fail(kind, text, "base must not be empty (grammar {base}:{turn}:{segment})")
    return RolloutId(base=base, turn=turn, segment=segment, text=text)


def parse_request_id(request_id: str) -> RolloutId:
    """Extract the rollout id from a FastDeploy request id.

    FastDeploy's OpenAI server names a request ``chatcmpl-{user}-{uuid}`` (chat) or
    ``cmpl-{user}-{uuid}`` (text completions) when the request sets ``user``; newer
    versions append ``_N`` (decimal).  ``uuid`` is a canonical 36-character UUID
    (8-4-4-4-12 hex digits).  ``user`` may contain ``-`` and ``_``, so the uuid and the
    suffix are stripped from the right and the rest is the rollout id, which must then
    satisfy :func:`parse_rollout_id`.

    A client that sends its own ``request_id`` makes FastDeploy name the request
    ``chatcmpl-{request_id}[_N]``; when that request id is itself a valid rollout id
    (``{base}:{turn}:{segment}``), it is the rollout id.

    ``_N`` is the choice index: a request with ``n`` choices becomes ``n`` engine requests
    ``…_0`` … ``…_{n-1}`` (FastDeploy 2.6 entrypoints/engine_client.py:417-431).  Choice 0
    keeps the rollout id; choice ``N > 0`` is recorded under :func:`choice_rollout_id`
    (``{base}_n{N}:{turn}:{segment}``), so the choices of one request never overwrite
    each other and a prefix delete of the base still covers them all.

    Decision: ids without one of these prefixes are rejected rather than guessed at.
    FastDeploy always adds a prefix, so a bare id means the caller passed something else
    (a rollout id, another engine's id) and keying a record on a guess would misfile it.
    A request without ``user`` (``chatcmpl-{uuid}``) is rejected with a message saying so.
    """
    kind = "request id"
    if not isinstance(request_id, str):
        raise _fail(kind, request_id, f"must be a str, got {type(request_id).__name__}")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise _fail(kind, request_id, f"must be at most {MAX_REQUEST_ID_CHARS} characters")
    if not request_id.startswith(REQUEST_ID_PREFIXES):
        raise _fail(
            kind,
            request_id,
            "must look like 'chatcmpl-{user}-{uuid}[_N]' or 'cmpl-{user}-{uuid}[_N]' "
            "(FastDeploy's OpenAI request id)",
        )
    if _USERLESS_REQUEST_ID_RE.fullmatch(request_id):
        raise _fail(
            kind,
            request_id,
            "has no user part: set the OpenAI 'user' field to the rollout id so FastDeploy "
            "builds 'chatcmpl-{user}-{uuid}'",
        )
    match = _REQUEST_ID_RE.fullmatch(request_id)
    if match is None:
        client = _CLIENT_REQUEST_ID_RE.fullmatch(request_id)
        if client is not None:
            try:       # the client sent the rollout id itself as its request_id
                return choice_rollout_id(parse_rollout_id(client.group("rid")),
                                         int(client.group("index") or 0))
            except InvalidRolloutId:
                pass
        raise _fail(
            kind,
            request_id,
            "must end with '-{uuid}' or '-{uuid}_{N}' where uuid is 8-4-4-4-12 hex digits, "
            "or be 'chatcmpl-{rollout_id}[_N]' (a client-supplied request_id that is a rollout id)",
        )
    user = match.group("user")
    try:
        return choice_rollout_id(parse_rollout_id(user), int(match.group("index") or 0))
    except InvalidRolloutId as exc:
        raise InvalidRolloutId(f"{exc} (user part of request id {_show(request_id)})") from exc


def choice_rollout_id(rollout: RolloutId, choice: int) -> RolloutId:
    """The rollout id choice ``choice`` of a request is recorded under: the rollout id
    itself for choice 0, ``{base}_n{choice}:{turn}:{segment}`` otherwise."""
    if choice == 0:
        return rollout
    return parse_rollout_id(f"{rollout.base}_n{choice}:{rollout.turn}:{rollout.segment}")


def previous_turn(rollout: RolloutId | str) -> RolloutId | None:
    """The same rollout one turn earlier (``only_last_turn`` deletes it); None for turn 0."""
    if isinstance(rollout, str):
        rollout = parse_rollout_id(rollout)
    if rollout.turn == 0:
        return None
    turn = rollout.turn - 1
    return RolloutId(
        base=rollout.base,
        turn=turn,
        segment=rollout.segment,
        text=f"{rollout.base}:{turn}:{rollout.segment}",
    )


def check_key(key: str) -> str:
    """Validate a store key (safe-character rules and length, not the turn grammar).

    Every store calls this on every key it is given, so a key that could escape a
    directory or break a bucket boundary never reaches a backend.  Returns ``key``.
    """
    return _check_safe(key, "store key", MAX_KEY_BYTES)


def check_prefix(prefix: str) -> str:
    """Validate a delete/list prefix like :func:`check_key`; the empty prefix is rejected.

    Use ``clear()`` to remove a whole namespace: an empty prefix matching everything is
    the reference system's foot-gun this package does not reproduce.
    """
    if prefix == "":
        raise _fail("prefix", prefix, "must not be empty (use clear() to remove a namespace)")
    return _check_safe(prefix, "prefix", MAX_KEY_BYTES)


def check_namespace(ns: str) -> str:
    """Validate a namespace: ``[A-Za-z0-9][A-Za-z0-9._-]{0,63}``; returns it."""
    if not isinstance(ns, str):
        raise _fail("namespace", ns, f"must be a str, got {type(ns).__name__}")
    if _NAMESPACE_RE.fullmatch(ns) is None:
        raise _fail(
            "namespace",
            ns,
            "must match [A-Za-z0-9][A-Za-z0-9._-]{0,63} (ASCII letter or digit first, "
            "at most 64 characters)",
        )
    return ns


def layer_key(rollout_id: str, layer: int) -> str:
    """Per-layer store key ``{rollout_id}_{layer}`` (FastDeploy's non-fused layout)."""
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise _fail("store key", rollout_id, f"layer must be a non-negative int, got {layer!r}")
    return check_key(f"{rollout_id}_{layer}")


def split_layer_key(key: str) -> tuple[RolloutId, int | None]:
    """What a store key names: ``(rollout, None)`` for a rollout id, ``(rollout, layer)``
    for a per-layer key ``{rollout_id}_{layer}`` (split at the last ``_``, as FastDeploy
    does).  Anything else raises InvalidRolloutId.
    """
    check_key(key)
    try:
        return parse_rollout_id(key), None
    except InvalidRolloutId:
        pass
    rollout_text, sep, layer = key.rpartition("_")
    if sep and _DECIMAL_RE.fullmatch(layer):
        try:
            return parse_rollout_id(rollout_text), int(layer)
        except InvalidRolloutId:
            pass
    raise _fail("store key", key, "must be a rollout id {base}:{turn}:{segment} or a per-layer "
                "key {rollout_id}_{layer}")


def partial_key(rollout_id: str) -> str:
    """The key of ``rollout_id``'s partial record, ``{rollout_id}_partial``.

    InvalidRolloutId when ``rollout_id`` breaks the grammar, or when the key would exceed
    :data:`MAX_KEY_BYTES` (a rollout id within 8 bytes of the limit gets no partials).
    """
    parse_rollout_id(rollout_id)
    return check_key(rollout_id + PARTIAL_SUFFIX)


def split_partial_key(key: str) -> RolloutId | None:
    """The rollout whose partial record ``key`` names, or None when ``key`` is not a
    partial key (a final record's key, or anything else).  Never raises."""
    if not isinstance(key, str) or not key.endswith(PARTIAL_SUFFIX):
        return None
    try:
        return parse_rollout_id(key[:-len(PARTIAL_SUFFIX)])
    except InvalidRolloutId:
        return None


def prefix_matches(key: str, prefix: str) -> bool:
    """Boundary-safe prefix test: does ``prefix`` select ``key``?

    True iff ``key == prefix``, or ``key`` continues ``prefix`` at a separator
    (``prefix + ':'`` / ``prefix + '_'``), or ``prefix`` itself ends with a separator and
    ``key`` starts with it.  ``exp:1`` matches ``exp:1``, ``exp:1:0:0`` and ``exp:1_3``,
    never ``exp:10``.  Pure and cheap: callers validate with :func:`check_prefix` once.
    """
    if not key.startswith(prefix):
        return False
    if len(key) == len(prefix):
        return True
    if prefix and prefix[-1] in SEPARATORS:
        return True
    return key[len(prefix)] in SEPARATORS


def key_components(key: str) -> list[str]:
    """Split ``key`` into its prefix buckets, each carrying its leading separator.

    ``"exp_a_1:0:0"`` → ``["exp", "_a", "_1", ":0", ":0"]``.  The split happens before
    every separator except one at position 0, so the first component has no leading
    separator of its own (``"_x:0"`` → ``["_x", ":0"]``) and consecutive separators give
    a separator-only bucket (``"a::0"`` → ``["a", ":", ":0"]``).

    Guarantees the local store relies on (it maps components to nested directories):

    * ``"".join(key_components(key)) == key`` and no component is empty;
    * every prefix that :func:`prefix_matches` accepts for ``key`` is either the
      concatenation of a leading run of its components, or — when the prefix ends with a
      separator — such a leading run plus that separator, which is then the first
      character of the next component.  So a prefix delete removes one subtree (or the
      children of one directory whose names start with that separator);
    * for a key that passed :func:`check_key`, no component is ``""``, ``"."`` or
      ``".."`` and none contains a path separator.
    """
    parts = _SPLIT_RE.split(key)
    # A lookahead split at position 0 (key starting with a separator) yields a leading "".
    if parts[0] == "":
        del parts[0]
    return parts
