"""Dry run of scripts/device_check.py without a GPU.

The script drives the CUDA harness's C ABI; here the same ABI is implemented on the
host with the CPU loops of custom_ops/routing_kernels.h, so the driver's argument
order, dtype codes, index-check protocol and reference comparisons are exercised before
a GPU session spends its budget on them.  This proves nothing about the CUDA kernels
themselves (scripts/cuda_compile_check.sh compiles them; device_check.sh runs them).
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
#include "routing_kernels.h"

namespace {
constexpr unsigned long long kNoBad = ~0ull;
bool any_bad(const unsigned long long* w, int n) {
  for (int i = 0; i < n; ++i) if (w[i] != kNoBad) return true;
  return false;
}
template <typename T, typename I, typename X>
int64_t rec(void* t, const void* ids, const void* b, const void* c, const void* d,
            const fdrr::RecordArgs& a) {
  return fdrr::record_routing_cpu<T, I, X>(static_cast<T*>(t), static_cast<const I*>(ids),
      static_cast<const X*>(b), static_cast<const X*>(c), static_cast<const X*>(d), a);
}
template <typename T, typename I>
int64_t rec_x(int xb, void* t, const void* ids, const void* b, const void* c, const void* d,
              const fdrr::RecordArgs& a) {
  return xb == 4 ? rec<T, I, int32_t>(t, ids, b, c, d, a) : rec<T, I, int64_t>(t, ids, b, c, d, a);
}
template <typename T>
int64_t rec_i(int ib, int xb, void* t, const void* ids, const void* b, const void* c,
              const void* d, const fdrr::RecordArgs& a) {
  return ib == 4 ? rec_x<T, int32_t>(xb, t, ids, b, c, d, a) : rec_x<T, int64_t>(xb, t, ids, b, c, d, a);
}
}  // namespace

extern "C" {
int fdrr_h_record_routing(void* table, int tb, int64_t B, int64_t M, int64_t L, int64_t K,
                          const void* ids, int ib, int64_t T, const void* batch, const void* cu,
                          int64_t ncu, const void* dec, int64_t ndec, int xb, int64_t layer,
                          int64_t ne, unsigned long long* errors, void*) {
  const fdrr::RecordArgs a{B, M, L, K, T, ncu, ndec, layer, ne};
  int64_t e = 0;
  if (tb == 1) e = rec_i<uint8_t>(ib, xb, table, ids, batch, cu, dec, a);
  else if (tb == 2) e = rec_i<uint16_t>(ib, xb, table, ids, batch, cu, dec, a);
  else e = rec_i<uint32_t>(ib, xb, table, ids, batch, cu, dec, a);
  *errors += static_cast<unsigned long long>(e);
  return 0;
}
int fdrr_h_find_bad_index(const void* index, int xb, int64_t n, int64_t bound,
                          unsigned long long* word, void*) {
  const int64_t i = xb == 4 ? fdrr::first_bad_index(static_cast<const int32_t*>(index), n, bound)
                            : fdrr::first_bad_index(static_cast<const int64_t*>(index), n, bound);
  *word = i < 0 ? kNoBad : static_cast<unsigned long long>(i);
  return 0;
}
int fdrr_h_pack_routing(const void* source, int64_t L, int64_t K, int64_t eb, const void* slots,
                        int xb, int64_t T, void* out, const unsigned long long* bad, int nbad,
                        void*) {
  if (bad && any_bad(bad, nbad)) return 0;
  if (xb == 4) fdrr::pack_routing_cpu(source, L, K, eb, static_cast<const int32_t*>(slots), T, out);
  else fdrr::pack_routing_cpu(source, L, K, eb, static_cast<const int64_t*>(slots), T, out);
  return 0;
}
int fdrr_h_gather_routing_rows(const void* table, int64_t M, int64_t row, const void* b,
                               const void* p, int xb, int64_t n, void* out,
                               const unsigned long long* bad, int nbad, void*) {
  if (bad && any_bad(bad, nbad)) return 0;
  if (xb == 4) fdrr::gather_routing_rows_cpu(table, M, row, static_cast<const int32_t*>(b),
                                             static_cast<const int32_t*>(p), n, out);
  else fdrr::gather_routing_rows_cpu(table, M, row, static_cast<const int64_t*>(b),
                                     static_cast<const int64_t*>(p), n, out);
  return 0;
}
int fdrr_h_clear_routing_rows(void* table, int64_t seq_bytes, const void* b, int xb, int64_t n,
                              const unsigned long long* bad, int nbad, void*) {
  if (bad && any_bad(bad, nbad)) return 0;
  if (xb == 4) fdrr::clear_routing_rows_cpu(table, seq_bytes, static_cast<const int32_t*>(b), n);
  else fdrr::clear_routing_rows_cpu(table, seq_bytes, static_cast<const int64_t*>(b), n);
  return 0;
}
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


def test_device_check_dry_run_on_host(host_harness: Path, seed: int) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts/device_check.py"), "--lib", str(host_harness),
         "--backend", "host", "--quick", "--seed", str(seed)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "device_check passed" in done.stdout
    for kernel in ("record_routing", "pack_routing", "gather_routing_rows", "clear_routing_rows"):
        assert f"ok  {kernel}" in done.stdout
    assert "| record_routing, 8,192 tokens (1 layer) |" in done.stdout
    assert "| pack_routing, 4,096 tokens × 60 layers × top-8 |" in done.stdout
