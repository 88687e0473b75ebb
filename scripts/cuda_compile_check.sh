#!/usr/bin/env bash
# Compile-check fd-routing-replay's kernels without a GPU (the Makefile's `cuda-check`).
#
# 1. custom_ops/routing_kernels.cuh through the C-ABI harness custom_ops/cuda_harness.cu
#    (no Paddle headers), as device code for sm_80 and sm_90, warnings as errors;
# 2. the same harness as the shared library scripts/device_check.sh loads, and its C ABI;
# 3. the CPU loops of custom_ops/routing_kernels.h, every template instantiated, with
#    -Wall -Wextra -Werror (the Paddle extension build compiles them with -w).
# The Paddle-facing custom_ops/routing_ops.cu needs a CUDA build of Paddle and is not
# compiled here.  Prints "skipped: nvcc not found" and exits 0 when there is no nvcc;
# fails on any compile error.  Takes about 10-20 s.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${NVCC:-}" ]; then
  NVCC="$(command -v nvcc || true)"
  if [ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc; fi
fi
if [ -z "$NVCC" ] || ! command -v "$NVCC" >/dev/null 2>&1; then
  echo "cuda-check skipped: nvcc not found (set NVCC=/path/to/nvcc or put it on PATH)"
  exit 0
fi

started=$(date +%s)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "cuda-check: $("$NVCC" --version | tail -1)"

GENCODE=(-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90)
"$NVCC" -std=c++17 -O3 "${GENCODE[@]}" -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror \
  -Icustom_ops -c custom_ops/cuda_harness.cu -o "$out/cuda_harness.o"
echo "  kernels: sm_80 + sm_90 object OK"

"$NVCC" -std=c++17 -O3 "${GENCODE[@]}" -shared -Xcompiler -fPIC \
  -Icustom_ops custom_ops/cuda_harness.cu -o "$out/libfdrr_cuda_harness.so"
for symbol in fdrr_h_record_routing fdrr_h_find_bad_index fdrr_h_pack_routing \
              fdrr_h_gather_routing_rows fdrr_h_clear_routing_rows fdrr_h_synchronize \
              fdrr_h_error_string; do
  if ! nm -D --defined-only "$out/libfdrr_cuda_harness.so" | grep -qw "$symbol"; then
    echo "cuda-check FAILED: $symbol missing from the harness library" >&2
    exit 1
  fi
done
echo "  harness: shared library with its C ABI OK"

CXX="${CXX:-$(command -v g++ || command -v c++ || true)}"
if [ -n "$CXX" ]; then
  cat > "$out/cpu_kernels.cc" <<'CPP'
#include "routing_kernels.h"
template <typename TableT, typename IdT, typename IdxT>
void instantiate() {
  fdrr::RecordArgs a{1, 1, 1, 1, 0, 0, 0, 0, 1};
  fdrr::record_routing_cpu<TableT, IdT, IdxT>(nullptr, nullptr, nullptr, nullptr, nullptr, a);
  fdrr::pack_routing_cpu<IdxT>(nullptr, 1, 1, sizeof(TableT), nullptr, 0, nullptr);
  fdrr::gather_routing_rows_cpu<IdxT>(nullptr, 1, 1, nullptr, nullptr, 0, nullptr);
  fdrr::clear_routing_rows_cpu<IdxT>(nullptr, 1, nullptr, 0);
  (void)fdrr::first_bad_index<IdxT>(nullptr, 0, 1);
}
#define ALL_IDS(T) instantiate<T, int32_t, int32_t>(); instantiate<T, int32_t, int64_t>(); \
                   instantiate<T, int64_t, int32_t>(); instantiate<T, int64_t, int64_t>();
int main() { ALL_IDS(uint8_t) ALL_IDS(uint16_t) ALL_IDS(uint32_t) return 0; }
CPP
  "$CXX" -std=c++17 -O2 -Wall -Wextra -Werror -Icustom_ops -c "$out/cpu_kernels.cc" -o "$out/cpu_kernels.o"
  echo "  cpu loops: -Wall -Wextra -Werror OK"
fi

echo "cuda-check passed ($(( $(date +%s) - started )) s): kernels compile for sm_80 and sm_90;" \
     "not run on a GPU here (scripts/device_check.sh does that)"
