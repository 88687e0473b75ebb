"""Rollout ids, request ids, store keys and boundary-safe prefixes (fd_routing_replay.keys)."""

from __future__ import annotations

import os
import uuid

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fd_routing_replay.errors import InvalidRolloutId
from fd_routing_replay.keys import (
    MAX_KEY_BYTES,
    SEPARATORS,
    RolloutId,
    check_key,
    check_namespace,
    check_prefix,
    key_components,
    layer_key,
    parse_request_id,
    parse_rollout_id,
    prefix_matches,
    previous_turn,
)

UUID = "d9f16c5c-65f6-4815-b44d-14e2c581907c"


def _rejects(func, text, rule: str, shown: str | None = None) -> str:
    """Call ``func(text)``, expect InvalidRolloutId naming ``rule`` and showing the text."""
    with pytest.raises(InvalidRolloutId) as info:
        func(text)
    message = str(info.value)
    assert rule in message, message
    if shown is None:  # texts over 120 characters are shown as head...tail
        shown = repr(text) if len(text) <= 120 else repr(text[:80])
    expected = shown
    assert expected in message, message
    return message


# --------------------------------------------------------------------------- rollout ids


@pytest.mark.parametrize(
    ("text", "base", "turn", "segment"),
    [
        ("exp_a_1:0:0", "exp_a_1", 0, 0),
        ("exp_epoch_3:12:4:2:1", "exp_epoch_3:12:4", 2, 1),
        ("xxx_xxx_epoch_15:2:2:1", "xxx_xxx_epoch_15:2", 2, 1),
        ("a:10:20", "a", 10, 20),
        ("实验_1:0:3", "实验_1", 0, 3),
        ("my-exp.v2_7:99999999999999999999:0", "my-exp.v2_7", 99999999999999999999, 0),
        ("_lead:1:2", "_lead", 1, 2),
    ],
)
def test_parse_rollout_id_valid(text, base, turn, segment):
    parsed = parse_rollout_id(text)
    assert parsed == RolloutId(base=base, turn=turn, segment=segment, text=text)
    assert str(parsed) == text


REJECTIONS = [
    ("", "must not be empty"),
    ("exp", "must end with ':{turn}:{segment}'"),
    ("exp:0", "must end with ':{turn}:{segment}'"),
    (":0:0", "base must not be empty"),
    ("exp::0", "turn must not be empty"),
    ("exp:0:", "segment must not be empty"),
    ("exp:a:0", "turn must be a non-negative decimal integer"),
    ("exp:-1:0", "turn must be a non-negative decimal integer"),
    ("exp:+1:0", "turn must be a non-negative decimal integer"),
    ("exp:0x1:0", "turn must be a non-negative decimal integer"),
    ("exp:01:0", "without sign or leading zeros"),
    ("exp:0:1.5", "segment must be a non-negative decimal integer"),
    ("exp:0:\u0661", "segment must be a non-negative decimal integer"),  # Arabic-Indic one
    ("exp:1_0:0", "turn must be a non-negative decimal integer"),
    ("exp/a:0:0", "must not contain path separators"),
    ("exp\\a:0:0", "must not contain path separators"),
    ("../etc:0:0", "must not contain path separators"),
    ("exp..a:0:0", "must not contain '..'"),
    ("exp a:0:0", "must not contain whitespace"),
    ("exp\u00a0a:0:0", "must not contain whitespace"),
    ("exp\u3000a:0:0", "must not contain whitespace"),
    ("exp\u2028a:0:0", "must not contain whitespace"),
    ("exp\x00a:0:0", "must not contain control or format characters"),
    ("exp\na:0:0", "must not contain control or format characters"),
    ("exp\ta:0:0", "must not contain control or format characters"),
    ("exp\x7fa:0:0", "must not contain control or format characters"),
    ("exp\u200ba:0:0", "must not contain control or format characters"),
    ("exp\u202ea:0:0", "must not contain control or format characters"),
    ("exp\ud800a:0:0", "lone surrogate"),
    (".hidden:0:0", "must not start with '.'"),
    (".:0:0", "must not start with '.'"),
    ("x" * 513, "at most 512 bytes"),
    ("é" * 300, "at most 512 bytes"),
]


