"""Partial records (#25 part 4) outside the capture: the config key and its refusals, the
reader's prefetch, retention and ``fd-rr`` (ls, show, rm) treating ``{rollout_id}_partial``
keys right, and fsck on Redis finding partials their final record superseded."""

from __future__ import annotations

import json
import time
import uuid

import numpy as np
import pytest

from fd_routing_replay.cli import main
from fd_routing_replay.codec import RoutingRecord, encode_record
from fd_routing_replay.config import load_config
from fd_routing_replay.errors import ConfigError, RecordError
from fd_routing_replay.keys import partial_key
from fd_routing_replay.reader import RoutingReader
from fd_routing_replay.store import open_store
from fd_routing_replay.store.index.fsck import fsck
from fd_routing_replay.store.local import LocalStore
from fd_routing_replay.store.retention import apply_retention, sweep

NOW = 1_800_000_000.0


def put(store, key, ids, *, created, partial=False, rollout_id=None):
    rollout_id = rollout_id or key.removesuffix("_partial")
    metadata = {"num_tokens": int(ids.shape[1]), **({"partial": True} if partial else {})}
    value = encode_record(RoutingRecord(rollout_id, ids, 16, metadata=metadata, created=created))
    store.put(key, value)
    return len(value)


def routes(rng, tokens):
    return rng.integers(0, 16, (2, tokens, 4)).astype(np.uint8)


# -- config ----------------------------------------------------------------------------------------

def test_the_config_key_and_what_it_refuses():
    assert load_config(env={}).capture.partial_every_tokens == 0
    config = load_config(env={"FD_RR_CAPTURE__PARTIAL_EVERY_TOKENS": "4096"})
    assert config.capture.partial_every_tokens == 4096
    with pytest.raises(ConfigError, match="partial_every_tokens.*>= 0"):
        load_config(overrides={"capture": {"partial_every_tokens": -1}}, env={})
    with pytest.raises(ConfigError, match="record_format 'fastdeploy-raw' cannot"):
        load_config(overrides={"capture": {"partial_every_tokens": 64, "record_format": "fastdeploy-raw"},
                               "store": {"local": {"layout": "fastdeploy"}}}, env={})
    for store in ({"local": {"layout": "fastdeploy"}}, {"url": "local:///tmp/rr?layout=fastdeploy"}):
        with pytest.raises(ConfigError, match="fastdeploy layout holds only"):
            load_config(overrides={"capture": {"partial_every_tokens": 64}, "store": store}, env={})
    # per-layer finals and padding are fine: the partial record is fused and unpadded
    load_config(overrides={"capture": {"partial_every_tokens": 64, "fused": False,
                                       "pad_to_max_model_len": True}}, env={})


# -- the reader's prefetch --------------------------------------------------------------------------

def test_prefetch_the_partial_then_only_the_rest_of_the_final(tmp_path, seed):
    rng = np.random.default_rng(seed)
    store = LocalStore(tmp_path, "rd")
    reader = RoutingReader(store)
    rid = "agent_3:1:4:0"
    whole = routes(rng, 300)
    assert reader.get_partial(rid) is None
    n = int(rng.integers(1, 299))
    put(store, partial_key(rid), np.ascontiguousarray(whole[:, :n]), created=NOW, partial=True)
    put(store, partial_key("agent_3:1:5:0"), routes(rng, 3), created=NOW, partial=True)
    partial = reader.get_partial(rid)
    assert partial.num_tokens == n and partial.metadata["partial"] is True
    np.testing.assert_array_equal(partial.ids, whole[:, :n])
    assert reader.get(rid) is None                          # a partial is never the final
    assert reader.list_rollouts("agent_3") == [] and reader.list_partials("agent_3") == [
        "agent_3:1:4:0", "agent_3:1:5:0"]
    put(store, rid, whole, created=NOW + 1)
    rest = reader.get_slice(rid, tokens=slice(partial.num_tokens, None))
    np.testing.assert_array_equal(np.concatenate([partial.ids, rest.ids], axis=1), reader.get(rid).ids)
    # what is not a partial of that rollout is refused, naming the key
    put(store, partial_key("agent_3:1:6:0"), routes(rng, 3), created=NOW, rollout_id="agent_3:1:6:0")
    with pytest.raises(RecordError, match="not marked partial"):
        reader.get_partial("agent_3:1:6:0")
    put(store, partial_key("agent_3:1:7:0"), routes(rng, 3), created=NOW, partial=True,
        rollout_id="agent_3:1:8:0")
    with pytest.raises(RecordError, match="belongs to rollout 'agent_3:1:8:0'"):
        reader.get_partial("agent_3:1:7:0")


# -- retention ---------------------------------------------------------------------------------------

@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path):
    url = f"local://{tmp_path}" if request.param == "local" else f"memory://part-{uuid.uuid4().hex[:8]}"
    with open_store(url, "ret") as opened:
        yield opened


