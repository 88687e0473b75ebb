"""The compiled set codec (custom_ops/set_codec.cc through fd_routing_replay.codec.setcodec)
against the NumPy reference (fd_routing_replay.codec.set_numpy), bit for bit; ranks wider
than 64 bits; payloads written before they existed; which codec a process picks.

Every comparison runs both implementations through the public ``encode_sets`` /
``decode_sets`` (the ``backend`` fixture swaps the compiled codec out) and checks them
against the pure-Python encoder of docs/record-format.md (tests/test_set_encoding.py).
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
from fd_routing_replay.codec import RoutingRecord, decode_record, encode_record, routing_dtype
from fd_routing_replay.codec.set_format import MAX_RANK_BITS, SetEncodingError
from fd_routing_replay.codec.setcodec import (
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
    if codec is None:
        pytest.skip(f"compiled set codec unavailable: {setcodec.set_codec_reason()}")
    return codec


def both(monkeypatch, function, *args):
    """``function(*args)`` with the compiled codec and with the NumPy reference."""
    native = function(*args)
    monkeypatch.setattr(setcodec, "native_codec", lambda: None)
    try:
        reference = function(*args)
    finally:
        monkeypatch.undo()
    return native, reference


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


def check_same(monkeypatch, ids: np.ndarray, num_experts: int, fill: int) -> bytes:
    original = ids.copy()
    native, reference = both(monkeypatch, encode_sets, ids, num_experts, fill)
    np.testing.assert_array_equal(ids, original)  # the input is left alone
    assert native.tobytes() == reference.tobytes() == reference_payload(ids, num_experts, fill)
    payload = native.tobytes()
    decoded, decoded_ref = both(monkeypatch, decode_sets, payload, ids.shape, num_experts, fill,
                                ids.dtype)
    np.testing.assert_array_equal(decoded, decoded_ref)
    np.testing.assert_array_equal(decoded, np.sort(original, axis=2))
    assert decoded.dtype == ids.dtype
    return payload


# --------------------------------------------------------------------- the process's codec


def test_the_native_codec_is_active_under_compiled_ops():
    if os.environ.get("FD_RR_OPS") != "compiled":
        pytest.skip("runs under FD_RR_OPS=compiled (make test)")
    assert set_codec_backend() == "native", setcodec.set_codec_reason()


def child(tmp_path, code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FD_RR_OPS")}
    environ.update(PYTHONPATH=str(ROOT), FD_RR_OPS_AOT_DIR=str(tmp_path / "no-aot"), **env)
    return subprocess.run([sys.executable, "-c", code], env=environ, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)


ROUND_TRIP = """
import numpy as np, warnings
from fd_routing_replay.codec.setcodec import decode_sets, encode_sets, set_codec_backend
ids = np.array([[[5, 1, 3], [255, 255, 255]]], dtype=np.uint8)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    payload = encode_sets(ids, 8, 255)
    decoded = decode_sets(payload.tobytes(), ids.shape, 8, 255, np.uint8)
    encode_sets(ids, 8, 255)