@pytest.mark.parametrize(("text", "rule"), REJECTIONS)
def test_parse_rollout_id_rejects(text, rule):
    message = _rejects(parse_rollout_id, text, rule)
    assert message.startswith("invalid rollout id ")


@pytest.mark.parametrize(("text", "escaped"), [("a\x00b:0:0", "\\x00"), ("a\nb:0:0", "\\n"),
                                              ("a\u200bb:0:0", "\\u200b")])
def test_rejection_escapes_invisible_characters(text, escaped):
    with pytest.raises(InvalidRolloutId) as info:
        parse_rollout_id(text)
    assert escaped in str(info.value)
    assert text not in str(info.value)


def test_rollout_id_length_is_counted_in_utf8_bytes():
    ok = "é" * 250 + ":0:0"  # 250 characters of 2 bytes: 504 bytes
    assert parse_rollout_id(ok).turn == 0
    too_long = "é_" * 170 + ":0:0"  # 344 chars, 514 bytes
    message = _rejects(parse_rollout_id, too_long, "at most 512 bytes of UTF-8 (got 514)",
                       shown=repr(too_long[:80]))
    assert "(344 chars)" in message  # huge texts are shortened, with their length


def test_rollout_id_at_limit_is_accepted():
    text = "a" * 508 + ":0:0"
    assert len(text.encode()) == 512
    assert parse_rollout_id(text).base == "a" * 508
    _rejects(parse_rollout_id, "c" + text, "at most 512 bytes", shown=repr(("c" + text)[:80]))


@pytest.mark.parametrize("value", [None, b"exp:0:0", 5, ["exp:0:0"]])
def test_non_strings_are_rejected(value):
    for func in (parse_rollout_id, check_key, check_prefix, parse_request_id, check_namespace):
        with pytest.raises(InvalidRolloutId, match="must be a str"):
            func(value)


def test_invalid_rollout_id_is_a_value_error():
    with pytest.raises(ValueError):
        parse_rollout_id("no grammar")


# --------------------------------------------------------------------------- request ids


@pytest.mark.parametrize(
    ("request_id", "rollout"),
    [
        (f"chatcmpl-exp_a_1:0:0-{UUID}", "exp_a_1:0:0"),
        (f"chatcmpl-exp_a_1:0:0-{UUID}_0", "exp_a_1:0:0"),
        (f"chatcmpl-exp_a_1:0:0-{UUID}_17", "exp_a_1_n17:0:0"),     # choice 17 of n
        (f"cmpl-exp_a_1:3:2-{UUID}_1", "exp_a_1_n1:3:2"),
        (f"chatcmpl-xxx_xxx_epoch_15:2:2:1-{UUID}_0", "xxx_xxx_epoch_15:2:2:1"),
        (f"chatcmpl-my-exp_run-2_data_7:3:1:0-{UUID}_0", "my-exp_run-2_data_7:3:1:0"),
        (f"chatcmpl-a-{UUID}:0:0-{UUID}", f"a-{UUID}:0:0"),
        (f"chatcmpl-a-{UUID}_3:0:0-{UUID}_3", f"a-{UUID}_3_n3:0:0"),
        ("chatcmpl-job:2:1_4", "job_n4:2:1"),                       # client request id, choice 4
        ("chatcmpl-job:2:1_0", "job:2:1"),
        (f"chatcmpl-exp:0:0-{UUID.upper()}", "exp:0:0"),
        (f"chatcmpl-chatcmpl-x:1:1-{UUID}", "chatcmpl-x:1:1"),
    ],
)
def test_parse_request_id(request_id, rollout):
    assert parse_request_id(request_id) == parse_rollout_id(rollout)


def test_parse_request_id_with_fresh_uuids(rng):
    for _ in range(50):
        user = f"exp-{rng.randrange(10**6)}_d{rng.randrange(100)}:{rng.randrange(9)}:{rng.randrange(9)}"
        choice = rng.randrange(1, 1000)
        suffix = rng.choice(["", "_0", f"_{choice}"])
        prefix = rng.choice(["chatcmpl-", "cmpl-"])
        request_id = f"{prefix}{user}-{uuid.UUID(int=rng.getrandbits(128), version=4)}{suffix}"
        base, turn, segment = user.rsplit(":", 2)
        expected = user if suffix in ("", "_0") else f"{base}_n{choice}:{turn}:{segment}"
        assert parse_request_id(request_id).text == expected


