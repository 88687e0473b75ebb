"""GPU check of fd-routing-replay's CUDA kernels through the C-ABI harness (no Paddle).

Run by scripts/device_check.sh, which builds custom_ops/cuda_harness.cu into a shared
library with nvcc.  This script drives that library through ctypes on device memory
from torch or cupy (whichever imports with a GPU), checks every kernel against the numpy
reference (fd_routing_replay/ops/reference.py) on random inputs, then prints the timing
table of issue 3: record_routing per layer for 1/64/512/8k/64k tokens (µs per call,
GB/s) and pack_routing for 4k/32k tokens × 60 layers × top-8 (GB/s against the card's
device-to-device copy), plus the per-step gather.  Finishes well within 5 minutes.

    python scripts/device_check.py --lib build/libfdrr_cuda_harness.so [--quick] [--seed N]

`--backend host` drives a CPU build of the same C ABI with numpy buffers; the test
suite uses it to exercise this script without a GPU (it proves nothing about CUDA).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fd_routing_replay.ops import reference as ref  # noqa: E402  (numpy only)

NO_BAD = 2**64 - 1
DEADLINE_S = 240.0  # leave the timing rows out rather than overrun the 5-minute budget
c_i64, c_int, c_ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


# ---------------------------------------------------------------------------------------
# Device buffers: raw bytes from torch, cupy or numpy (host dry run)

@dataclass
class Buffer:
    handle: Any  # the owning torch / cupy / numpy byte array
    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype


class Backend:
    """Allocation, copies, sync and timing on one array library."""

    name = "?"

    def upload(self, array: np.ndarray) -> Buffer:
        raw = np.ascontiguousarray(array)
        buf = self._from_bytes(raw.reshape(-1).view(np.uint8))
        return Buffer(buf, self._ptr(buf), raw.shape, raw.dtype)

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Buffer:
        dtype = np.dtype(dtype)
        buf = self._alloc(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        return Buffer(buf, self._ptr(buf), tuple(shape), dtype)

    def download(self, b: Buffer) -> np.ndarray:
        return self._to_numpy(b.handle).view(b.dtype).reshape(b.shape)

    def time_call(self, fn: Callable[[], object], iterations: int) -> float:
        """Median seconds per call over batches of calls timed with device events."""
        fn()
        self.sync()
        samples = []
        per_batch = max(1, iterations // 5)
        for _ in range(5):
            start = self._event()
            for _ in range(per_batch):
                fn()
            samples.append(self._elapsed(start) / per_batch)
        return statistics.median(samples)


class TorchBackend(Backend):
    name = "torch"

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no GPU")
        self.torch = torch
        self.name = f"torch {torch.__version__} on {torch.cuda.get_device_name()}"

    def _alloc(self, nbytes):
        return self.torch.empty(max(nbytes, 1), dtype=self.torch.uint8, device="cuda")[:nbytes]

    def _from_bytes(self, raw):
        return self.torch.from_numpy(raw.copy()).to("cuda")

    def _ptr(self, buf):
        return buf.data_ptr()

    def _to_numpy(self, buf):
        return buf.cpu().numpy()

    def sync(self):
        self.torch.cuda.synchronize()

    def copy(self, dst: Buffer, src: Buffer) -> None:
        dst.handle.copy_(src.handle)

    def _event(self):
        start = self.torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def _elapsed(self, start) -> float:
        stop = self.torch.cuda.Event(enable_timing=True)
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3


class CupyBackend(Backend):
    name = "cupy"

    def __init__(self) -> None:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("cupy sees no GPU")
        self.cp = cupy
        props = cupy.cuda.runtime.getDeviceProperties(0)
        self.name = f"cupy {cupy.__version__} on {props['name'].decode()}"

    def _alloc(self, nbytes):
        return self.cp.empty(nbytes, dtype=self.cp.uint8)

    def _from_bytes(self, raw):
        return self.cp.asarray(raw)

    def _ptr(self, buf):
        return buf.data.ptr

    def _to_numpy(self, buf):
        return self.cp.asnumpy(buf)

    def sync(self):
        self.cp.cuda.Device().synchronize()

    def copy(self, dst: Buffer, src: Buffer) -> None:
        self.cp.copyto(dst.handle, src.handle)

    def _event(self):
        start = self.cp.cuda.Event()
        start.record()
        return start

    def _elapsed(self, start) -> float:
        stop = self.cp.cuda.Event()
        stop.record()
        stop.synchronize()
        return self.cp.cuda.get_elapsed_time(start, stop) / 1e3


class HostBackend(Backend):
    """numpy buffers for a CPU build of the C ABI (dry run of this script, no CUDA)."""

    name = "host (numpy; dry run without a GPU)"

    def _alloc(self, nbytes):
        return np.empty(nbytes, np.uint8)

    def _from_bytes(self, raw):
        return raw.copy()

    def _ptr(self, buf):
        return buf.ctypes.data

    def _to_numpy(self, buf):
        return buf.copy()

    def sync(self):
        pass

    def copy(self, dst: Buffer, src: Buffer) -> None:
        np.copyto(dst.handle, src.handle)

    def _event(self):
        return time.perf_counter()

    def _elapsed(self, start) -> float:
        return time.perf_counter() - start


def pick_backend(name: str) -> Backend:
    choices = {"torch": [TorchBackend], "cupy": [CupyBackend], "host": [HostBackend],
               "auto": [TorchBackend, CupyBackend]}[name]
    errors = []
    for cls in choices:
        try:
            return cls()
        except Exception as exc:  # ImportError, no GPU, driver trouble: try the next one
            errors.append(f"{cls.__name__}: {exc!r}")
    raise SystemExit("device_check: no usable GPU array library: " + "; ".join(errors))


# ---------------------------------------------------------------------------------------
# The harness library

class Harness:
    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        lib.fdrr_h_record_routing.argtypes = [
            c_ptr, c_int, c_i64, c_i64, c_i64, c_i64, c_ptr, c_int, c_i64, c_ptr, c_ptr, c_i64,
            c_ptr, c_i64, c_int, c_i64, c_i64, c_ptr, c_ptr]
        lib.fdrr_h_find_bad_index.argtypes = [c_ptr, c_int, c_i64, c_i64, c_ptr, c_ptr]
        lib.fdrr_h_pack_routing.argtypes = [c_ptr, c_i64, c_i64, c_i64, c_ptr, c_int, c_i64, c_ptr,
                                            c_ptr, c_int, c_ptr]
        lib.fdrr_h_gather_routing_rows.argtypes = [c_ptr, c_i64, c_i64, c_ptr, c_ptr, c_int, c_i64,
                                                   c_ptr, c_ptr, c_int, c_ptr]
        lib.fdrr_h_clear_routing_rows.argtypes = [c_ptr, c_i64, c_ptr, c_int, c_i64, c_ptr, c_int,
                                                  c_ptr]
        self.has_record_rows = hasattr(lib, "fdrr_h_record_rows")
        if self.has_record_rows:
            lib.fdrr_h_record_rows.argtypes = [c_ptr, c_int, c_i64, c_i64, c_i64, c_ptr, c_int, c_i64,
                                               c_i64, c_i64, c_ptr, c_ptr]
        lib.fdrr_h_synchronize.argtypes = []
        lib.fdrr_h_error_string.argtypes = [c_int]
        lib.fdrr_h_error_string.restype = ctypes.c_char_p
        self.lib = lib

    def check(self, status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what}: {self.lib.fdrr_h_error_string(status).decode()} ({status})")

    def record(self, table: Buffer, ids: Buffer, batch: Buffer, cu: Buffer, dec: Buffer,
               layer: int, num_experts: int, errors: Buffer) -> None:
        b, m, n_layers, k = table.shape
        self.check(self.lib.fdrr_h_record_routing(
            table.ptr, table.dtype.itemsize, b, m, n_layers, k, ids.ptr, ids.dtype.itemsize,
            ids.shape[0], batch.ptr, cu.ptr, cu.shape[0], dec.ptr, dec.shape[0],
            batch.dtype.itemsize, layer, num_experts, errors.ptr, None), "record_routing")

    def record_rows(self, buffer: Buffer, ids: Buffer, layer: int, num_experts: int,
                    counters: Buffer) -> None:
        capacity, n_layers, k = buffer.shape
        self.check(self.lib.fdrr_h_record_rows(
            buffer.ptr, buffer.dtype.itemsize, capacity, n_layers, k, ids.ptr, ids.dtype.itemsize,
            ids.shape[0], layer, num_experts, counters.ptr, None), "record_rows")

    def find_bad(self, index: Buffer, bound: int, word: Buffer, offset: int = 0) -> None:
        self.check(self.lib.fdrr_h_find_bad_index(
            index.ptr, index.dtype.itemsize, index.shape[0], bound, word.ptr + 8 * offset, None),
            "find_bad_index")

    def pack(self, source: Buffer, slots: Buffer, out: Buffer, words: Buffer | None) -> None:
        _, n_layers, k = source.shape
        self.check(self.lib.fdrr_h_pack_routing(
            source.ptr, n_layers, k, source.dtype.itemsize, slots.ptr, slots.dtype.itemsize,
            slots.shape[0], out.ptr, words.ptr if words else None, 1 if words else 0, None),
            "pack_routing")

    def gather(self, table: Buffer, b: Buffer, p: Buffer, out: Buffer, words: Buffer | None) -> None:
        _, m, n_layers, k = table.shape
        self.check(self.lib.fdrr_h_gather_routing_rows(
            table.ptr, m, n_layers * k * table.dtype.itemsize, b.ptr, p.ptr, b.dtype.itemsize,
            b.shape[0], out.ptr, words.ptr if words else None, 2 if words else 0, None),
            "gather_routing_rows")

    def clear(self, table: Buffer, b: Buffer, words: Buffer | None) -> None:
        _, m, n_layers, k = table.shape
        self.check(self.lib.fdrr_h_clear_routing_rows(
            table.ptr, m * n_layers * k * table.dtype.itemsize, b.ptr, b.dtype.itemsize,
            b.shape[0], words.ptr if words else None, 1 if words else 0, None),
            "clear_routing_rows")

    def sync(self) -> None:
        self.check(self.lib.fdrr_h_synchronize(), "synchronize")


# ---------------------------------------------------------------------------------------
# Correctness against the numpy reference

EXPERTS = {np.uint8: 200, np.uint16: 40000, np.uint32: 70000}


def random_step(rng: np.random.Generator, max_num_seqs: int, max_len: int, top_k: int,
                num_experts: int, id_dtype: Any, idx_dtype: Any, tokens_per_seq: int = 12):
    """A mixed prefill/decode step with padding, positions past max_len and bad ids."""
    this_time = np.where(rng.random(max_num_seqs) < 0.5, rng.integers(1, tokens_per_seq + 1, max_num_seqs), 1)
    this_time[rng.random(max_num_seqs) < 0.2] = 0  # idle slots
    decoder = rng.integers(0, max_len, max_num_seqs)
    decoder[rng.random(max_num_seqs) < 0.2] = max_len - 1  # tokens at / past max_len
    cu = np.concatenate([[0], np.cumsum(this_time)])
    # padding: -1, and stale non-negative batch ids (a reused buffer) that the span check skips
    batch = np.concatenate([np.repeat(np.arange(max_num_seqs), this_time),
                            [-1, int(rng.integers(0, max_num_seqs)), 0]])
    ids = rng.integers(0, num_experts, (batch.shape[0], top_k))
    bad = rng.random(ids.shape) < 0.03
    ids[bad] = rng.choice([-1, num_experts, num_experts + 9], int(bad.sum()))
    return (ids.astype(id_dtype), batch.astype(idx_dtype), cu.astype(idx_dtype),
            decoder.astype(idx_dtype))


def check_kernels(dev: Backend, h: Harness, rng: np.random.Generator) -> list[str]:
    """Run every kernel on random inputs; return one line per checked case."""
    lines = []
    words = dev.upload(np.zeros(2, np.uint64))
    for dtype, experts in EXPERTS.items():
        for id_dtype in (np.int32, np.int64):
            for idx_dtype in (np.int32, np.int64):
                table = rng.integers(0, experts, (6, 40, 5, 8)).astype(dtype)
                step = random_step(rng, 6, 40, 8, experts, id_dtype, idx_dtype)
                d_table = dev.upload(table)
                d_errors = dev.upload(np.zeros(1, np.int64))
                h.record(d_table, *(dev.upload(x) for x in step), 3, experts, d_errors)
                expected_errors = ref.record_routing_np(table, *step, 3, experts)
                assert np.array_equal(dev.download(d_table), table), f"record {dtype} {id_dtype} {idx_dtype}"
                assert int(dev.download(d_errors)[0]) == expected_errors, "record error count"
        lines.append(f"record_routing {np.dtype(dtype).name}: ids int32/int64 × indices int32/int64 OK")
        if h.has_record_rows:
            for id_dtype in (np.int32, np.int64):
                buffer = rng.integers(0, experts, (50, 5, 8)).astype(dtype)
                counters = np.zeros(6, np.int64)
                d_buffer, d_counters = dev.upload(buffer), dev.upload(counters)
                for layer, tokens in ((3, 37), (0, 50), (3, 1)):
                    ids = rng.integers(-2, experts + 2, (tokens, 8)).astype(id_dtype)
                    h.record_rows(d_buffer, dev.upload(ids), layer, experts, d_counters)
                    counters[0] += ref.record_rows_np(buffer, ids, layer, experts)
                    counters[1 + layer] += 1
                assert np.array_equal(dev.download(d_buffer), buffer), f"record_rows {dtype} {id_dtype}"
                assert np.array_equal(dev.download(d_counters), counters), "record_rows counters"
            lines.append(f"record_rows {np.dtype(dtype).name}: rows, bad-id and call counters OK")

        for top_k in (8, 6, 1, 3):
            source = rng.integers(0, experts, (300, 7, top_k)).astype(dtype)
            for idx_dtype in (np.int32, np.int64):
                slots = rng.integers(0, 300, 517).astype(idx_dtype)
                slots[-1] = slots[0]
                d_slots, d_out = dev.upload(slots), dev.empty((7, 517, top_k), dtype)
                h.find_bad(d_slots, 300, words)
                h.pack(dev.upload(source), d_slots, d_out, words)
                assert np.array_equal(dev.download(d_out), source[slots].transpose(1, 0, 2)), "pack"
                assert int(dev.download(words)[0]) == NO_BAD
        # an out-of-range slot: the word names it, nothing is written
        slots = rng.integers(0, 300, 64)
        slots[[17, 40]] = [300, -1]
        sentinel = np.full((7, 64, 3), 5, dtype)
        d_out = dev.upload(sentinel)
        d_slots = dev.upload(slots)
        h.find_bad(d_slots, 300, words)
        h.pack(dev.upload(source), d_slots, d_out, words)
        assert int(dev.download(words)[0]) == 17 and np.array_equal(dev.download(d_out), sentinel)
        lines.append(f"pack_routing {np.dtype(dtype).name}: top_k 8/6/1/3, repeats, bad slot refused OK")

        table = rng.integers(0, experts, (5, 33, 6, 8)).astype(dtype)
        d_table = dev.upload(table)
        b, p = rng.integers(0, 5, 70), rng.integers(0, 33, 70)
        d_b, d_p, d_rows = dev.upload(b), dev.upload(p), dev.empty((70, 6, 8), dtype)
        h.find_bad(d_b, 5, words, 0)
        h.find_bad(d_p, 33, words, 1)
        h.gather(d_table, d_b, d_p, d_rows, words)
        assert np.array_equal(dev.download(d_rows), table[b, p]), "gather"
        p[9] = 33
        d_p = dev.upload(p)
        h.find_bad(d_b, 5, words, 0)
        h.find_bad(d_p, 33, words, 1)
        sentinel = np.full((70, 6, 8), 4, dtype)
        d_rows = dev.upload(sentinel)
        h.gather(d_table, d_b, d_p, d_rows, words)
        assert list(dev.download(words)) == [NO_BAD, 9] and np.array_equal(dev.download(d_rows), sentinel)
        lines.append(f"gather_routing_rows {np.dtype(dtype).name}: OK, bad position refused")

        clear = np.array([3, 0, 3], np.int64)
        d_clear = dev.upload(clear)
        h.find_bad(d_clear, 5, words)
        h.clear(d_table, d_clear, words)
        table[clear] = np.iinfo(dtype).max
        assert np.array_equal(dev.download(d_table), table), "clear"
        d_clear = dev.upload(np.array([1, 5]))
        h.find_bad(d_clear, 5, words)
        h.clear(d_table, d_clear, words)
        assert int(dev.download(words)[0]) == 1 and np.array_equal(dev.download(d_table), table)
        lines.append(f"clear_routing_rows {np.dtype(dtype).name}: OK, bad batch id refused")
    h.sync()
    return lines


# ---------------------------------------------------------------------------------------
# Timing

def fmt_us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f}"


def time_record(dev: Backend, h: Harness, rng: np.random.Generator, tokens_list: list[int],
                iterations: int, started: float, quick: bool) -> list[list[str]]:
    num_layers, top_k, experts = 60, 8, 160
    max_num_seqs, max_len = (64, 1024) if quick else (128, 4096)  # 31 MB / 251 MB tables
    table = dev.upload(np.full((max_num_seqs, max_len, num_layers, top_k), 255, np.uint8))
    errors = dev.upload(np.zeros(1, np.int64))
    rows = []
    for tokens in tokens_list:
        if time.monotonic() - started > DEADLINE_S:
            rows.append([f"record_routing {tokens} tokens", "skipped (time budget)", "", ""])
            continue
        seqs = min(tokens, max_num_seqs)
        per_seq = np.full(seqs, tokens // seqs)
        per_seq[: tokens - per_seq.sum()] += 1
        cu = np.concatenate([[0], np.cumsum(per_seq)]).astype(np.int32)
        dec = rng.integers(0, max_len - per_seq.max(), seqs).astype(np.int32)
        batch = np.repeat(np.arange(seqs), per_seq).astype(np.int32)
        ids = rng.integers(0, experts, (tokens, top_k)).astype(np.int64)
        args = [dev.upload(x) for x in (ids, batch, cu, dec)]
        layers = iter(range(10**9))

        def one_layer(args=args, layers=layers):
            h.record(table, *args, next(layers) % num_layers, experts, errors)

        seconds = dev.time_call(one_layer, iterations)
        moved = ids.nbytes + batch.nbytes + tokens * top_k  # ids + batch ids read, table written
        rows.append([f"record_routing, {tokens:,} tokens (1 layer)", fmt_us(seconds),
                     f"{moved / seconds / 1e9:.1f}", ""])
    return rows


def time_record_rows(dev: Backend, h: Harness, rng: np.random.Generator, tokens_list: list[int],
                     iterations: int, started: float) -> list[list[str]]:
    """The step buffer's per-layer write (what capture launches per MoE layer)."""
    if not h.has_record_rows:
        return []
    num_layers, top_k, experts = 60, 8, 160
    buffer = dev.upload(np.full((max(tokens_list), num_layers, top_k), 255, np.uint8))
    counters = dev.upload(np.zeros(num_layers + 1, np.int64))
    rows = []
    for tokens in tokens_list:
        if time.monotonic() - started > DEADLINE_S:
            rows.append([f"record_rows {tokens} tokens", "skipped (time budget)", "", ""])
            continue
        ids = dev.upload(rng.integers(0, experts, (tokens, top_k)).astype(np.int64))
        seconds = dev.time_call(functools.partial(h.record_rows, buffer, ids, 7, experts, counters),
                                iterations)
        moved = tokens * top_k * 9
        rows.append([f"record_rows (step buffer), {tokens:,} tokens (1 layer)", fmt_us(seconds),
                     f"{moved / seconds / 1e9:.1f}", "1 token ≈ the launch floor"])
    return rows


