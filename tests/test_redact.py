"""fd_routing_replay.core.redact: the one rule that hides passwords in URLs, text and logs."""

from __future__ import annotations

import logging

import pytest

from fd_routing_replay.core.redact import (
    MASK,
    RedactingFilter,
    redact_text,
    redact_url,
    redact_value,
)


@pytest.mark.parametrize("url,expected", [
    ("redis://alice:s3cret@h:6379/0", "redis://alice:***@h:6379/0"),
    ("redis://:s3cret@h:6379/0", "redis://:***@h:6379/0"),
    ("redis://s3cret@h/0", "redis://***@h/0"),             # a lone token may be a password
    ("rediss://h/0?password=s3cret&db=1", "rediss://h/0?password=***&db=1"),
    ("redis://h/0?ssl_cert_reqs=none&Password=s3cret#x", "redis://h/0?ssl_cert_reqs=none&Password=***#x"),
    ("redis://u:pa/ss@h:1/0", "redis://u:***@h:1/0"),       # unescaped '/' in the password
    ("redis://u:pa?ss@h:1/0", "redis://u:***@h:1/0"),       # unescaped '?' in the password
    ("redis://u:p@ss@h:1/0", "redis://u:***@h:1/0"),        # unescaped '@' in the password
    ("redis+sentinel://s3cret@h1:26379,h2:26379/mymaster/0",
     "redis+sentinel://***@h1:26379,h2:26379/mymaster/0"),
    ("p2pstore://u:s3cret@[fe80::1]:6379/0?protocol=tcp", "p2pstore://u:***@[fe80::1]:6379/0?protocol=tcp"),
    ("redis://u:s3cret@h:notaport/0", "redis://u:***@h:notaport/0"),
    ("redis://u:s3cret@[::1", "redis://u:***@[::1"),
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("local:///data/user@host/rr", "local:///data/user@host/rr"),  # a path, not credentials
    ("memory://", "memory://"),
    ("not a url", "not a url"),
    ("", ""),
])
def test_redact_url(url, expected):
    assert redact_url(url) == expected
    assert redact_url(expected) == expected  # idempotent
    assert "s3cret" not in redact_url(url)


def test_redact_text_finds_every_url():
    text = ("cannot connect to 'redis://a:one@h:1/0' (from file x.yaml); metadata "
            "redis+sentinel://two@h:2/m, fallback rediss://h/0?password=three.")
    redacted = redact_text(text)
    assert not any(word in redacted for word in ("one@", "two", "three"))
    assert "'redis://a:***@h:1/0'" in redacted and "(from file x.yaml)" in redacted
    assert redact_text("no url here: a@b") == "no url here: a@b"


def test_redact_value_masks_secret_keys_and_urls():
    value = {"password": "p1", "url": "redis://u:p2@h", "nested": [{"api_token": "p3"}],
             "count": 3, "secret_key": None, "name": "ok"}
    assert redact_value(value) == {"password": MASK, "url": "redis://u:***@h",
                                   "nested": [{"api_token": MASK}], "count": 3,
                                   "secret_key": None, "name": "ok"}


@pytest.mark.parametrize("text", ["://", "x://@", "redis://@@@", "redis://[", "a://b:c@",
                                  "redis://u:p@h?password", "redis://h?&&=&password=",
                                  "\x00://\x00@\x00", "é://ü:ö@ß"])
def test_never_raises_on_malformed_input(text):
    assert isinstance(redact_url(text), str) and isinstance(redact_text(text), str)


def test_logging_filter_masks_messages(caplog):
    logger = logging.getLogger("fd_routing_replay.test_redact")
    handler = logging.Handler()
    records: list[logging.LogRecord] = []
    handler.emit = records.append  # type: ignore[method-assign]
    handler.addFilter(RedactingFilter())
    logger.addHandler(handler)
    try:
        logger.warning("store %s is down", "redis://u:hunter2@h:6379/0")
        logger.warning("plain %d", 7)
    finally:
        logger.removeHandler(handler)
    assert records[0].getMessage() == "store redis://u:***@h:6379/0 is down"
    assert records[1].getMessage() == "plain 7"