def test_choices_of_one_request_get_distinct_keys_under_the_base():
    from fd_routing_replay.keys import prefix_matches

    ids = {parse_request_id(f"chatcmpl-grpo_7:0:0-{UUID}_{i}").text for i in range(8)}
    assert len(ids) == 8 and "grpo_7:0:0" in ids
    assert all(prefix_matches(rid, "grpo_7") for rid in ids)
    assert not any(prefix_matches(rid, "grpo_70") for rid in ids)


@pytest.mark.parametrize(
    ("request_id", "rule"),
    [
        ("exp:0:0", "must look like 'chatcmpl-{user}-{uuid}[_N]'"),
        (f"exp:0:0-{UUID}", "must look like 'chatcmpl-{user}-{uuid}[_N]'"),
        (f"ChatCmpl-exp:0:0-{UUID}", "must look like 'chatcmpl-{user}-{uuid}[_N]'"),
        (f"chatcmpl-{UUID}", "has no user part"),
        (f"chatcmpl-{UUID}_0", "has no user part"),
        (f"chatcmpl--{UUID}_0", "has no user part"),
        ("chatcmpl-exp:0:0-not-a-uuid", "must end with '-{uuid}'"),
        (f"chatcmpl-exp:0:0-{UUID[:-1]}", "must end with '-{uuid}'"),
        (f"chatcmpl-exp:0:0-{UUID}_", "must end with '-{uuid}'"),
        (f"chatcmpl-exp:0:0-{UUID}_x", "must end with '-{uuid}'"),
        (f"chatcmpl-exp:0:0-{UUID}\n", "must end with '-{uuid}'"),
        (f"chatcmpl-exp:0:0-{UUID.replace('-', '')}", "must end with '-{uuid}'"),
        ("chatcmpl-" + "a" * 1100 + f"-{UUID}", "at most 1024 characters"),
    ],
)
def test_parse_request_id_rejects(request_id, rule):
    shown = repr(request_id) if len(request_id) <= 120 else repr(request_id[:80])
    _rejects(parse_request_id, request_id, rule, shown=shown)


@pytest.mark.parametrize(
    ("user", "rule"),
    [
        ("exp", "must end with ':{turn}:{segment}'"),
        ("exp/../x:0:0", "must not contain path separators"),
        ("exp\x00:0:0", "must not contain control or format characters"),
        ("exp:01:0", "leading zeros"),
    ],
)
def test_parse_request_id_rejects_bad_user(user, rule):
    request_id = f"chatcmpl-{user}-{UUID}_0"
    message = _rejects(parse_request_id, request_id, rule, shown=repr(user))
    assert "user part of request id" in message
    assert repr(request_id) in message


# --------------------------------------------------------------------------- turns


def test_previous_turn():
    assert previous_turn(parse_rollout_id("exp_a:7:2:1")) == parse_rollout_id("exp_a:7:1:1")
    assert previous_turn(parse_rollout_id("a:b:c:10:0")).text == "a:b:c:9:0"
    assert previous_turn(parse_rollout_id("exp:0:3")) is None
    assert previous_turn("exp:1:3") == parse_rollout_id("exp:0:3")
    with pytest.raises(InvalidRolloutId):
        previous_turn("exp:x:3")


# --------------------------------------------------------------------------- store keys


@pytest.mark.parametrize(
    "key",
    ["exp_a_1:0:0:0", "exp_a_1:0:0:0_7", "anything-goes", "x", "_x", "a::b", "a_", "ü_1",
     "a" * 300 + ":0:0", "a" * 512],
)
def test_check_key_accepts(key):
    assert check_key(key) == key


_GRAMMAR_RULES = ("turn", "segment", "base", "without sign")


