"""GPU check of fd-routing-replay's CUDA code through the C-ABI harness (no Paddle).

Run by scripts/device_check.sh, which builds custom_ops/cuda_harness.cu into a shared
library with nvcc.  This script drives that library through ctypes with NumPy only (the
harness allocates and copies device memory itself) and checks what the library's
StepRecorder runs on a GPU against the NumPy oracle of tests/ops_oracle.py on random
inputs: the per-layer record kernel (every routing dtype x int32/int64 ids, several top-k,
bad ids, empty steps, steps spanning many blocks), the step's offload into page-locked host
staging with its event, and the refill.  Then it prints the timing table: the record per
MoE layer at 1/64/512/8k/64k tokens (µs per call, GB/s) and the offload of an 8k-token step
x 60 layers x top-8 (GB/s).  Finishes well within 5 minutes.

    python scripts/device_check.py --lib build/device_check/libfdrr_cuda_harness.so [--quick] [--seed N]

tests/test_device_check.py runs this script against a CPU build of the same C ABI, so its
driver logic is tested without a GPU (that proves nothing about the CUDA code itself).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests import ops_oracle as oracle  # noqa: E402  (NumPy only)

DEADLINE_S = 240.0  # leave the timing rows out rather than overrun the 5-minute budget
EXPERTS = {np.uint8: 200, np.uint16: 40000, np.uint32: 70000}
c_i64, c_int, c_ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


@dataclass
class Buffer:
    """Device memory the harness allocated, with the shape and dtype it holds."""

    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class Harness:
    """The harness library's C ABI, declared, with NumPy in and out."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        signatures = {
            "fdrr_h_malloc": [c_i64, ctypes.POINTER(c_ptr)], "fdrr_h_free": [c_ptr],
            "fdrr_h_upload": [c_ptr, c_ptr, c_i64], "fdrr_h_download": [c_ptr, c_ptr, c_i64],
            "fdrr_h_record_rows": [c_ptr, c_int, c_i64, c_i64, c_i64, c_ptr, c_int, c_i64, c_i64, c_i64, c_ptr],
            "fdrr_h_pin": [c_ptr, c_i64, ctypes.POINTER(c_int)], "fdrr_h_unpin": [c_ptr],
            "fdrr_h_event_create": [ctypes.POINTER(c_ptr)], "fdrr_h_event_destroy": [c_ptr],
            "fdrr_h_offload": [c_ptr, c_i64, c_i64, c_ptr, c_i64, c_ptr, c_i64, c_ptr, c_ptr, c_ptr, c_ptr],
            "fdrr_h_wait": [c_ptr], "fdrr_h_fill": [c_ptr, c_i64], "fdrr_h_synchronize": [],
        }
        for name, argtypes in signatures.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = c_int
        lib.fdrr_h_error_string.argtypes = [c_int]
        lib.fdrr_h_error_string.restype = ctypes.c_char_p
        self.lib = lib
        self.live: list[Buffer] = []

    def check(self, status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what}: {self.lib.fdrr_h_error_string(status).decode()} ({status})")

    # -- device memory
    def empty(self, shape: tuple[int, ...], dtype) -> Buffer:
        out = c_ptr()
        buffer = Buffer(0, tuple(shape), np.dtype(dtype))
        self.check(self.lib.fdrr_h_malloc(buffer.nbytes, ctypes.byref(out)), "malloc")
        buffer.ptr = out.value
        self.live.append(buffer)
        return buffer

    def upload(self, array: np.ndarray) -> Buffer:
        array = np.ascontiguousarray(array)
        buffer = self.empty(array.shape, array.dtype)
        self.check(self.lib.fdrr_h_upload(buffer.ptr, array.ctypes.data, array.nbytes), "upload")
        return buffer

    def download(self, buffer: Buffer) -> np.ndarray:
        out = np.empty(buffer.shape, buffer.dtype)
        self.check(self.lib.fdrr_h_download(out.ctypes.data, buffer.ptr, out.nbytes), "download")
        return out

    def free_all(self) -> None:
        for buffer in self.live:
            self.check(self.lib.fdrr_h_free(buffer.ptr), "free")
        self.live.clear()

    # -- what the StepRecorder runs
    def record_rows(self, buffer: Buffer, ids: Buffer, layer: int, num_experts: int, counters: Buffer) -> None:
        capacity, num_layers, top_k = buffer.shape
        self.check(self.lib.fdrr_h_record_rows(
            buffer.ptr, buffer.dtype.itemsize, capacity, num_layers, top_k, ids.ptr, ids.dtype.itemsize,
            ids.shape[0], layer, num_experts, counters.ptr), "record_rows")

    def pin(self, array: np.ndarray) -> bool:
        pinned = c_int()
        self.check(self.lib.fdrr_h_pin(array.ctypes.data, array.nbytes, ctypes.byref(pinned)), "pin")
        return bool(pinned.value)

    def unpin(self, array: np.ndarray) -> None:
        self.check(self.lib.fdrr_h_unpin(array.ctypes.data), "unpin")

    def event(self) -> int:
        event = c_ptr()
        self.check(self.lib.fdrr_h_event_create(ctypes.byref(event)), "event create")
        return event.value

    def offload(self, buffer: Buffer, num_tokens: int, counters: Buffer, extra: Buffer | None, extra_bytes: int,
                host_rows: np.ndarray, host_counters: np.ndarray, host_extra: np.ndarray, event: int) -> None:
        row_bytes = buffer.nbytes // buffer.shape[0]
        self.check(self.lib.fdrr_h_offload(
            buffer.ptr, row_bytes, num_tokens, counters.ptr, counters.nbytes, extra.ptr if extra else None,
            extra_bytes, host_rows.ctypes.data, host_counters.ctypes.data, host_extra.ctypes.data, event),
            "offload")

    def wait(self, event: int) -> None:
        self.check(self.lib.fdrr_h_wait(event), "wait")

    def fill(self, buffer: Buffer) -> None:
        self.check(self.lib.fdrr_h_fill(buffer.ptr, buffer.nbytes), "fill")

    def sync(self) -> None:
        self.check(self.lib.fdrr_h_synchronize(), "synchronize")