def test_retention_ages_partials_like_records_and_sweeps_only_superseded_ones(store, seed):
    rng = np.random.default_rng(seed)
    put(store, "done:0:0", routes(rng, 9), created=NOW - 10)
    put(store, partial_key("done:0:0"), routes(rng, 4), created=NOW - 20, partial=True)   # debris
    put(store, "layers:0:0_0", routes(rng, 9)[:1], created=NOW - 10, rollout_id="layers:0:0")
    put(store, partial_key("layers:0:0"), routes(rng, 4), created=NOW - 20, partial=True)
    put(store, "again:0:0", routes(rng, 9), created=NOW - 50)                  # an older final...
    put(store, partial_key("again:0:0"), routes(rng, 4), created=NOW - 5, partial=True)  # ...sent again
    put(store, partial_key("running:0:0"), routes(rng, 4), created=NOW - 5, partial=True)
    put(store, partial_key("stalled:0:0"), routes(rng, 4), created=NOW - 7200, partial=True)
    dry = sweep(store, ttl_s=3600, dry_run=True, clock=lambda: NOW, partials=True)
    assert dry.superseded == [partial_key("done:0:0"), partial_key("layers:0:0")]
    assert dry.expired == [partial_key("stalled:0:0")] and dry.deleted == 0
    plain = sweep(store, ttl_s=3600, dry_run=True, clock=lambda: NOW)           # fd-rr rm --older-than
    assert plain.superseded == [] and plain.expired == [partial_key("stalled:0:0")]
    report = apply_retention(store, ttl_s=3600, clock=lambda: NOW)
    assert report.deleted == 3 and report.to_dict()["superseded"] == dry.superseded
    assert store.list() == sorted(["again:0:0", partial_key("again:0:0"), "done:0:0", "layers:0:0_0",
                                   partial_key("running:0:0")])


# -- fd-rr --------------------------------------------------------------------------------------------

def test_fd_rr_ls_show_and_rm_know_partial_keys(tmp_path, capsys, seed):
    rng = np.random.default_rng(seed)
    store = LocalStore(tmp_path / "rr", "cli")
    opts = [f"--store=local://{tmp_path / 'rr'}", "--namespace=cli"]
    put(store, "exp_1:0:0", routes(rng, 6), created=NOW)
    put(store, partial_key("exp_1:1:0"), routes(rng, 5), created=NOW, partial=True)
    put(store, "exp_10:0:0", routes(rng, 6), created=NOW)
    assert main(["ls", "exp_1", "--count", *opts]) == 0
    out, err = capsys.readouterr()
    assert out.split() == ["exp_1:0:0", "exp_1:1:0_partial"] and "2 record(s), 1 of them partial" in err
    assert main(["ls", "--partial", "--json", *opts]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["keys"] == ["exp_1:1:0_partial"] and listed["partial"] == listed["count"] == 1
    assert main(["ls", "exp_10", "--partial", *opts]) == 0
    assert "no partial records under prefix 'exp_10'" in capsys.readouterr().err
    assert main(["show", partial_key("exp_1:1:0"), "--json", *opts]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["header"]["metadata"]["partial"] is True and shown["header"]["shape"][1] == 5
    put(store, partial_key("exp_1:2:0"), routes(rng, 5), created=NOW)        # not marked partial
    assert main(["show", partial_key("exp_1:2:0"), *opts]) == 1
    assert "not marked partial" in capsys.readouterr().err
    assert main(["rm", "--prefix", "exp_1:1", "--yes", *opts]) == 0       # a prefix takes the partial
    capsys.readouterr()
    assert store.list() == ["exp_10:0:0", "exp_1:0:0", partial_key("exp_1:2:0")]


@pytest.mark.redis
def test_fsck_counts_partials_and_repairs_the_superseded_ones(redis_server_clean, seed):
    rng = np.random.default_rng(seed)
    store = open_store({"url": redis_server_clean.url, "namespace": "fsckp"})
    put(store, "f:0:0", routes(rng, 8), created=time.time())
    put(store, partial_key("f:0:0"), routes(rng, 4), created=time.time(), partial=True)
    put(store, "g:0:0_0", routes(rng, 8)[:1], created=time.time(), rollout_id="g:0:0")
    put(store, partial_key("g:0:0"), routes(rng, 4), created=time.time(), partial=True)
    put(store, partial_key("h:0:0"), routes(rng, 4), created=time.time(), partial=True)   # running
    report = fsck(store, batch=int(rng.integers(1, 4)))
    assert report.consistent and report.partials == 3
    assert report.superseded_partials == [partial_key("f:0:0"), partial_key("g:0:0")]
    assert "partial records  3, 2 superseded by their final record (--repair deletes them)" in report.to_text()
    repaired = fsck(store, repair=True)
    assert repaired.repaired and "result: consistent" in repaired.to_text()
    assert store.list() == ["f:0:0", "g:0:0_0", partial_key("h:0:0")]
    after = fsck(store)
    assert after.partials == 1 and after.superseded_partials == [] and after.consistent
    store.close()