assert payload.tobytes() == bytes.fromhex("0e0e"), payload
assert decoded.tolist() == [[[1, 3, 5], [255, 255, 255]]]
print(set_codec_backend(), len([w for w in caught if "NumPy set codec" in str(w.message)]))
"""


def test_without_a_library_compiled_mode_fails_and_auto_warns_once(tmp_path):
    failed = child(tmp_path, ROUND_TRIP, FD_RR_OPS="compiled", FD_RR_OPS_JIT="0")
    assert failed.returncode != 0
    assert "OpsError: FD_RR_OPS=compiled but the compiled set codec and checksum cannot load" in failed.stderr
    assert "JIT build disabled" in failed.stderr
    fallback = child(tmp_path, ROUND_TRIP, FD_RR_OPS_JIT="0")
    assert fallback.returncode == 0, fallback.stderr[-2000:]
    assert fallback.stdout.split() == ["numpy", "1"]  # one warning, however many calls
    forced = child(tmp_path, ROUND_TRIP, FD_RR_OPS="reference")
    assert forced.returncode == 0 and forced.stdout.split() == ["numpy", "0"]


def test_a_stale_library_is_not_loaded(native, tmp_path):
    """A build whose recorded digest is not the sources' is refused, and the reason says so."""
    aot = tmp_path / "no-aot"  # child() points FD_RR_OPS_AOT_DIR here
    aot.mkdir()
    shutil.copy(native.library, aot / native.library.name)
    (aot / f"{C_LIBRARY.name}.json").write_text(json.dumps({"digest": "0" * 64}))
    done = child(tmp_path, ROUND_TRIP + "\nfrom fd_routing_replay.codec.setcodec import "
                 "set_codec_reason; print(set_codec_reason())", FD_RR_OPS_JIT="0")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[:2] == ["numpy", "1"] and "is stale" in done.stdout
    (aot / f"{C_LIBRARY.name}.json").write_text(json.dumps({"digest": source_digest(C_LIBRARY)}))
    current = child(tmp_path, ROUND_TRIP, FD_RR_OPS="compiled", FD_RR_OPS_JIT="0")
    assert current.returncode == 0 and current.stdout.split() == ["native", "0"], current.stderr[-2000:]


@pytest.mark.slow
def test_a_missing_library_is_built_just_in_time_from_the_sources(tmp_path):
    cache = tmp_path / "jit-cache"
    done = child(tmp_path, ROUND_TRIP, FD_RR_OPS="compiled", FD_RR_OPS_CACHE=str(cache))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["native", "0"]
    (library,) = cache.glob("fdrr_native-*/fdrr_native.so")
    again = child(tmp_path, ROUND_TRIP + "\nfrom fd_routing_replay.codec.setcodec import "
                  "set_codec_reason; print(set_codec_reason())",
                  FD_RR_OPS="compiled", FD_RR_OPS_CACHE=str(cache))
    assert again.returncode == 0 and str(library) in again.stdout  # reused, not rebuilt


def test_the_wheel_ships_the_set_codec_sources():
    setup = (ROOT / "setup.py").read_text()
    assert '"set_codec.cc"' in setup and '"set_codec_tables.h"' in setup and '"xxh3.cc"' in setup


# --------------------------------------------------------------------- native == numpy


def test_random_cases_are_bit_exact(native, nprng, monkeypatch):
    for _ in range(12):
        num_experts, top_k = random_case(nprng)
        dtype = routing_dtype(num_experts) if nprng.random() < 0.7 else np.dtype("<u4")
        fill = int(np.iinfo(dtype).max) if nprng.random() < 0.5 else num_experts
        ids = random_sets(nprng, int(nprng.integers(1, 4)), int(nprng.integers(1, 300)),
                          num_experts, top_k, dtype)
        ids[nprng.random(ids.shape[:2]) < 0.15] = fill
        check_same(monkeypatch, with_edges(ids, num_experts, fill), num_experts, fill)


@pytest.mark.parametrize(("num_experts", "top_k"), TARGETS + [
    (1, 1), (2, 2), (8, 8), (64, 32), (128, 64), (256, 16), (256, 24), (512, 20), (1024, 16),
    (65536, 3), (65536, 9), (200, 190)])
def test_edge_sets_padding_and_partial_groups(native, nprng, monkeypatch, num_experts, top_k):
    dtype = routing_dtype(num_experts)
    for tokens in (1, 3, 63, 64, 65, 130):  # whole and partial 64-row groups, a tail
        fill = int(np.iinfo(dtype).max)
        ids = with_edges(random_sets(nprng, 2, tokens, num_experts, top_k, dtype), num_experts, fill)
        check_same(monkeypatch, ids, num_experts, fill)
    all_padding = np.full((3, 70, top_k), fill, dtype=dtype)
    check_same(monkeypatch, all_padding, num_experts, fill)


