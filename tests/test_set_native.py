"""The compiled set codec (custom_ops/set_codec.cc through fd_routing_replay.codec.setcodec),
the package's one implementation, against the NumPy oracle (tests/set_oracle.py), bit for
bit; ranks wider than 64 bits; payloads written before they existed; ids of dtypes the
library does not take; what a process without the library does.

Every comparison runs the public ``encode_sets`` / ``decode_sets`` and the oracle's on the
same fresh inputs and checks both against the pure-Python encoder of docs/record-format.md
(tests/test_set_encoding.py).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fd_routing_replay.codec.setcodec as setcodec
import tests.set_oracle as oracle
from fd_routing_replay.codec import RoutingRecord, decode_record, encode_record, routing_dtype
from fd_routing_replay.codec.setcodec import (
    MAX_RANK_BITS,
    SetEncodingError,
    decode_sets,
    encode_sets,
    native_codec,
    set_codec_backend,
)
from fd_routing_replay.core.native import C_LIBRARY, source_digest
from fd_routing_replay.errors import RecordError
from tests.test_set_encoding import reference_payload

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "data" / "set_payloads_a2a3fa9.json"
ROLLOUT = "exp_native:gen1:0:0"

# (E, k) of today's MoE models, up to (512, 10) (Qwen3-Next-style: 69-bit ranks)
TARGETS = [(8, 2), (64, 8), (128, 8), (160, 6), (256, 8), (384, 8), (512, 10)]


@pytest.fixture
def nprng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.fixture(scope="module")
def native():
    codec = native_codec()
    assert codec is not None, f"the compiled set codec did not load: {setcodec.set_codec_reason()}"
    return codec


def both(name: str, *args):
    """``name(*args)`` by the package (the compiled codec) and by the oracle."""
    return getattr(setcodec, name)(*args), getattr(oracle, name)(*args)


def both_raise(error: type[Exception], name: str, *args) -> list[str]:
    """The messages of ``error`` raised by the package's and the oracle's ``name(*args)``."""
    messages = []
    for module in (setcodec, oracle):
        with pytest.raises(error) as info:
            getattr(module, name)(*args)
        messages.append(str(info.value))
    return messages


def random_sets(nprng, layers: int, tokens: int, num_experts: int, top_k: int,
                dtype: np.dtype) -> np.ndarray:
    """``[L, T, K]`` rows of ``top_k`` distinct ids in random order (any E)."""
    if num_experts <= 1024:
        keys = nprng.random((layers * tokens, num_experts))
        rows = np.argsort(keys, axis=1)[:, :top_k]
    else:
        rows = np.stack([nprng.choice(num_experts, top_k, replace=False)
                         for _ in range(layers * tokens)])
    return rows.astype(dtype).reshape(layers, tokens, top_k)


def with_edges(ids: np.ndarray, num_experts: int, fill: int) -> np.ndarray:
    """Padding rows, the smallest set {0..k-1} and the largest {E-k..E-1}, reversed."""
    top_k = ids.shape[2]
    if ids.shape[1] >= 3:
        ids[0, 0] = np.arange(top_k)[::-1]
        ids[-1, -1] = np.arange(num_experts - top_k, num_experts)[::-1]
        ids[0, 1] = fill
        ids[:, 2] = fill
    return ids


def random_case(nprng) -> tuple[int, int]:
    """An (E, k) with ranks of 1 to 128 bits, a third of them wider than 64."""
    while True:
        num_experts = int(nprng.choice([8, 16, 60, 64, 100, 128, 160, 256, 384, 512, 1000, 4096]))
        top_k = int(nprng.integers(1, min(num_experts, 24) + 1))
        bits = math.comb(num_experts, top_k).bit_length()
        if bits <= MAX_RANK_BITS and (bits > 64 or nprng.random() < 0.5):
            return num_experts, top_k


def check_same(ids: np.ndarray, num_experts: int, fill: int, dtype: np.dtype | None = None) -> bytes:
    """Both codecs give the documented payload of ``ids`` and decode it (into ``dtype``,
    default the ids' own) to the sorted ids."""
    original = ids.copy()
    native, reference = both("encode_sets", ids, num_experts, fill)
    np.testing.assert_array_equal(ids, original)  # the input is left alone
    assert native.tobytes() == reference.tobytes() == reference_payload(ids, num_experts, fill)
    payload = native.tobytes()
    dtype = np.dtype(dtype or ids.dtype)
    decoded, decoded_ref = both("decode_sets", payload, ids.shape, num_experts, fill, dtype)
    np.testing.assert_array_equal(decoded, decoded_ref)
    np.testing.assert_array_equal(decoded, np.sort(original, axis=2))
    assert decoded.dtype == dtype and decoded.shape == ids.shape
    return payload


# --------------------------------------------------------------------- the process's codec


def test_the_native_codec_is_active_under_compiled_ops():
    if os.environ.get("FD_RR_OPS") != "compiled":
        pytest.skip("runs under FD_RR_OPS=compiled (make test)")
    assert set_codec_backend() == "native", setcodec.set_codec_reason()


def child(tmp_path, code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FD_RR_OPS")}
    environ.update(PYTHONPATH=str(ROOT), FD_RR_OPS_AOT_DIR=str(tmp_path / "no-aot"), **env)
    return subprocess.run([sys.executable, "-c", code, *args], env=environ, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)


ROUND_TRIP = """
import numpy as np
from fd_routing_replay.codec.setcodec import decode_sets, encode_sets, set_codec_backend
ids = np.array([[[5, 1, 3], [255, 255, 255]]], dtype=np.uint8)
payload = encode_sets(ids, 8, 255)
decoded = decode_sets(payload.tobytes(), ids.shape, 8, 255, np.uint8)
assert payload.tobytes() == bytes.fromhex("0e0e"), payload
assert decoded.tolist() == [[[1, 3, 5], [255, 255, 255]]]
print(set_codec_backend())
"""

WITHOUT_LIBRARY = """
import sys, warnings
import numpy as np
warnings.simplefilter("ignore")
from fd_routing_replay.codec import RoutingRecord, decode_record, read_header
from fd_routing_replay.codec.setcodec import (SetEncodingError, decode_sets, encode_sets,
                                              set_codec_backend, set_codec_reason)
from fd_routing_replay.errors import OpsError, RecordError
from fd_routing_replay.writer.record import encode_for_store
ids = np.array([[[5, 1, 3], [255, 255, 255]]], dtype=np.uint8)
print("backend:", set_codec_backend())
print("reason:", set_codec_reason())
try:
    encode_sets(ids, 8, 255)
except SetEncodingError as exc:
    print("encode:", exc)
head, payload = encode_for_store(RoutingRecord("exp_x:gen1:0:0", ids, 8), encoding="set",
                                 record_format="rr-v1", converts=False,
                                 on_fallback=lambda exc: print("fallback:", exc))
print("stored as:", read_header(head + bytes(payload)).encoding)
try:
    decode_sets(bytes.fromhex("0e0e"), ids.shape, 8, 255, np.uint8)
except OpsError as exc:
    print("decode:", exc)
try:
    decode_record(bytes.fromhex(sys.argv[1]))
except RecordError:
    print("a RecordError: reported as corrupt")
except OpsError as exc:
    print("decode_record:", exc)
print("empty:", encode_sets(ids[:, :0], 8, 255).size)
"""


def test_compiled_mode_fails_without_a_library(tmp_path):
    failed = child(tmp_path, ROUND_TRIP, FD_RR_OPS="compiled", FD_RR_OPS_JIT="0")
    assert failed.returncode != 0
    assert "OpsError: FD_RR_OPS=compiled but the compiled C library (set codec, checksum, unrouted count) cannot load" in failed.stderr
    assert "JIT build disabled" in failed.stderr


def test_without_a_library_set_payloads_are_refused_saying_why(tmp_path):
    """No library (auto mode, no build, no JIT): encoding raises SetEncodingError (the
    writer stores the record plain, with the reason), decoding raises OpsError, never a
    RecordError a tool would take for a corrupt record; both say why the library is missing."""
    record = encode_record(RoutingRecord(ROLLOUT, np.array([[[5, 1, 3]]], np.uint8), 8), encoding="set")
    done = child(tmp_path, WITHOUT_LIBRARY, record.hex(), FD_RR_OPS_JIT="0")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert lines["backend"] == "unavailable"
    assert "no ahead-of-time build" in lines["reason"] and "FD_RR_OPS_JIT=0" in lines["reason"]
    for key in ("encode", "fallback", "decode", "decode_record"):
        assert f"needs the compiled C library {C_LIBRARY.file_name}, which did not load: " \
               f"{lines['reason']}" in lines[key], key
    assert "can be written plain" in lines["encode"] and "make ops" in lines["decode"]
    assert lines["stored as"] == "plain" and lines["empty"] == "0"


def test_a_stale_library_is_not_loaded(native, tmp_path):
    """A build whose recorded digest is not the sources' is refused, and the reason says so."""
    aot = tmp_path / "no-aot"  # child() points FD_RR_OPS_AOT_DIR here
    aot.mkdir()
    shutil.copy(native.library, aot / native.library.name)
    (aot / f"{C_LIBRARY.name}.json").write_text(json.dumps({"digest": "0" * 64}))
    done = child(tmp_path, "import warnings; warnings.simplefilter('ignore')\n"
                 "from fd_routing_replay.codec.setcodec import set_codec_backend, set_codec_reason\n"
                 "print(set_codec_backend(), set_codec_reason())", FD_RR_OPS_JIT="0")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[0] == "unavailable" and "is stale" in done.stdout
    (aot / f"{C_LIBRARY.name}.json").write_text(json.dumps({"digest": source_digest(C_LIBRARY)}))
    current = child(tmp_path, ROUND_TRIP, FD_RR_OPS="compiled", FD_RR_OPS_JIT="0")
    assert current.returncode == 0 and current.stdout.split() == ["native"], current.stderr[-2000:]


@pytest.mark.slow
def test_a_missing_library_is_built_just_in_time_from_the_sources(tmp_path):
    cache = tmp_path / "jit-cache"
    done = child(tmp_path, ROUND_TRIP, FD_RR_OPS="compiled", FD_RR_OPS_CACHE=str(cache))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["native"]
    (library,) = cache.glob("fdrr_native-*/fdrr_native.so")
    again = child(tmp_path, ROUND_TRIP + "\nfrom fd_routing_replay.codec.setcodec import "
                  "set_codec_reason; print(set_codec_reason())",
                  FD_RR_OPS="compiled", FD_RR_OPS_CACHE=str(cache))
    assert again.returncode == 0 and str(library) in again.stdout  # reused, not rebuilt


def test_the_wheel_ships_the_set_codec_sources():
    setup = (ROOT / "setup.py").read_text()
    assert '"set_codec.cc"' in setup and '"set_codec_tables.h"' in setup and '"xxh3.cc"' in setup


# --------------------------------------------------------------------- compiled == oracle


def test_random_cases_are_bit_exact(native, nprng):
    for _ in range(12):
        num_experts, top_k = random_case(nprng)
        dtype = routing_dtype(num_experts) if nprng.random() < 0.7 else np.dtype("<u4")
        fill = int(np.iinfo(dtype).max) if nprng.random() < 0.5 else num_experts
        ids = random_sets(nprng, int(nprng.integers(1, 4)), int(nprng.integers(1, 300)),
                          num_experts, top_k, dtype)
        ids[nprng.random(ids.shape[:2]) < 0.15] = fill
        check_same(with_edges(ids, num_experts, fill), num_experts, fill)


@pytest.mark.parametrize(("num_experts", "top_k"), TARGETS + [
    (1, 1), (2, 2), (8, 8), (64, 32), (128, 64), (256, 16), (256, 24), (512, 20), (1024, 16),
    (65536, 3), (65536, 9), (200, 190)])
def test_edge_sets_padding_and_partial_groups(native, nprng, num_experts, top_k):
    """Widths from 1 bit to 128 (64, 65 and 128 among them: test_widths_at_the_word_edges),
    the largest E the codec takes (65,536), k up to 190, whole and partial 64-row groups."""
    dtype = routing_dtype(num_experts)
    for tokens in (1, 3, 63, 64, 65, 130):  # whole and partial 64-row groups, a tail
        fill = int(np.iinfo(dtype).max)
        ids = with_edges(random_sets(nprng, 2, tokens, num_experts, top_k, dtype), num_experts, fill)
        check_same(ids, num_experts, fill)
    all_padding = np.full((3, 70, top_k), fill, dtype=dtype)
    check_same(all_padding, num_experts, fill)


def widest(bits: int) -> tuple[int, int]:
    """The (E, k), k as small as can be, E ≤ 4096, whose ranks are exactly ``bits`` wide."""
    for top_k in range(1, 64):
        for num_experts in range(top_k, 4097):
            if math.comb(num_experts, top_k).bit_length() == bits:
                return num_experts, top_k
    raise AssertionError(bits)


@pytest.mark.parametrize("bits", [63, 64, 65, 127, 128])
def test_widths_at_the_word_edges(native, nprng, bits):
    num_experts, top_k = widest(bits)
    dtype = routing_dtype(num_experts)
    fill = int(np.iinfo(dtype).max)
    ids = with_edges(random_sets(nprng, 2, 67, num_experts, top_k, dtype), num_experts, fill)
    payload = check_same(ids, num_experts, fill)
    assert len(payload) == -(-134 * bits // 8)
    if bits == 128:  # one past the widest is refused by both, by name
        wider = np.zeros((1, 1, top_k + 1), dtype=dtype)
        messages = both_raise(SetEncodingError, "encode_sets", wider, num_experts, fill)
        assert messages[0] == messages[1] and "more than the 128" in messages[0]


@pytest.mark.parametrize("shape", [(0, 0, 8), (3, 0, 10), (0, 5, 10), (2, 3, 0)])
def test_empty_records(shape):
    ids = np.zeros(shape, dtype=np.uint16)
    native, reference = both("encode_sets", ids, 512, 65535)
    assert native.size == reference.size == 0
    decoded, decoded_ref = both("decode_sets", b"", shape, 512, 65535, np.uint16)
    assert decoded.shape == decoded_ref.shape == shape


def test_the_first_bad_row_is_the_same(native, nprng):
    for num_experts, top_k in [(64, 6), (512, 10)]:
        dtype = routing_dtype(num_experts)
        ids = random_sets(nprng, 2, 100, num_experts, top_k, dtype)
        ids[1, 70, :2] = ids[1, 70, 2]            # a duplicate
        ids[1, 90, 0] = num_experts                # out of range (row after the first bad one)
        messages = both_raise(SetEncodingError, "encode_sets", ids, num_experts,
                              int(np.iinfo(dtype).max))
        assert messages[0] == messages[1] and "[layer 1, token 70]" in messages[0]


def test_a_rank_above_the_padding_value_is_refused_the_same(native, nprng):
    for num_experts, top_k in [(64, 2), (512, 10), (1024, 16)]:
        dtype = routing_dtype(num_experts)
        ids = random_sets(nprng, 1, 50, num_experts, top_k, dtype)
        bits = math.comb(num_experts, top_k).bit_length()
        stream = int.from_bytes(encode_sets(ids, num_experts, 0).tobytes(), "little")
        stream |= ((1 << bits) - 1) << (37 * bits)  # row 37: all ones, above C(E, k)
        payload = stream.to_bytes(-(-50 * bits // 8), "little")
        messages = both_raise(RecordError, "decode_sets", payload, ids.shape, num_experts, 0, dtype)
        assert messages[0] == messages[1]
        assert f"row 37 holds rank {(1 << bits) - 1}, above" in messages[0]


def test_corrupt_payloads_are_refused_the_same(native, nprng):
    """A payload of the wrong size, and bits set past the last row."""
    ids = random_sets(nprng, 2, 31, 160, 6, np.uint8)
    used = 62 * math.comb(160, 6).bit_length()     # 2170 bits: 6 unused in the last byte
    payload = encode_sets(ids, 160, 255).tobytes()
    assert len(payload) == -(-used // 8) == 272
    for damaged, expected in ((payload[:-1], "set payload has 271 bytes"),
                              (payload + b"\0", "set payload has 273 bytes"),
                              (payload[:-1] + bytes([payload[-1] | 0x80]), "non-zero bits after")):
        messages = both_raise(RecordError, "decode_sets", damaged, ids.shape, 160, 255, np.uint8)
        assert messages[0] == messages[1] and expected in messages[0]


# --------------------------------------------------------------------- dtypes and fill values


@pytest.mark.parametrize("dtype", ["<u8", "<i8", "<i4", "<i2", ">u2", ">u4", "u1"])
def test_ids_of_any_integer_dtype_are_encoded_when_they_fit(native, nprng, dtype):
    """What the library does not take (uint64, signed, big-endian) is converted: the same
    payload as the ids in the routing dtype, and decoding into that dtype gives them back."""
    dtype = np.dtype(dtype)
    num_experts = 200 if dtype.itemsize > 1 else 100
    fill = int(min(np.iinfo(dtype).max, 2**32 - 1))
    ids = with_edges(random_sets(nprng, 2, 90, num_experts, 6, dtype), num_experts, fill)
    payload = check_same(ids, num_experts, fill)
    assert payload == encode_sets(ids.astype(routing_dtype(fill)), num_experts, fill).tobytes()


def test_a_value_no_library_dtype_holds_makes_its_row_the_bad_one(native, nprng):
    ids = random_sets(nprng, 2, 50, 64, 4, np.int64)
    fill = 255
    for row, value in ((1, 30), (1, 40)):   # only out-of-range values: that row is the first bad
        bad = ids.copy()
        bad[row, value, 1] = -1 if value == 30 else 2**40
        messages = both_raise(SetEncodingError, "encode_sets", bad, 64, fill)
        assert messages[0] == messages[1] and f"[layer {row}, token {value}]" in messages[0]
    earlier = ids.copy()
    earlier[0, 10, :2] = 7                    # a duplicate before the out-of-range value
    earlier[1, 5, 0] = 2**40
    messages = both_raise(SetEncodingError, "encode_sets", earlier, 64, fill)
    assert messages[0] == messages[1] and "[layer 0, token 10]" in messages[0]


def test_ids_narrower_than_their_experts_or_fill_value(native, nprng):
    """uint8 ids of a model with more than 256 experts, or with a fill value above 255: the
    library works in a dtype that holds both (E - 1 and the fill value are never truncated
    to the ids' dtype: 300 is not 44)."""
    ids = random_sets(nprng, 2, 40, 256, 5, np.uint8)
    check_same(ids, 300, 1000, np.uint16)
    check_same(ids, 256, 300, np.uint16)
    with pytest.raises(SetEncodingError, match=r"dtype uint8 cannot hold fill_value 300"):
        decode_sets(encode_sets(ids, 256, 300), ids.shape, 256, 300, np.uint8)
    ids[0, 3] = 300 % 256                  # 44 five times: a duplicate, not a padding row
    messages = both_raise(SetEncodingError, "encode_sets", ids, 256, 300)
    assert messages[0] == messages[1] and "[layer 0, token 3] = [44, 44, 44, 44, 44]" in messages[0]


@pytest.mark.parametrize("fill", [2**32, 2**40, -1, 3.0, True, None])
def test_a_fill_value_the_library_cannot_hold_is_refused_by_name(fill):
    ids = np.zeros((1, 2, 2), dtype=np.uint64)
    ids[0, 0] = (0, 1)
    with pytest.raises(SetEncodingError, match=rf"fill_value {fill!r} must be an int in \[0, 2\*\*32 - 1\]"):
        encode_sets(ids, 8, fill)
    with pytest.raises(SetEncodingError, match=rf"fill_value {fill!r}"):
        decode_sets(bytes(2), (1, 2, 2), 8, fill, np.uint64)


def test_non_integer_ids_are_refused_by_name():
    for dtype in (np.float32, np.bool_):
        with pytest.raises(SetEncodingError, match=rf"ids dtype {np.dtype(dtype)} is not an integer"):
            encode_sets(np.zeros((1, 1, 2), dtype=dtype), 8, 255)
        with pytest.raises(SetEncodingError, match=rf"ids dtype {np.dtype(dtype)} is not an integer"):
            decode_sets(bytes(1), (1, 1, 2), 8, 255, dtype)


# --------------------------------------------------------------------- wide ranks, sizes, history


@pytest.mark.parametrize(("num_experts", "top_k"), TARGETS)
def test_bits_per_token_layer_stay_within_1_1_of_the_bound(nprng, num_experts, top_k):
    dtype = routing_dtype(num_experts)
    ids = random_sets(nprng, 3, 200, num_experts, top_k, dtype)
    record = RoutingRecord(ROLLOUT, ids, num_experts)
    buffer = encode_record(record, encoding="set")
    payload = len(encode_sets(ids, num_experts, int(np.iinfo(dtype).max)))
    bound_bits = math.log2(math.comb(num_experts, top_k))
    assert payload * 8 / 600 <= 1.1 * bound_bits
    np.testing.assert_array_equal(decode_record(buffer, check_range=True).ids, np.sort(ids, axis=2))


def test_qwen3_next_routing_goes_through_the_writer_rule_as_sets(nprng):
    from fd_routing_replay.codec import read_header
    from fd_routing_replay.writer.record import encode_for_store

    ids = random_sets(nprng, 4, 100, 512, 10, np.uint16)
    fallbacks = []
    head, payload = encode_for_store(RoutingRecord(ROLLOUT, ids, 512), encoding="set",
                                     record_format="rr-v1", converts=False,
                                     on_fallback=fallbacks.append)
    assert fallbacks == [] and read_header(head + bytes(payload)).encoding == "set"
    assert payload.nbytes == -(-400 * 69 // 8)  # 69 bits per token-layer, not 160
    too_wide = random_sets(nprng, 1, 10, 256, 32, np.uint16)  # 136 bits: still plain
    encode_for_store(RoutingRecord(ROLLOUT, too_wide, 256), encoding="set", record_format="rr-v1",
                     converts=False, on_fallback=fallbacks.append)
    assert len(fallbacks) == 1 and "needs 136 bits" in str(fallbacks[0])


def test_payloads_written_before_wide_ranks_still_decode_and_encode_the_same():
    frozen = json.loads(FIXTURE.read_text())
    assert len(frozen["payloads"]) >= 10
    for case in frozen["payloads"]:
        dtype = np.dtype(case["dtype"])
        ids = np.array(case["ids"], dtype=dtype).reshape(case["shape"])
        payload = bytes.fromhex(case["payload"])
        e, fill = case["num_experts"], case["fill_value"]
        native, reference = both("encode_sets", ids, e, fill)
        assert native.tobytes() == reference.tobytes() == payload, case["num_experts"]
        decoded, decoded_ref = both("decode_sets", payload, ids.shape, e, fill, dtype)
        np.testing.assert_array_equal(decoded, np.sort(ids, axis=2))
        np.testing.assert_array_equal(decoded_ref, np.sort(ids, axis=2))
    record = decode_record(bytes.fromhex(frozen["record_v1"]), check_range=True)
    case = frozen["payloads"][4]
    ids = np.array(case["ids"], dtype=np.uint16).reshape(case["shape"])
    assert record.num_experts == 256 and record.metadata == {"m": 1}
    np.testing.assert_array_equal(record.ids, np.sort(ids, axis=2))