# ---------------------------------------------------------------------------------------
# Correctness against the NumPy oracle

def random_ids(rng: np.random.Generator, tokens: int, top_k: int, experts: int, dtype) -> np.ndarray:
    ids = rng.integers(0, experts, (tokens, top_k))
    bad = rng.random(ids.shape) < 0.03
    ids[bad] = rng.choice([-1, experts, experts + 9], int(bad.sum()))
    return ids.astype(dtype)


def check_record(h: Harness, rng: np.random.Generator) -> list[str]:
    """Several layers of several steps into one buffer per case, against the oracle."""
    lines = []
    for dtype, experts in EXPERTS.items():
        for top_k in (8, 6, 1, 3):
            for id_dtype in (np.int32, np.int64):
                capacity, layers = 700, 5
                expected = rng.integers(0, experts, (capacity, layers, top_k)).astype(dtype)
                counters = np.zeros(layers + 1, np.int64)
                d_buffer, d_counters = h.upload(expected), h.upload(counters)
                for tokens in (37, 0, capacity, 1, int(rng.integers(2, capacity))):
                    for layer in rng.permutation(layers)[:3]:
                        ids = random_ids(rng, tokens, top_k, experts, id_dtype)
                        h.record_rows(d_buffer, h.upload(ids), int(layer), experts, d_counters)
                        counters[0] += oracle.record_rows(expected, ids, int(layer), experts)
                        counters[1 + layer] += tokens > 0
                got = h.download(d_buffer)
                assert np.array_equal(got, expected), f"record {np.dtype(dtype).name} top-{top_k} {id_dtype.__name__}"
                assert np.array_equal(h.download(d_counters), counters), \
                    f"record counters {np.dtype(dtype).name} top-{top_k}: {h.download(d_counters)} != {counters}"
                h.free_all()
        lines.append(f"record {np.dtype(dtype).name}: top-8/6/1/3 x int32/int64 ids, bad-id and call "
                     "counters, empty and multi-block steps OK")
    return lines


def check_offload_and_fill(h: Harness, rng: np.random.Generator) -> list[str]:
    """Record a step, offload it into page-locked staging with the slot mapping, wait on the
    event, compare; then refill the buffer."""
    capacity, layers, top_k, experts = 512, 6, 8, 300
    buffer = np.full((capacity, layers, top_k), 0xFFFF, np.uint16)
    counters = np.zeros(layers + 1, np.int64)
    d_buffer, d_counters = h.upload(buffer), h.upload(counters)
    host_rows = np.zeros_like(buffer)
    host_counters = np.zeros_like(counters)
    host_extra = np.zeros(capacity * 8, np.uint8)
    pinned = [h.pin(a) for a in (host_rows, host_counters, host_extra)]
    event = h.event()
    try:
        for tokens in (300, 77):
            for layer in range(layers):
                ids = random_ids(rng, tokens, top_k, experts, np.int64)
                h.record_rows(d_buffer, h.upload(ids), layer, experts, d_counters)
                counters[0] += oracle.record_rows(buffer, ids, layer, experts)
                counters[1 + layer] += 1
            slots = rng.permutation(4 * capacity)[: capacity].astype(np.int64)  # FastDeploy's is larger
            h.offload(d_buffer, tokens, d_counters, h.upload(slots), tokens * 8, host_rows, host_counters,
                      host_extra, event)
            h.wait(event)
            assert np.array_equal(host_rows[:tokens], buffer[:tokens]), f"offload rows ({tokens} tokens)"
            assert np.array_equal(host_counters, counters), "offload counters"
            assert np.array_equal(host_extra[: tokens * 8].view(np.int64), slots[:tokens]), "offload extra"
        h.fill(d_buffer)
        assert (h.download(d_buffer) == 0xFFFF).all(), "fill"
    finally:
        for array, was_pinned in zip((host_rows, host_counters, host_extra), pinned, strict=True):
            if was_pinned:
                h.unpin(array)
        h.free_all()
    return [f"offload: rows, counters and slot mapping into staging (page-locked: {all(pinned)}), event "
            "wait OK; fill OK"]


