// Framework-free CUDA side of the step buffer: the per-layer record kernel and the step's
// offload to host memory.
//
// Same semantics as the CPU loop in routing_kernels.h (read that file first); no Paddle
// header here.  step_ops.cu calls these from the library's StepRecorder (GPU builds only);
// cuda_harness.cu exposes the same functions through a C ABI for scripts/device_check.py.
//
// Status: compile-checked with nvcc for sm_80 and sm_90 (scripts/cuda_compile_check.sh);
// not yet run on a GPU -- scripts/device_check.sh is the check to run when one is lent.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "routing_kernels.h"  // RowsArgs (plain C++, no framework)

namespace fdrr {
namespace cuda {

constexpr int kThreads = 256;

inline unsigned int grid_for(int64_t total) {
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  const int64_t cap = int64_t{1} << 20;  // grid-stride loops cover the rest
  return static_cast<unsigned int>(blocks < cap ? blocks : cap);
}

// Sum of `v` over the warp, in lane 0 (every lane of a full warp must call it).
__device__ __forceinline__ unsigned long long warp_sum(unsigned long long v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xFFFFFFFFu, v, offset);
  return v;
}

// buffer[t, layer, k] = topk_ids[t, k] for every token t of the step; one thread per (t, k).
// counters[0] += bad ids, summed per warp with a shuffle and added with one atomic per warp
// (kThreads is a multiple of 32 and every thread reaches the sum, so the warps are full);
// counters[1 + layer] += 1 by thread 0 of block 0: one increment per launch, so the count
// stays right when a CUDA graph replays the launch.
template <typename BufT, typename IdT>
__global__ void record_rows_kernel(BufT* __restrict__ buffer, const IdT* __restrict__ topk_ids,
                                   RowsArgs a, unsigned long long* counters) {
  const BufT fill = static_cast<BufT>(~BufT{0});
  const int64_t total = a.num_tokens * a.top_k;
  const int64_t token_stride = a.num_layers * a.top_k;
  const uint64_t num_experts = static_cast<uint64_t>(a.num_experts);
  unsigned long long errors = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / a.top_k;
    const int64_t k = i - t * a.top_k;
    const uint64_t v = static_cast<uint64_t>(static_cast<int64_t>(topk_ids[i]));
    const bool ok = v < num_experts;
    buffer[t * token_stride + a.layer * a.top_k + k] = ok ? static_cast<BufT>(v) : fill;
    errors += ok ? 0 : 1;
  }
  errors = warp_sum(errors);
  if ((threadIdx.x & 31) == 0 && errors != 0) atomicAdd(counters, errors);
  if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(counters + 1 + a.layer, 1ull);
}

// One MoE layer's record, on `stream`.  Nothing is launched for an empty step (no call is
// counted either), as on CPU.
template <typename BufT, typename IdT>
cudaError_t launch_record_rows(BufT* buffer, const IdT* topk_ids, const RowsArgs& a,
                               unsigned long long* counters, cudaStream_t stream) {
  const int64_t total = a.num_tokens * a.top_k;
  if (total <= 0) return cudaSuccess;
  record_rows_kernel<BufT, IdT><<<grid_for(total), kThreads, 0, stream>>>(buffer, topk_ids, a,
                                                                         counters);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------
// The step's offload: rows [0, num_tokens) and the counters (and optionally the first bytes
// of one more device tensor, FastDeploy 2.6's slot mapping) copied into host staging on
// `stream`, then `event` recorded; asynchronous when the staging is page-locked
// (pin_host).  Nothing here synchronises: wait_event is the one blocking call.  (Offload,
// the copy's description, is in routing_kernels.h: step_ops.cc fills it with the host
// compiler.)

inline cudaError_t launch_offload(const fdrr::Offload& o, cudaEvent_t event, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  if (o.num_tokens > 0) {
    err = cudaMemcpyAsync(o.host_rows, o.rows, static_cast<size_t>(o.num_tokens * o.row_bytes),
                          cudaMemcpyDeviceToHost, stream);
    if (err != cudaSuccess) return err;
  }
  err = cudaMemcpyAsync(o.host_counters, o.counters, static_cast<size_t>(o.counter_bytes),
                        cudaMemcpyDeviceToHost, stream);
  if (err != cudaSuccess) return err;
  if (o.extra != nullptr && o.extra_bytes > 0) {
    err = cudaMemcpyAsync(o.host_extra, o.extra, static_cast<size_t>(o.extra_bytes),
                          cudaMemcpyDeviceToHost, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaEventRecord(event, stream);
}

// Blocks until the copies before the event's last record have landed.
inline cudaError_t wait_event(cudaEvent_t event) { return cudaEventSynchronize(event); }

inline cudaError_t create_event(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, cudaEventDisableTiming);
}

// Page-locks caller-owned host memory (numpy staging) so copies into it are asynchronous;
// false (copies stay correct, only synchronous) when the driver refuses.
inline bool pin_host(void* ptr, int64_t bytes) {
  if (ptr == nullptr || bytes <= 0) return false;
  if (cudaHostRegister(ptr, static_cast<size_t>(bytes), cudaHostRegisterDefault) != cudaSuccess) {
    cudaGetLastError();  // clear the error so the next call does not report it
    return false;
  }
  return true;
}

// Every byte of the buffer back to 0xFF, the fill of every routing dtype (RL round cleanup).
inline cudaError_t launch_fill(void* buffer, int64_t bytes, cudaStream_t stream) {
  return cudaMemsetAsync(buffer, 0xFF, static_cast<size_t>(bytes), stream);
}

}  // namespace cuda
}  // namespace fdrr
