#!/usr/bin/env bash
# GPU check of the CUDA kernels, for a machine with an NVIDIA GPU (one call, < 5 min).
#
# Builds custom_ops/cuda_harness.cu (routing_kernels.cuh behind a C ABI, no Paddle) into a
# shared library with nvcc for the local GPU's architecture, then runs
# scripts/device_check.py: every kernel against the numpy reference on random inputs,
# then the timing table (record_routing per layer at 1/64/512/8k/64k tokens, pack_routing
# at 4k/32k tokens x 60 layers x top-8 against the card's copy bandwidth, per-step gather).
# Needs python3 with numpy and torch or cupy.  Extra arguments go to device_check.py
# (e.g. --quick, --seed N).  Environment: NVCC, PYTHON, FDRR_DEVICE_OUT (build folder).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)

if [ -z "${NVCC:-}" ]; then
  NVCC="$(command -v nvcc || true)"
  if [ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc; fi
fi
if [ -z "$NVCC" ] || ! command -v "$NVCC" >/dev/null 2>&1; then
  echo "device_check: nvcc not found (set NVCC=/path/to/nvcc)" >&2
  exit 2
fi

# The local GPU's compute capability (e.g. 9.0 -> sm_90); sm_80 + sm_90 when unknown.
cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .' || true)"
if [[ "$cap" =~ ^[0-9]+$ ]]; then
  GENCODE=(-gencode "arch=compute_${cap},code=sm_${cap}")
else
  GENCODE=(-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90)
fi

out="${FDRR_DEVICE_OUT:-build/device_check}"
mkdir -p "$out"
lib="$out/libfdrr_cuda_harness.so"
echo "device_check: building $lib (${GENCODE[*]}) with $("$NVCC" --version | tail -1)"
"$NVCC" -std=c++17 -O3 "${GENCODE[@]}" -shared -Xcompiler -fPIC -Icustom_ops \
  custom_ops/cuda_harness.cu -o "$lib"

PY="${PYTHON:-$(command -v python3 || command -v python)}"
timeout 280 "$PY" scripts/device_check.py --lib "$lib" "$@"
echo "device_check.sh finished in $(( $(date +%s) - started )) s"