def time_pack(dev: Backend, h: Harness, rng: np.random.Generator, tokens_list: list[int],
              iterations: int, started: float) -> list[list[str]]:
    num_layers, top_k, block = 60, 8, 64
    rows = []
    for tokens in tokens_list:
        if time.monotonic() - started > DEADLINE_S:
            rows.append([f"pack_routing {tokens} tokens", "skipped (time budget)", "", ""])
            continue
        num_slots = 4 * tokens
        blocks = rng.permutation(num_slots // block)[: (tokens + block - 1) // block]
        slots = (blocks[:, None] * block + np.arange(block)).reshape(-1)[:tokens].astype(np.int64)
        source = dev.upload(rng.integers(0, 160, (num_slots, num_layers, top_k)).astype(np.uint8))
        d_slots, out = dev.upload(slots), dev.empty((num_layers, tokens, top_k), np.uint8)
        nbytes = tokens * num_layers * top_k
        pack_s = dev.time_call(functools.partial(h.pack, source, d_slots, out, None), iterations)
        src_copy, dst_copy = dev.empty((nbytes,), np.uint8), dev.empty((nbytes,), np.uint8)
        copy_s = dev.time_call(functools.partial(dev.copy, dst_copy, src_copy), iterations)
        rows.append([f"pack_routing, {tokens:,} tokens × 60 layers × top-8", fmt_us(pack_s),
                     f"{2 * nbytes / pack_s / 1e9:.1f}",
                     f"copy {2 * nbytes / copy_s / 1e9:.1f} GB/s ({fmt_us(copy_s)} µs); pack/copy {pack_s / copy_s:.2f}×"])
    return rows


def time_gather(dev: Backend, h: Harness, rng: np.random.Generator, iterations: int,
                started: float, quick: bool) -> list[list[str]]:
    if time.monotonic() - started > DEADLINE_S:
        return []
    max_len = 1024 if quick else 4096  # 126 MB / 503 MB tables
    table = dev.upload(np.full((256, max_len, 60, 8), 7, np.uint8))
    rows = []
    for n in (64, 256):
        b = dev.upload(rng.permutation(256)[:n].astype(np.int64))
        p = dev.upload(rng.integers(0, max_len, n).astype(np.int64))
        out = dev.empty((n, 60, 8), np.uint8)
        seconds = dev.time_call(functools.partial(h.gather, table, b, p, out, None), iterations)
        rows.append([f"gather_routing_rows, decode step of {n} sequences", fmt_us(seconds),
                     f"{2 * n * 480 / seconds / 1e9:.1f}", ""])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", required=True, help="the harness shared library")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "cupy", "host"])
    parser.add_argument("--quick", action="store_true", help="fewer iterations, smaller sizes")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    started = time.monotonic()
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    dev = pick_backend(args.backend)
    h = Harness(args.lib)
    print(f"device_check: {dev.name}; seed {seed}")
    try:
        for line in check_kernels(dev, h, rng):
            print(f"  ok  {line}")
    except AssertionError as exc:
        print(f"device_check FAILED (seed {seed}): {exc}", file=sys.stderr)
        return 1
    iterations = 20 if args.quick else 200
    record_tokens = [1, 64, 512, 8192] if args.quick else [1, 64, 512, 8192, 65536]
    pack_tokens = [4096] if args.quick else [4096, 32768]
    rows = time_record(dev, h, rng, record_tokens, iterations, started, args.quick)
    rows += time_record_rows(dev, h, rng, record_tokens, iterations, started)
    rows += time_pack(dev, h, rng, pack_tokens, max(iterations // 4, 5), started)
    rows += time_gather(dev, h, rng, iterations, started, args.quick)
    print(f"\n### CUDA kernels ({dev.name})\n")
    print("| case | µs per call | GB/s | note |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\ndevice_check passed in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
