"""Hide secrets before anything is printed or logged: one rule for the whole package.

Passwords reach this package inside URLs (``redis://user:pw@host/0``, P2PStore's
``redis+sentinel://pw@h1:26379,h2:26379/mymaster``, ``?password=`` query options) and
in secret config keys (``store.redis.password``).  Every message, log line and CLI
output that may hold one goes through :func:`redact_url` (a URL) or
:func:`redact_text` (free text that may contain URLs, such as an exception message);
secret config values are replaced by :data:`MASK` as a whole.

The rule: the password is replaced by ``***`` and everything else is kept, so a message
still says which host, port, database and ACL user were used.  Userinfo without a ``:``
is masked whole, because P2PStore's sentinel form reads a lone ``pw@`` as a password.
These functions never raise: they run inside error paths, on text that may be malformed.
"""

from __future__ import annotations

import logging
import re
from typing import Any

__all__ = ["MASK", "SECRET_QUERY_KEYS", "RedactingFilter", "redact_text", "redact_url",
           "redact_value"]

#: What replaces a secret.
MASK = "***"

#: Query-string options whose value is a secret (compared case-insensitively).
SECRET_QUERY_KEYS = frozenset({"password", "passwd", "pwd", "pass", "secret", "token",
                               "auth", "access_key", "secret_key", "api_key", "apikey"})

_PATH_SCHEMES = frozenset({"local", "file", "memory"})

# scheme://rest — the scheme as RFC 3986 spells it; the rest up to whitespace or a quote.
_URL_RE = re.compile(r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]*")


def redact_url(url: str) -> str:
    """``url`` with its password (userinfo and secret query options) replaced by ``***``.

    ``redis://alice:s3cret@h:6379/0`` → ``redis://alice:***@h:6379/0``;
    ``redis://s3cret@h/0`` → ``redis://***@h/0``; ``rediss://h/0?password=x`` →
    ``rediss://h/0?password=***``.  Text without ``://`` is returned unchanged; malformed
    URLs (bad ports, unclosed IPv6 brackets, several hosts) are handled, never raised on.
    """
    if not isinstance(url, str) or "://" not in url:
        return url
    scheme, _, rest = url.partition("://")
    # The userinfo ends at the last "@", so a password with an unescaped "/", "?" or "#"
    # is still hidden (urlsplit would read part of it as a path or query and show it).
    # Path-only schemes carry no credentials: an "@" there is part of a directory name.
    at = -1 if scheme.lower() in _PATH_SCHEMES else rest.rfind("@")
    userinfo, after = (rest[:at], rest[at + 1:]) if at != -1 else (None, rest)
    cut = next((i for i, char in enumerate(after) if char in "/?#"), len(after))
    hostport, tail = after[:cut], after[cut:]
    if userinfo is None:
        netloc = hostport
    elif ":" in userinfo:
        netloc = f"{userinfo.partition(':')[0]}:{MASK}@{hostport}"
    else:
        netloc = f"{MASK}@{hostport}"
    return f"{scheme}://{netloc}{_redact_query(tail)}"


def _redact_query(tail: str) -> str:
    path, question, query = tail.partition("?")
    if not question:
        return tail
    query, hash_, fragment = query.partition("#")
    parts = []
    for item in query.split("&"):
        name, equals, _ = item.partition("=")
        secret = equals and name.strip().lower() in SECRET_QUERY_KEYS
        parts.append(f"{name}={MASK}" if secret else item)
    return f"{path}?{'&'.join(parts)}{hash_}{fragment}"


def redact_text(text: str) -> str:
    """``text`` with every URL in it passed through :func:`redact_url`."""
    if not isinstance(text, str) or "://" not in text:
        return text
    return _URL_RE.sub(lambda match: redact_url(match.group(0)), text)


def redact_value(value: Any) -> Any:
    """A copy of a plain value (str, list, dict, scalars) with URLs redacted and the
    values of secret-looking mapping keys (``password``, ``token``…) masked whole.

    For free-form settings such as ``store.options`` (whose nesting the config bounds).
    """
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {key: MASK if isinstance(key, str) and _secret_name(key) and item is not None
                else redact_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_value(item) for item in value)
    return value


def _secret_name(name: str) -> bool:
    lowered = name.lower()
    return lowered in SECRET_QUERY_KEYS or lowered.endswith(("password", "_secret", "_token"))


class RedactingFilter(logging.Filter):
    """A logging filter that passes every message through :func:`redact_text`.

    Add it to a handler (``handler.addFilter(RedactingFilter())``) of a process whose
    logs may quote URLs from configs or exceptions; ``fd-rr`` does so for its own.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "://" in message:
            redacted = redact_text(message)
            if redacted != message:
                record.msg, record.args = redacted, None
        return True