@pytest.mark.parametrize(("key", "rule"), [
    (text, rule) for text, rule in REJECTIONS if not any(word in rule for word in _GRAMMAR_RULES)
])
def test_check_key_rejects(key, rule):
    message = _rejects(check_key, key, rule)
    assert message.startswith("invalid store key ")


def test_check_key_length_counts_the_layer_suffix():
    assert MAX_KEY_BYTES == 512
    rollout = "a" * 503 + ":0:0"  # 507 bytes
    assert check_key(layer_key(rollout, 1234)) == rollout + "_1234"  # 512 bytes
    _rejects(lambda rid: layer_key(rid, 12345), rollout, "at most 512 bytes",
             shown=repr(rollout[:80]))


def test_check_prefix():
    assert check_prefix("exp:1") == "exp:1"
    assert check_prefix("exp:1:") == "exp:1:"
    assert check_prefix("_") == "_"
    message = _rejects(check_prefix, "", "must not be empty")
    assert "clear()" in message
    _rejects(check_prefix, "exp/", "path separators")
    _rejects(check_prefix, "..", "'..'")
    _rejects(check_prefix, "exp\x00", "control", shown="\\x00")


@pytest.mark.parametrize("ns", ["routing_replay", "a", "A.b-c_1", "0", "x" * 64, "a..b"])
def test_check_namespace_accepts(ns):
    assert check_namespace(ns) == ns


@pytest.mark.parametrize("ns", ["", "_x", ".x", "-x", "a/b", "a b", "x" * 65, "routing\n",
                                "ä", "a:b", "..", "a\\b"])
def test_check_namespace_rejects(ns):
    _rejects(check_namespace, ns, "must match [A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def test_layer_key():
    assert layer_key("exp:0:0", 7) == "exp:0:0_7"
    assert layer_key("exp:0:0", 0) == "exp:0:0_0"
    for bad_layer in (-1, True, "3", 1.0):
        with pytest.raises(InvalidRolloutId, match="layer must be a non-negative int"):
            layer_key("exp:0:0", bad_layer)
    _rejects(lambda rid: layer_key(rid, 3), "exp/x:0:0", "path separators", shown=repr("exp/x:0:0_3"))


# --------------------------------------------------------------------------- prefixes


@pytest.mark.parametrize(
    ("key", "prefix", "expected"),
    [
        ("x:1", "x:1", True),
        ("x:10", "x:1", False),
        ("x:1:0", "x:1", True),
        ("x:1_3", "x:1", True),
        ("x:1_", "x:1", True),
        ("x:1_", "x:1_", True),
        ("x:1_3", "x:1_", True),
        ("x:1:0", "x:1_", False),
        ("x:10", "x:1:", False),
        ("x:1:0", "x:1:", True),
        ("x:1_3", "x:1:", False),
        ("x:1", "x:1:", False),
        ("exp_epoch_10", "exp_epoch_1", False),
        ("exp_epoch_10:0:0", "exp_epoch_1", False),
        ("exp_epoch_1", "exp_epoch_1", True),
        ("exp_epoch_1:0:0:0", "exp_epoch_1", True),
        ("exp_epoch_1_x", "exp_epoch_1_", True),
        ("exp:1", "exp:1", True),
        ("exp:1:0:0", "exp:1", True),
        ("exp:1_3", "exp:1", True),
        ("exp:10", "exp:1", False),
        ("x", "x:1", False),
        ("y:1", "x", False),
        ("x1", "x", False),
        ("x", "", False),
    ],
)
def test_prefix_matches(key, prefix, expected):
    assert prefix_matches(key, prefix) is expected


@pytest.mark.parametrize(
    ("key", "components"),
    [
        ("exp_a_1:0:0", ["exp", "_a", "_1", ":0", ":0"]),
        ("exp_a_1:0:0:0_7", ["exp", "_a", "_1", ":0", ":0", ":0", "_7"]),
        ("x", ["x"]),
        ("_x:0", ["_x", ":0"]),
        ("__x", ["_", "_x"]),
        ("a::0", ["a", ":", ":0"]),
        ("a_", ["a", "_"]),
        ("", []),
    ],
)
def test_key_components(key, components):
    assert key_components(key) == components
    assert "".join(components) == key


# --------------------------------------------------------------------------- properties

_PIECE = st.text(alphabet="abcXYZ0189-.é实", min_size=1, max_size=12)


@st.composite
def valid_rollout_ids(draw) -> tuple[str, str, int, int]:
    pieces = [draw(_PIECE)]
    for _ in range(draw(st.integers(0, 5))):
        pieces.append(draw(st.sampled_from(SEPARATORS)) + draw(st.text(alphabet="abc019-.é", max_size=8)))
    base = "".join(pieces)
    assume(".." not in base and not base.startswith("."))
    turn = draw(st.integers(0, 10**12))
    segment = draw(st.integers(0, 10**6))
    return base, f"{base}:{turn}:{segment}", turn, segment


@settings(max_examples=300, deadline=None)
@given(valid_rollout_ids())
def test_valid_ids_round_trip(case):
    base, text, turn, segment = case
    parsed = parse_rollout_id(text)
    assert (parsed.base, parsed.turn, parsed.segment, parsed.text) == (base, turn, segment, text)
    assert f"{parsed.base}:{parsed.turn}:{parsed.segment}" == text
    assert check_key(text) == text
    assert "".join(key_components(text)) == text
    request_id = f"chatcmpl-{text}-{UUID}_0"
    assert parse_request_id(request_id) == parsed
    previous = previous_turn(parsed)
    if turn == 0:
        assert previous is None
    else:
        assert parse_rollout_id(previous.text) == previous
        assert previous.turn == turn - 1 and previous.base == base


_NASTY = st.text(alphabet="./\\:_ab0 \x00\n\t\u200b\u00a0é", max_size=24)


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.text(max_size=40), _NASTY, valid_rollout_ids().map(lambda c: c[1])))
def test_accepted_keys_cannot_escape_the_root(key):
    try:
        check_key(key)
    except InvalidRolloutId:
        return
    assert "/" not in key and "\\" not in key and ".." not in key and "\x00" not in key
    components = key_components(key)
    assert components and all(components) and "".join(components) == key
    assert all(part not in (".", "..") for part in components)
    path = os.path.normpath(os.path.join("/root", *components))
    assert os.path.commonpath(["/root", path]) == "/root" and path != "/root"
    # The mapping is one-to-one: the path gives the components (and the key) back.
    assert os.path.relpath(path, "/root").split(os.sep) == components