# ---------------------------------------------------------------------------------------
# Timing

def per_call(h: Harness, fn: Callable[[], object], iterations: int) -> float:
    """Median seconds per call over 5 batches of calls, each batch ended by one sync."""
    fn()
    h.sync()
    samples = []
    per_batch = max(1, iterations // 5)
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(per_batch):
            fn()
        h.sync()
        samples.append((time.perf_counter() - start) / per_batch)
    return statistics.median(samples)


def time_record(h: Harness, rng: np.random.Generator, tokens_list: list[int], iterations: int,
                started: float) -> list[list[str]]:
    layers, top_k, experts = 60, 8, 160
    buffer = h.upload(np.full((max(tokens_list), layers, top_k), 255, np.uint8))
    counters = h.upload(np.zeros(layers + 1, np.int64))
    rows = []
    for tokens in tokens_list:
        if time.monotonic() - started > DEADLINE_S:
            rows.append([f"record {tokens} tokens", "skipped (time budget)", "", ""])
            continue
        ids = h.upload(rng.integers(0, experts, (tokens, top_k)).astype(np.int64))
        seconds = per_call(h, lambda ids=ids: h.record_rows(buffer, ids, 7, experts, counters), iterations)
        moved = tokens * top_k * 9       # int64 ids read, uint8 ids written
        rows.append([f"record one MoE layer, {tokens:,} tokens × top-8", f"{seconds * 1e6:,.1f}",
                     f"{moved / seconds / 1e9:.1f}", "≈ the launch floor" if tokens == 1 else ""])
    h.free_all()
    return rows


def time_offload(h: Harness, tokens: int, iterations: int, started: float) -> list[list[str]]:
    if time.monotonic() - started > DEADLINE_S:
        return [[f"offload {tokens} tokens", "skipped (time budget)", "", ""]]
    layers, top_k = 60, 8
    buffer = h.upload(np.full((tokens, layers, top_k), 7, np.uint8))
    counters = h.upload(np.zeros(layers + 1, np.int64))
    host_rows = np.empty((tokens, layers, top_k), np.uint8)
    host_counters = np.empty(layers + 1, np.int64)
    host_extra = np.empty(0, np.uint8)
    pinned = [h.pin(host_rows), h.pin(host_counters)]
    event = h.event()

    def step() -> None:
        h.offload(buffer, tokens, counters, None, 0, host_rows, host_counters, host_extra, event)
        h.wait(event)

    seconds = per_call(h, step, iterations)
    for array, was_pinned in zip((host_rows, host_counters), pinned, strict=True):
        if was_pinned:
            h.unpin(array)
    h.free_all()
    return [[f"offload a step: {tokens:,} tokens × 60 layers × top-8 ({host_rows.nbytes / 1e6:.1f} MB)",
             f"{seconds * 1e6:,.1f}", f"{host_rows.nbytes / seconds / 1e9:.1f}",
             f"device→host into {'page-locked' if all(pinned) else 'pageable'} staging, incl. the event wait"]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", required=True, help="the harness shared library")
    parser.add_argument("--quick", action="store_true", help="fewer iterations, smaller sizes")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    started = time.monotonic()
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    h = Harness(args.lib)
    print(f"device_check: {args.lib}; seed {seed}")
    try:
        for line in check_record(h, rng) + check_offload_and_fill(h, rng):
            print(f"  ok  {line}")
    except AssertionError as exc:
        print(f"device_check FAILED (seed {seed}): {exc}", file=sys.stderr)
        return 1
    iterations = 20 if args.quick else 200
    record_tokens = [1, 64, 512, 8192] if args.quick else [1, 64, 512, 8192, 65536]
    rows = time_record(h, rng, record_tokens, iterations, started)
    rows += time_offload(h, 1024 if args.quick else 8192, max(iterations // 4, 5), started)
    print("\n### CUDA kernels (scripts/device_check.py)\n")
    print("| case | µs per call | GB/s | note |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\ndevice_check passed in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
