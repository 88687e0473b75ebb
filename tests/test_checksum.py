"""The rr-v1 checksum (fd_routing_replay.codec.checksum): XXH3-64 of the C library
(custom_ops/xxh3.cc) against the ``xxhash`` package, the independent reference.

Every length class of the algorithm (0, 1-3, 4-8, 9-16, 17-128, 129-240, and long inputs
over one stripe, one block, several blocks, with odd tails) at unaligned starts, through
every stripe kernel this CPU has; the size dispatch of ``xxh3_64``; and the fallback to the
package where the library is not loaded, in child interpreters (the library is chosen once
per process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash

from fd_routing_replay.codec.checksum import (
    KERNELS,
    NATIVE_BYTES,
    checksum_backend,
    xxh3_64,
    xxh3_64_kernel,
)

ROOT = Path(__file__).resolve().parents[1]

# Short classes whole, then the edges of stripes (64), blocks (1024) and the last-stripe
# overlap, several blocks with odd tails, and sizes around the dispatch threshold.
SHORT = list(range(0, 300))
LONG = [319, 320, 321, 1023, 1024, 1025, 1087, 1088, 1089, 2047, 2048, 2049, 3 * 1024 + 63,
        5 * 1024 + 1, 16 * 1024 + 7, 64 * 1024 - 1, 100_003, NATIVE_BYTES - 1, NATIVE_BYTES,
        NATIVE_BYTES + 65]


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.fixture(scope="module")
def kernels() -> list[str]:
    if not checksum_backend().startswith("native"):
        pytest.skip(f"the C library is not loaded ({checksum_backend()})")
    return [k for k in KERNELS if xxh3_64_kernel(b"", k) is not None]


def test_the_kernels_are_the_ones_this_cpu_has(kernels):
    if not cpu_flags():
        pytest.skip("no /proc/cpuinfo flags to compare with")
    flags = cpu_flags()
    expected = ["scalar"] + [k for k, flag in (("avx2", "avx2"), ("avx512", "avx512f")) if flag in flags]
    assert kernels == expected
    assert checksum_backend() == f"native {expected[-1]}"  # the widest one is chosen


@pytest.mark.parametrize("lengths", [SHORT, LONG], ids=["0-299 bytes", "long"])
def test_every_kernel_matches_xxhash_on_every_length_class(kernels, seed, lengths):
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, max(lengths) + 128, dtype=np.uint8)
    for length in lengths:
        start = int(rng.integers(1, 64))  # unaligned
        data = pool[start:start + length]
        expected = xxhash.xxh3_64_intdigest(data)
        for kernel in kernels:
            assert xxh3_64_kernel(data, kernel) == expected, (length, start, kernel)
        assert xxh3_64(memoryview(data)) == expected, length


def test_structured_inputs_match(kernels, seed):
    """Bytes that random data rarely gives: all zeros, all ones, one bit set, a repeated
    stripe (XXH3 folds lanes pairwise, so equal lanes are worth checking)."""
    rng = np.random.default_rng(seed)
    length = int(rng.integers(2048, 8192))
    stripe = rng.integers(0, 256, 64, dtype=np.uint8)
    one_bit = np.zeros(length, np.uint8)
    one_bit[int(rng.integers(0, length))] = 1 << int(rng.integers(0, 8))
    for data in (np.zeros(length, np.uint8), np.full(length, 255, np.uint8), one_bit,
                 np.tile(stripe, length // 64 + 1)[:length]):
        expected = xxhash.xxh3_64_intdigest(data)
        assert [xxh3_64_kernel(data, k) for k in kernels] == [expected] * len(kernels)


def test_xxh3_64_takes_any_contiguous_buffer(seed):
    rng = np.random.default_rng(seed)
    for size in (0, 200, NATIVE_BYTES + 3):
        raw = rng.integers(0, 256, size + (size % 2), dtype=np.uint8).tobytes()
        expected = xxhash.xxh3_64_intdigest(raw)
        wide = np.frombuffer(raw, dtype="<u2").reshape(1, -1, 1)
        for data in (raw, bytearray(raw), memoryview(raw), memoryview(raw).toreadonly(), wide):
            assert xxh3_64(data) == expected, (size, type(data).__name__)
    with pytest.raises((ValueError, BufferError, TypeError)):
        xxh3_64(np.zeros((4, 4), np.uint8)[:, ::2])  # not contiguous: refused, as by xxhash


CHILD = r"""
import json, sys
if sys.argv[1] == "no-paddle":
    sys.modules["paddle"] = None  # any `import paddle` now fails
import numpy as np, xxhash
from fd_routing_replay.codec import RoutingRecord, decode_record, encode_record
from fd_routing_replay.codec.checksum import checksum_backend, xxh3_64
ids = np.random.default_rng(int(sys.argv[2])).integers(0, 64, (8, 20000, 8), dtype=np.uint8)
buffer = encode_record(RoutingRecord("exp:0:0:0", ids, 64))
ok = (decode_record(buffer).ids == ids).all() and xxh3_64(ids) == xxhash.xxh3_64_intdigest(ids)
print(json.dumps({"backend": checksum_backend(), "ok": bool(ok),
                  "paddle": "paddle" in sys.modules and sys.modules["paddle"] is not None}))
"""


def child(mode: str, seed: int, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FD_RR_OPS")}
    environ.update(PYTHONPATH=str(ROOT), **env)
    done = subprocess.run([sys.executable, "-c", CHILD, mode, str(seed)], env=environ, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_native_checksum_needs_no_paddle(kernels, seed):
    report = child("no-paddle", seed, FD_RR_OPS="compiled", FD_RR_OPS_JIT="0")
    assert report == {"backend": f"native {kernels[-1]}", "ok": True, "paddle": False}


def test_without_the_library_the_xxhash_package_hashes(seed, tmp_path):
    missing = child("plain", seed, FD_RR_OPS_AOT_DIR=str(tmp_path / "none"), FD_RR_OPS_JIT="0")
    assert missing == {"backend": "xxhash", "ok": True, "paddle": False}