def _leading_run(short: list[str], long: list[str]) -> bool:
    return long[: len(short)] == short


def _oracle(key: str, prefix: str) -> bool:
    """Boundary-safe matching restated through prefix buckets (independent of the impl)."""
    if key == prefix:
        return True
    key_parts = key_components(key)
    if len(key_components(prefix)) < len(key_parts) and _leading_run(key_components(prefix), key_parts):
        return True
    if prefix[-1] in SEPARATORS:
        head = key_components(prefix[:-1])
        return (
            len(head) < len(key_parts)
            and _leading_run(head, key_parts)
            and key_parts[len(head)].startswith(prefix[-1])
        )
    return False


_SMALL = st.text(alphabet="ab1:_", min_size=1, max_size=10)


@settings(max_examples=1000, deadline=None)
@given(_SMALL, _SMALL)
def test_prefix_matches_only_at_separators(a, b):
    matched = prefix_matches(b, a)
    assert matched == _oracle(b, a)
    if matched:
        assert b == a or (b.startswith(a) and (a[-1] in SEPARATORS or b[len(a)] in SEPARATORS))
    # A sibling that merely extends the last bucket never matches: x:1 vs x:10.
    if a[-1] not in SEPARATORS:
        assert not prefix_matches(a + "0", a)


@settings(max_examples=200, deadline=None)
@given(valid_rollout_ids(), valid_rollout_ids())
def test_prefix_matches_on_rollout_ids(first, second):
    a, b = first[1], second[1]
    if prefix_matches(b, a):
        assert b == a or b[len(a)] in SEPARATORS or a[-1] in SEPARATORS
    for bucket in (a, a.rsplit(":", 1)[0], a.rsplit(":", 2)[0]):
        assert prefix_matches(a, bucket)
        assert not prefix_matches(bucket + "9", bucket) or bucket[-1] in SEPARATORS
