"""Provenance header fields: decoder-layer count, weights version, tokens hash, segments."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from fd_routing_replay.codec import RoutingRecord, decode_record, encode_record, read_header
from fd_routing_replay.codec.record import Provenance, tokens_digest
from fd_routing_replay.errors import RecordError
from tests.test_codec import rebuild, split_layout


def _record(rng, tokens=9, provenance=None, layers=(1, 3, 5)):
    ids = np.stack([np.argsort(rng.random((tokens, 16)), axis=-1)[:, :4]
                    for _ in layers]).astype(np.uint8)
    return RoutingRecord("exp_p:0:0", np.ascontiguousarray(ids), 16, layers=layers,
                         provenance=provenance or Provenance())


def test_tokens_digest_is_xxh3_of_little_endian_int64(seed):
    tokens = np.random.default_rng(seed).integers(0, 150_000, size=37)
    expected = xxhash.xxh3_64_intdigest(b"".join(int(t).to_bytes(8, "little") for t in tokens))
    assert tokens_digest(tokens) == expected
    assert tokens_digest(list(map(int, tokens))) == expected        # any integer sequence
    assert tokens_digest(tokens.astype(np.int32)) == expected         # any integer width
    with pytest.raises(RecordError):
        tokens_digest(np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(RecordError):
        tokens_digest([1.5, 2.0])
    with pytest.raises(RecordError):
        tokens_digest([-1, 2])


def test_fields_round_trip_and_old_records_read_without_them(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, size=12)
    provenance = Provenance(num_decoder_layers=6, weights_version="step-1234",
                            tokens_hash=tokens_digest(tokens[:9]), segments=(0, 4, 7))
    record = _record(rng, provenance=provenance)
    buffer = encode_record(record)
    got = decode_record(buffer)
    assert got.provenance == provenance
    assert (got.num_decoder_layers, got.weights_version, got.segments) == (6, "step-1234", (0, 4, 7))
    header = read_header(buffer)
    assert header.provenance == provenance
    assert header.as_dict()["num_decoder_layers"] == 6 and header.as_dict()["segments"] == [0, 4, 7]
    got.check_tokens(tokens)                 # prompt + response: the first 9 are hashed
    changed = tokens.copy()
    changed[3] += 1
    with pytest.raises(RecordError, match="do not belong to these tokens"):
        got.check_tokens(changed)
    with pytest.raises(RecordError, match="covers 9 positions"):
        got.check_tokens(tokens[:5])
    plain = decode_record(encode_record(_record(rng)))
    assert plain.provenance == Provenance() and "tokens_hash" not in read_header(encode_record(plain)).as_dict()
    plain.check_tokens(changed)              # nothing recorded: nothing to check


@pytest.mark.parametrize("provenance, message", [
    (Provenance(num_decoder_layers=5), "not above the layer map's last layer 5"),
    (Provenance(num_decoder_layers=0), "num_decoder_layers must be an int"),
    (Provenance(weights_version=""), "weights_version must be a str"),
    (Provenance(weights_version="v" * 257), "weights_version must be a str"),
    (Provenance(tokens_hash=2**64), "tokens_hash must be an int"),
    (Provenance(tokens_hash=-1), "tokens_hash must be an int"),
    (Provenance(segments=(1, 4)), "segments must start at 0"),
    (Provenance(segments=(0, 4, 4)), "segments must start at 0"),
    (Provenance(segments=(0, 9)), "stay below the 9 tokens"),
    # NumPy ints cannot be stored (msgpack): refused by name at validation, as ints are checked
    # everywhere in a record (they used to pass it and fail in msgpack as "metadata/producer")
    (Provenance(num_decoder_layers=np.int64(8)), r"num_decoder_layers must be an int .* got np.int64\(8\)"),
    (Provenance(segments=(0, np.int32(4))), "segments must be a sequence of ints"),
])
def test_bad_fields_are_refused_at_encode_naming_them(seed, provenance, message):
    with pytest.raises(RecordError, match=message):
        encode_record(_record(np.random.default_rng(seed), provenance=provenance))


@pytest.mark.parametrize("key, value", [("nd", 2), ("nd", "6"), ("wv", 7), ("th", -3),
                                        ("sg", [0, 0]), ("sg", "0,4"), ("sg", [0, 99])])
def test_crafted_bad_fields_fail_decoding_with_a_clear_error(seed, key, value):
    _, _, header, _, payload = split_layout(encode_record(_record(np.random.default_rng(seed))))
    header[key] = value
    with pytest.raises(RecordError, match="provenance"):
        decode_record(rebuild(header, payload))


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_provenance_survives_the_writer(tmp_path, seed, mode):
    """The writer ships the record to its worker (maybe another process) field by field."""
    from fd_routing_replay.store.local import LocalStore
    from fd_routing_replay.writer import RoutingWriter

    rng = np.random.default_rng(seed)
    provenance = Provenance(num_decoder_layers=6, weights_version="w7", tokens_hash=12345,
                            segments=(0, 5))
    record = _record(rng, provenance=provenance)
    store = {"type": "local", "namespace": "prov", "local": {"root": str(tmp_path / "store")}}
    with RoutingWriter(store, {"mode": mode, "journal_dir": str(tmp_path / "j"),
                               "dead_letter_dir": str(tmp_path / "d")}) as writer:
        writer.submit_put("exp_p:0:0", record)
        assert writer.flush(timeout=60)
    got = decode_record(LocalStore(tmp_path / "store", "prov").get("exp_p:0:0"))
    assert got.provenance == provenance
    np.testing.assert_array_equal(got.ids, record.ids)
