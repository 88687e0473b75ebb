"""What a response carries in FastDeploy's response mode (``ResponseRoutes``): the record
itself, or a reference after the record went to the real writer (inline or in a thread)."""

from __future__ import annotations

import base64
import logging
import uuid

import numpy as np
import pytest

from fd_routing_replay.capture.fd26 import ResponseRoutes, as_bytes
from fd_routing_replay.codec import RoutingRecord, decode_record, encode_record, read_header
from fd_routing_replay.codec.reference import parse_reference
from fd_routing_replay.config import load_config
from fd_routing_replay.errors import ConfigError, RecordError
from fd_routing_replay.reader import RoutingReader
from fd_routing_replay.store import open_store
from fd_routing_replay.writer import RoutingWriter


def config(tmp_path, **response):
    return load_config(overrides={"store": {"type": "local", "local": {"root": str(tmp_path / "store")}},
                                  "writer": {"mode": "thread"}, "response": response}, env={})


def encoded_record(seed: int, rollout_id: str = "exp_5:2:0", *,
                   min_tokens: int = 1) -> tuple[np.ndarray, RoutingRecord]:
    gen = np.random.default_rng(seed)
    tokens = int(gen.integers(min_tokens, 30))
    ids = np.argsort(gen.random((3, tokens, 300)), axis=-1)[..., :4].astype(np.uint16)
    record = RoutingRecord(rollout_id, ids, 300, 65535, {})
    # what the finisher returns in response mode: a uint8 view of the encoded bytes
    return np.frombuffer(encode_record(record), dtype=np.uint8), record


def test_the_config_keys_default_to_the_payload_without_streaming(tmp_path):
    cfg = config(tmp_path)
    assert cfg.response.routes == "payload" and cfg.response.stream is False
    env = {"FD_RR_RESPONSE__ROUTES": "reference", "FD_RR_RESPONSE__STREAM": "true"}
    cfg = load_config(env=env)
    assert cfg.response.routes == "reference" and cfg.response.stream is True
    with pytest.raises(ConfigError, match="response.routes: invalid value 'records'"):
        load_config(overrides={"response": {"routes": "records"}}, env={})


@pytest.mark.parametrize(("capture", "message"), [
    ({"encoding": "set"}, "capture.encoding is 'set' \\(set 'plain'\\)"),
    ({"record_format": "fastdeploy-raw"}, "capture.record_format is 'fastdeploy-raw' \\(set 'rr-v1'\\)"),
])
def test_a_reference_needs_the_plain_rr_v1_record_it_pins(capture, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides={"response": {"routes": "reference"}, "capture": capture}, env={})


def test_payload_mode_returns_the_record_bytes_without_a_copy(tmp_path, seed):
    routes = ResponseRoutes(config(tmp_path))
    encoded, record = encoded_record(seed)
    data = routes.deliver(encoded)
    assert isinstance(data, bytes) and data is encoded.base
    np.testing.assert_array_equal(decode_record(data).ids, record.ids)
    assert routes.deliver(None) is None
    assert base64.b64decode(routes.stream_text(data)) == data
    assert as_bytes(encoded[:10]) == bytes(encoded[:10])         # a view of part: copied


def test_reference_mode_stores_the_record_inline_and_returns_its_reference(tmp_path, seed, make_writer):
    cfg = config(tmp_path, routes="reference")
    url = f"memory://response-{uuid.uuid4().hex[:12]}"
    store = open_store(url)
    routes = ResponseRoutes(cfg, make_writer(url))
    encoded, record = encoded_record(seed)
    data = routes.deliver(encoded)
    ref = parse_reference(data)
    header = read_header(encoded)
    assert (ref.key, ref.checksum, ref.size) == (record.rollout_id, header.checksum, header.payload_length)
    assert ref.namespace == cfg.store.namespace and ref.store == "local"
    np.testing.assert_array_equal(RoutingReader(store).resolve(ref, timeout=0).ids, record.ids)
    assert routes.counters == {"references_returned": 1, "references_failed": 0}


def test_reference_mode_through_the_background_writer_resolves_once_durable(tmp_path, seed):
    cfg = config(tmp_path, routes="reference")
    sink = RoutingWriter.from_config(cfg)
    try:
        routes = ResponseRoutes(cfg, sink)
        encoded, record = encoded_record(seed)
        ref = parse_reference(routes.deliver(encoded))
        with RoutingReader(open_store(f"local://{tmp_path / 'store'}")) as reader:
            resolved = reader.resolve(ref, timeout=60)     # waits for the writer, if it must
        np.testing.assert_array_equal(resolved.ids, record.ids)
        assert resolved.rollout_id == record.rollout_id
    finally:
        sink.close()


def test_a_writer_that_refuses_the_record_means_no_routes_not_a_dangling_reference(tmp_path, seed, caplog,
                                                                                   make_writer):
    closed = make_writer(f"memory://response-{uuid.uuid4().hex[:12]}")
    closed.close()
    routes = ResponseRoutes(config(tmp_path, routes="reference"), closed)
    encoded, record = encoded_record(seed, "exp_7:0:1")
    with caplog.at_level(logging.ERROR, logger="fd_routing_replay.capture.fd26"):
        assert routes.deliver(encoded) is None
    assert "exp_7:0:1" in caplog.text and "RoutingWriter is closed" in caplog.text
    assert routes.counters == {"references_returned": 0, "references_failed": 1}
    assert routes.deliver(b"\x89R3R garbage") is None                # unreadable: counted, logged
    assert routes.counters["references_failed"] == 2


def test_reference_mode_without_a_writer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needs a writer"):
        ResponseRoutes(config(tmp_path, routes="reference"))


def test_the_store_named_in_a_reference_has_no_password(tmp_path, seed, make_writer):
    cfg = load_config(overrides={"store": {"url": "redis://alice:s3cret@10.0.0.5:6379/0"},
                                 "response": {"routes": "reference"}}, env={})
    routes = ResponseRoutes(cfg, make_writer(f"memory://response-{uuid.uuid4().hex[:12]}"))
    ref = parse_reference(routes.deliver(encoded_record(seed)[0]))
    assert ref.store == "redis://alice:***@10.0.0.5:6379/0"
    with pytest.raises(RecordError, match="redis://alice:\\*\\*\\*@10.0.0.5"):
        RoutingReader(open_store(f"memory://response-{uuid.uuid4().hex[:12]}")).resolve(ref, timeout=0)


def test_a_record_the_writer_drops_gets_no_reference(tmp_path, seed, caplog):
    """``full_policy: drop`` with no room: the writer drops the record, so the response must
    not promise it."""
    cfg = load_config(overrides={"store": {"type": "local", "local": {"root": str(tmp_path / "store")}},
                                 "writer": {"mode": "thread", "capacity_bytes": 64, "full_policy": "drop"},
                                 "response": {"routes": "reference"}}, env={})
    sink = RoutingWriter.from_config(cfg)
    try:
        routes = ResponseRoutes(cfg, sink)
        # 3 layers x 4 experts x uint16 = 24 bytes a token: 3 tokens or more never fit in 64
        encoded, record = encoded_record(seed, "exp_8:0:0", min_tokens=3)
        assert record.ids.nbytes > 64
        with caplog.at_level(logging.ERROR, logger="fd_routing_replay.capture.fd26"):
            assert routes.deliver(encoded) is None
        assert "exp_8:0:0" in caplog.text and "dropped" in caplog.text
        assert routes.counters["references_failed"] == 1 and sink.stats()["dropped"] == 1
    finally:
        sink.close()