@pytest.mark.parametrize("shape", [(0, 0, 8), (3, 0, 10), (0, 5, 10), (2, 3, 0)])
def test_empty_records(monkeypatch, shape):
    ids = np.zeros(shape, dtype=np.uint16)
    native, reference = both(monkeypatch, encode_sets, ids, 512, 65535)
    assert native.size == reference.size == 0
    decoded, decoded_ref = both(monkeypatch, decode_sets, b"", shape, 512, 65535, np.uint16)
    assert decoded.shape == decoded_ref.shape == shape


def test_the_first_bad_row_is_the_same(native, nprng, monkeypatch):
    for num_experts, top_k in [(64, 6), (512, 10)]:
        dtype = routing_dtype(num_experts)
        ids = random_sets(nprng, 2, 100, num_experts, top_k, dtype)
        ids[1, 70, :2] = ids[1, 70, 2]            # a duplicate
        ids[1, 90, 0] = num_experts                # out of range (row after the first bad one)
        messages = []
        for swap in (False, True):
            if swap:
                monkeypatch.setattr(setcodec, "native_codec", lambda: None)
            with pytest.raises(SetEncodingError, match=r"\[layer 1, token 70\]") as info:
                encode_sets(ids, num_experts, int(np.iinfo(dtype).max))
            messages.append(str(info.value))
            monkeypatch.undo()
        assert messages[0] == messages[1]


def test_a_rank_above_the_padding_value_is_refused_the_same(native, nprng, monkeypatch):
    for num_experts, top_k in [(64, 2), (512, 10), (1024, 16)]:
        dtype = routing_dtype(num_experts)
        ids = random_sets(nprng, 1, 50, num_experts, top_k, dtype)
        bits = math.comb(num_experts, top_k).bit_length()
        stream = int.from_bytes(encode_sets(ids, num_experts, 0).tobytes(), "little")
        stream |= ((1 << bits) - 1) << (37 * bits)  # row 37: all ones, above C(E, k)
        payload = stream.to_bytes(-(-50 * bits // 8), "little")
        messages = []
        for swap in (False, True):
            if swap:
                monkeypatch.setattr(setcodec, "native_codec", lambda: None)
            with pytest.raises(RecordError, match=rf"row 37 holds rank {(1 << bits) - 1}, above") as info:
                decode_sets(payload, ids.shape, num_experts, 0, dtype)
            messages.append(str(info.value))
            monkeypatch.undo()
        assert messages[0] == messages[1]


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


def test_payloads_written_before_wide_ranks_still_decode_and_encode_the_same(monkeypatch):
    frozen = json.loads(FIXTURE.read_text())
    assert len(frozen["payloads"]) >= 10
    for case in frozen["payloads"]:
        dtype = np.dtype(case["dtype"])
        ids = np.array(case["ids"], dtype=dtype).reshape(case["shape"])
        payload = bytes.fromhex(case["payload"])
        e, fill = case["num_experts"], case["fill_value"]
        native, reference = both(monkeypatch, encode_sets, ids, e, fill)
        assert native.tobytes() == reference.tobytes() == payload, case["num_experts"]
        decoded, decoded_ref = both(monkeypatch, decode_sets, payload, ids.shape, e, fill, dtype)
        np.testing.assert_array_equal(decoded, np.sort(ids, axis=2))
        np.testing.assert_array_equal(decoded_ref, np.sort(ids, axis=2))
    record = decode_record(bytes.fromhex(frozen["record_v1"]), check_range=True)
    case = frozen["payloads"][4]
    ids = np.array(case["ids"], dtype=np.uint16).reshape(case["shape"])
    assert record.num_experts == 256 and record.metadata == {"m": 1}
    np.testing.assert_array_equal(record.ids, np.sort(ids, axis=2))
