"""Dry run of scripts/device_check.py without a GPU.

The script drives the CUDA harness's C ABI (custom_ops/cuda_harness.cu); here the same ABI is
implemented on the host -- the record with the CPU loop of custom_ops/routing_kernels.h,
device memory with malloc and memcpy -- so the driver's argument order, dtype codes, offload
protocol and oracle comparisons are exercised before a GPU session spends its budget on
them.  This proves nothing about the CUDA code itself (scripts/cuda_compile_check.sh
compiles it; device_check.sh runs it).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

HOST_HARNESS = r"""
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include "routing_kernels.h"

namespace {
template <typename B, typename I>
int64_t rec(void* buffer, const void* ids, const fdrr::RowsArgs& a) {
  return fdrr::record_rows_cpu<B, I>(static_cast<B*>(buffer), static_cast<const I*>(ids), a);
}
template <typename B>
int64_t rec_ids(int id_bytes, void* buffer, const void* ids, const fdrr::RowsArgs& a) {
  return id_bytes == 4 ? rec<B, int32_t>(buffer, ids, a) : rec<B, int64_t>(buffer, ids, a);
}
}  // namespace

extern "C" {
int fdrr_h_malloc(int64_t bytes, void** out) { *out = std::malloc(bytes > 0 ? bytes : 1); return 0; }
int fdrr_h_free(void* ptr) { std::free(ptr); return 0; }
int fdrr_h_upload(void* dst, const void* src, int64_t bytes) { std::memcpy(dst, src, bytes); return 0; }
int fdrr_h_download(void* dst, const void* src, int64_t bytes) { std::memcpy(dst, src, bytes); return 0; }
int fdrr_h_record_rows(void* buffer, int buffer_bytes, int64_t capacity, int64_t num_layers, int64_t top_k,
                       const void* ids, int id_bytes, int64_t num_tokens, int64_t layer, int64_t num_experts,
                       unsigned long long* counters) {
  if (num_tokens < 0 || num_tokens > capacity || layer < 0 || layer >= num_layers) return -1;
  if (num_tokens == 0) return 0;
  const fdrr::RowsArgs a{capacity, num_layers, top_k, num_tokens, layer, num_experts};
  int64_t errors = 0;
  if (buffer_bytes == 1) errors = rec_ids<uint8_t>(id_bytes, buffer, ids, a);
  else if (buffer_bytes == 2) errors = rec_ids<uint16_t>(id_bytes, buffer, ids, a);
  else errors = rec_ids<uint32_t>(id_bytes, buffer, ids, a);
  counters[0] += static_cast<unsigned long long>(errors);
  counters[1 + layer] += 1;
  return 0;
}
int fdrr_h_pin(void*, int64_t, int* pinned) { *pinned = 0; return 0; }
int fdrr_h_unpin(void*) { return 0; }
int fdrr_h_event_create(void** event) { *event = std::malloc(1); return 0; }
int fdrr_h_event_destroy(void* event) { std::free(event); return 0; }
int fdrr_h_offload(const void* rows, int64_t row_bytes, int64_t num_tokens, const void* counters,
                   int64_t counter_bytes, const void* extra, int64_t extra_bytes, void* host_rows,
                   void* host_counters, void* host_extra, void*) {
  std::memcpy(host_rows, rows, num_tokens * row_bytes);
  std::memcpy(host_counters, counters, counter_bytes);
  if (extra != nullptr && extra_bytes > 0) std::memcpy(host_extra, extra, extra_bytes);
  return 0;
}
int fdrr_h_wait(void*) { return 0; }
int fdrr_h_fill(void* buffer, int64_t bytes) { std::memset(buffer, 0xFF, bytes); return 0; }
int fdrr_h_synchronize(void) { return 0; }
const char* fdrr_h_error_string(int) { return "host harness error"; }
}
"""


@pytest.fixture(scope="module")
def host_harness(tmp_path_factory) -> Path:
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler on PATH")
    out = tmp_path_factory.mktemp("harness")
    (out / "host_harness.cc").write_text(HOST_HARNESS)
    lib = out / "libhost_harness.so"
    subprocess.run([compiler, "-std=c++17", "-O2", "-shared", "-fPIC", f"-I{REPO / 'custom_ops'}",
                    str(out / "host_harness.cc"), "-o", str(lib)], check=True)
    return lib


def run_script(lib: Path, seed: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts/device_check.py"), "--lib", str(lib), "--quick",
                           "--seed", str(seed)], capture_output=True, text=True, timeout=300)


def test_device_check_dry_run_on_host(host_harness: Path, seed: int) -> None:
    done = run_script(host_harness, seed)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "device_check passed" in done.stdout
    for check in ("record uint8", "record uint16", "record uint32", "offload: rows, counters and slot mapping"):
        assert f"ok  {check}" in done.stdout, check
    assert "| record one MoE layer, 8,192 tokens × top-8 |" in done.stdout
    assert "| offload a step: 1,024 tokens × 60 layers × top-8 (0.5 MB) |" in done.stdout


def test_device_check_fails_on_a_wrong_kernel(tmp_path: Path, seed: int) -> None:
    """A harness whose record drops the bad-id count fails the check: the oracle is live."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler on PATH")
    (tmp_path / "broken.cc").write_text(HOST_HARNESS.replace("counters[0] += static_cast<unsigned long long>(errors);",
                                                             "(void)errors;"))
    lib = tmp_path / "libbroken.so"
    subprocess.run([compiler, "-std=c++17", "-O2", "-shared", "-fPIC", f"-I{REPO / 'custom_ops'}",
                    str(tmp_path / "broken.cc"), "-o", str(lib)], check=True)
    done = run_script(lib, seed)
    assert done.returncode == 1 and "device_check FAILED" in done.stderr and "record counters" in done.stderr
