#!/usr/bin/env bash
# GPU check of the CUDA code, for a machine with an NVIDIA GPU (one call, < 5 min).
#
# Builds custom_ops/cuda_harness.cu (routing_kernels.cuh behind a C ABI, no Paddle) into a
# shared library with nvcc for the local GPU's architecture, then runs
# scripts/device_check.py: what the library's StepRecorder runs on a GPU -- the per-layer
# record kernel, the step's offload into page-locked staging with its event, the refill --
# against the NumPy oracle (tests/ops_oracle.py) on random inputs, then the timing table
# (record per MoE layer at 1/64/512/8k/64k tokens, the offload of an 8k-token step x 60
# layers x top-8).  Needs python3 with NumPy only (the multi-rank NCCL case at the end:
# Paddle with CUDA and >= 2 GPUs).  Extra arguments go to device_check.py (e.g. --quick,
# --seed N).  Environment: NVCC, PYTHON, FDRR_DEVICE_OUT (build folder).
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

# Multi-rank case over NCCL, on a machine with >= 2 GPUs and Paddle built with CUDA (skipped
# otherwise, or with FDRR_NCCL_CHECK=0): two ranks (paddle.distributed.launch) each feed
# their own share of a TP x EP step -- ceil(n / 2) rows, the last share zero-padded, as
# FastDeploy splits tokens -- to our 2.6 hook with the real NCCL tp_group; the hook
# all-gathers, drops the padding rows (total_token_num) and records into a GPU step
# buffer, which must equal the numpy reference on both ranks.  The CPU/gloo version of
# this case runs in the contract tier (tests/fastdeploy_contract/test_parallel.py).
ngpu="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
if [ "${FDRR_NCCL_CHECK:-1}" = "0" ]; then
  echo "device_check: multi-rank NCCL case skipped (FDRR_NCCL_CHECK=0)"
elif [ "${ngpu:-0}" -lt 2 ]; then
  echo "device_check: multi-rank NCCL case skipped (${ngpu:-0} GPU(s); it needs 2)"
elif ! "$PY" -c "import sys, paddle; sys.exit(0 if paddle.is_compiled_with_cuda() else 1)" 2>/dev/null; then
  echo "device_check: multi-rank NCCL case skipped (no Paddle with CUDA for $PY)"
else
  nccl_script="$out/nccl_rank_check.py"
  cat > "$nccl_script" <<'PYEOF'
import numpy as np
import paddle
import paddle.distributed as dist

from fd_routing_replay.capture.device import save_routing_to_buffer_v2
from fd_routing_replay.capture.fd26 import StepRoutingCapturer

dist.init_parallel_env()
rank, world = dist.get_rank(), dist.get_world_size()
group = dist.new_group(list(range(world)))
L, K, E = 4, 8, 300
rng = np.random.default_rng(7)                   # the same draws on every rank
failures = 0
for n in (1, 3, 8, 513, 4096):
    full = rng.integers(0, E, (L, n, K))
    per_rank = -(-n // world)
    lo, hi = min(rank * per_rank, n), min((rank + 1) * per_rank, n)
    capturer = StepRoutingCapturer(max_batched_tokens=8192, num_moe_layers=L, top_k=K,
                                   num_experts=E, tp_rank=rank)
    for layer in range(L):
        share = np.full((per_rank, K), E - 1, dtype=np.int64)   # padding rows: dropped
        share[: hi - lo] = full[layer, lo:hi]
        save_routing_to_buffer_v2(device_routing_buffer=capturer.get_device_routing_buffer(),
                                  topk_ids=paddle.to_tensor(share), layer_idx=layer, tp_size=world,
                                  ep_size=world, tp_group=group, total_token_num=n)
    got = np.asarray(capturer.get_device_routing_buffer().numpy()).view(np.uint16)[:n]
    ok = np.array_equal(got.transpose(1, 0, 2), full) and capturer.binding.errors == 0
    failures += not ok
    print(f"rank {rank}: TP x EP {world} ranks, {n} tokens: {'ok' if ok else 'MISMATCH'}", flush=True)
    capturer.close()
raise SystemExit(1 if failures else 0)
PYEOF
  echo "device_check: multi-rank NCCL case (2 ranks, TP x EP all-gather through our hook)"
  if ! timeout 240 "$PY" -m paddle.distributed.launch --devices 0,1 --max_restart 0 \
      --log_dir "$out/nccl_log" "$nccl_script"; then
    tail -n 40 "$out"/nccl_log/workerlog.* >&2 || true
    echo "device_check: multi-rank NCCL case FAILED" >&2
    exit 1
  fi
  grep -h "TP x EP" "$out"/nccl_log/workerlog.* || true
fi
echo "device_check.sh finished in $(( $(date +%s) - started )) s"
