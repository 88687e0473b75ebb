"""fsck on the P2PStore backend (no quarantine, no layout hook): invalid index members and
payloads with invalid keys are reported, never indexed and never fatal; --deep reads every
record through the provider and verifies its checksum."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fd_routing_replay.codec import RoutingRecord, encode_record
from fd_routing_replay.store.index.fsck import fsck
from fd_routing_replay.store.p2pstore.keys import FILE_INDEX, FILE_PREFIX
from tests.store import test_p2pstore as p2p_tests

open_p2p, p2p_log_dir = p2p_tests.open_p2p, p2p_tests.p2p_log_dir  # the fixtures, shared
needs_client = p2p_tests.needs_client

pytestmark = [
    pytest.mark.p2pstore, pytest.mark.redis,
    pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning"),
]


@needs_client
def test_p2pstore_fsck_reports_invalid_keys_and_members(open_p2p, redis_server_clean):
    import redis

    store = open_p2p("pfsck")
    raw = redis.Redis(port=redis_server_clean.port)
    ids = (np.arange(3 * 4 * 2, dtype=np.uint8) % 16).reshape(3, 4, 2)
    store.put("good_1:0:0", encode_record(RoutingRecord("good_1:0:0", ids, num_experts=16)))
    store.put("raw_1:0:0", b"no header")
    # A payload published under a key that breaks the key rules, and junk in our index.
    evil = "pfsck/../../evil:0:0"
    raw.set(FILE_PREFIX + evil, json.dumps({"host": "127.0.0.1:1", "metadata": {}}))
    raw.sadd(FILE_INDEX, evil)
    raw.zadd(store.index.key, {b"bad\xff:0:0": 0, b"a\nb:0:0": 0})
    assert store.list() == ["good_1:0:0", "raw_1:0:0"]

    report = fsck(store, deep=True)
    assert report.invalid_payloads == ["'../../evil:0:0'"]
    assert sorted(report.invalid_entries) == ["'a\\nb:0:0'", "b'bad\\xff:0:0'"]
    assert (report.verified, report.unverified) == (1, 1)
    assert report.corrupt == {} and report.unreadable == {} and report.unindexed == []

    repaired = fsck(store, repair=True)
    assert not repaired.repaired  # the invalid payload cannot be quarantined here
    assert repaired.unresolved == [f"'../../evil:0:0': left in place and not indexed "
                                   f"({store.describe()} cannot quarantine)"]
    after = fsck(store)
    assert after.invalid_entries == [] and after.invalid_payloads == ["'../../evil:0:0'"]
    assert list(store.index.raw_pages()) == [[b"good_1:0:0", b"raw_1:0:0"]]
    raw.close()
