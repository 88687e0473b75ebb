// Framework-free CUDA kernels of fd-routing-replay's custom ops.
//
// Same semantics as the CPU loops in routing_kernels.h (read that file first); no Paddle
// header here.  routing_ops.cu wraps the launchers below in Paddle ops (GPU builds only)
// and cuda_harness.cu exposes them through a C ABI for scripts/device_check.py.
//
// Status: compile-checked with nvcc for sm_80 and sm_90 (scripts/cuda_compile_check.sh);
// not yet run on a GPU — scripts/device_check.sh is the check to run when one is lent.
//
// Index checks ("clear error before any write"): the host cannot see device indices
// without a synchronisation, so a launcher first runs find_bad_index_kernel, which
// records the first out-of-range position in a device word (kNoBadIndex = all good),
// and the copy kernels return at once when any such word is set.  The caller copies the
// word(s) back after the launch and raises.  record_routing needs no check: it skips
// out-of-range tokens and counts bad expert ids, by contract.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "routing_kernels.h"  // RecordArgs, record_seq_bound (plain C++, no framework)

namespace fdrr {
namespace cuda {

constexpr unsigned long long kNoBadIndex = ~0ull;
constexpr int kThreads = 256;

inline unsigned int grid_for(int64_t total) {
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  const int64_t cap = int64_t{1} << 20;  // grid-stride loops cover the rest
  return static_cast<unsigned int>(blocks < cap ? blocks : cap);
}

__device__ __forceinline__ bool any_bad(const unsigned long long* bad, int num_bad) {
  for (int i = 0; i < num_bad; ++i) {
    if (bad[i] != kNoBadIndex) return true;
  }
  return false;
}

// ---------------------------------------------------------------------------------------
// record_routing: one thread per (token, k) element of topk_ids.
template <typename TableT, typename IdT, typename IdxT>
__global__ void record_routing_kernel(TableT* __restrict__ table, const IdT* __restrict__ topk_ids,
                                      const IdxT* __restrict__ batch_id_per_token,
                                      const IdxT* __restrict__ cu_seqlens_q,
                                      const IdxT* __restrict__ seq_lens_decoder, RecordArgs a,
                                      int64_t seq_bound, unsigned long long* error_count) {
  const TableT fill = static_cast<TableT>(~TableT{0});  // dtype max, all bits set
  const int64_t total = a.num_tokens * a.top_k;
  const int64_t token_stride = a.num_layers * a.top_k;
  const int64_t seq_stride = a.max_len * token_stride;
  const uint64_t num_experts = static_cast<uint64_t>(a.num_experts);
  unsigned long long errors = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / a.top_k;
    const int64_t k = i - t * a.top_k;
    const int64_t b = static_cast<int64_t>(batch_id_per_token[t]);
    if (b < 0 || b >= seq_bound) continue;
    const int64_t pos = static_cast<int64_t>(seq_lens_decoder[b]) + t -
                        static_cast<int64_t>(cu_seqlens_q[b]);
    if (pos < 0 || pos >= a.max_len) continue;
    const uint64_t v = static_cast<uint64_t>(static_cast<int64_t>(topk_ids[i]));
    const bool ok = v < num_experts;
    table[b * seq_stride + pos * token_stride + a.layer * a.top_k + k] =
        ok ? static_cast<TableT>(v) : fill;
    errors += ok ? 0 : 1;
  }
  if (errors != 0) atomicAdd(error_count, errors);
}

template <typename TableT, typename IdT, typename IdxT>
cudaError_t launch_record_routing(TableT* table, const IdT* topk_ids,
                                  const IdxT* batch_id_per_token, const IdxT* cu_seqlens_q,
                                  const IdxT* seq_lens_decoder, const RecordArgs& a,
                                  unsigned long long* error_count, cudaStream_t stream) {
  const int64_t total = a.num_tokens * a.top_k;
  if (total <= 0) return cudaSuccess;
  record_routing_kernel<TableT, IdT, IdxT><<<grid_for(total), kThreads, 0, stream>>>(
      table, topk_ids, batch_id_per_token, cu_seqlens_q, seq_lens_decoder, a,
      record_seq_bound(a), error_count);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------
// Index check: *first_bad = smallest i with index[i] outside [0, bound) (else unchanged).
template <typename IdxT>
__global__ void find_bad_index_kernel(const IdxT* __restrict__ index, int64_t n, int64_t bound,
                                      unsigned long long* first_bad) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t v = static_cast<int64_t>(index[i]);
    if (v < 0 || v >= bound) atomicMin(first_bad, static_cast<unsigned long long>(i));
  }
}

// Resets *first_bad to kNoBadIndex, then checks index[0:n] against [0, bound).
template <typename IdxT>
cudaError_t launch_find_bad_index(const IdxT* index, int64_t n, int64_t bound,
                                  unsigned long long* first_bad, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(first_bad, 0xFF, sizeof(unsigned long long), stream);
  if (err != cudaSuccess || n <= 0) return err;
  find_bad_index_kernel<IdxT><<<grid_for(n), kThreads, 0, stream>>>(index, n, bound, first_bad);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------
// Copy kernels work on "units" (1-16 bytes) so a row of top_k ids moves in as few
// transactions as its size and alignment allow; the routing dtype does not matter.

// pack_routing: out[l, t, u] = source[slots[t], l, u] (u = unit within a row).
template <typename Unit, typename IdxT>
__global__ void pack_routing_kernel(const Unit* __restrict__ source, int64_t num_layers,
                                    int64_t units_per_row, const IdxT* __restrict__ slots,
                                    int64_t num_tokens, Unit* __restrict__ out,
                                    const unsigned long long* bad, int num_bad) {
  if (any_bad(bad, num_bad)) return;
  const int64_t total = num_layers * num_tokens * units_per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / units_per_row;
    const int64_t u = i - row * units_per_row;
    const int64_t l = row / num_tokens;
    const int64_t t = row - l * num_tokens;
    const int64_t slot = static_cast<int64_t>(slots[t]);
    out[i] = source[(slot * num_layers + l) * units_per_row + u];
  }
}

// gather_routing_rows: out[i, u] = table[batch_ids[i], positions[i], u] (row = L*K ids).
template <typename Unit, typename IdxT>
__global__ void gather_routing_rows_kernel(const Unit* __restrict__ table, int64_t max_len,
                                           int64_t units_per_row,
                                           const IdxT* __restrict__ batch_ids,
                                           const IdxT* __restrict__ positions, int64_t n,
                                           Unit* __restrict__ out, const unsigned long long* bad,
                                           int num_bad) {
  if (any_bad(bad, num_bad)) return;
  const int64_t total = n * units_per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / units_per_row;
    const int64_t u = i - r * units_per_row;
    const int64_t src_row =
        static_cast<int64_t>(batch_ids[r]) * max_len + static_cast<int64_t>(positions[r]);
    out[i] = table[src_row * units_per_row + u];
  }
}

// clear_routing_rows: every unit of table[batch_ids[i]] = all 0xFF bytes (the fill).
template <typename Unit, typename IdxT>
__global__ void clear_routing_rows_kernel(Unit* __restrict__ table, int64_t units_per_seq,
                                          const IdxT* __restrict__ batch_ids, int64_t n,
                                          const unsigned long long* bad, int num_bad) {
  if (any_bad(bad, num_bad)) return;
  Unit ones;
  unsigned char* bytes = reinterpret_cast<unsigned char*>(&ones);
#pragma unroll
  for (int j = 0; j < static_cast<int>(sizeof(Unit)); ++j) bytes[j] = 0xFF;
  const int64_t total = n * units_per_seq;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / units_per_seq;
    const int64_t u = i - r * units_per_seq;
    table[static_cast<int64_t>(batch_ids[r]) * units_per_seq + u] = ones;
  }
}

// Calls f(Unit{}) with the widest unit (16, 8, 4, 2 or 1 bytes) that divides row_bytes
// and the alignment of both pointers.
template <typename F>
cudaError_t with_unit(int64_t row_bytes, const void* a, const void* b, F&& f) {
  const uintptr_t align = reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) |
                          static_cast<uintptr_t>(row_bytes);
  if (align % 16 == 0) return f(uint4{});
  if (align % 8 == 0) return f(uint2{});
  if (align % 4 == 0) return f(0u);
  if (align % 2 == 0) return f(static_cast<unsigned short>(0));
  return f(static_cast<unsigned char>(0));
}

// bad/num_bad: device words written by launch_find_bad_index (may be nullptr/0).
template <typename IdxT>
cudaError_t launch_pack_routing(const void* source, int64_t num_layers, int64_t top_k,
                                int64_t elem_bytes, const IdxT* slots, int64_t num_tokens,
                                void* out, const unsigned long long* bad, int num_bad,
                                cudaStream_t stream) {
  const int64_t row_bytes = top_k * elem_bytes;
  const int64_t total_bytes = num_layers * num_tokens * row_bytes;
  if (total_bytes <= 0) return cudaSuccess;
  return with_unit(row_bytes, source, out, [&](auto unit) {
    using Unit = decltype(unit);
    const int64_t upr = row_bytes / static_cast<int64_t>(sizeof(Unit));
    pack_routing_kernel<Unit, IdxT>
        <<<grid_for(total_bytes / static_cast<int64_t>(sizeof(Unit))), kThreads, 0, stream>>>(
            static_cast<const Unit*>(source), num_layers, upr, slots, num_tokens,
            static_cast<Unit*>(out), bad, num_bad);
    return cudaGetLastError();
  });
}

template <typename IdxT>
cudaError_t launch_gather_routing_rows(const void* table, int64_t max_len, int64_t row_bytes,
                                       const IdxT* batch_ids, const IdxT* positions, int64_t n,
                                       void* out, const unsigned long long* bad, int num_bad,
                                       cudaStream_t stream) {
  if (n <= 0 || row_bytes <= 0) return cudaSuccess;
  return with_unit(row_bytes, table, out, [&](auto unit) {
    using Unit = decltype(unit);
    const int64_t upr = row_bytes / static_cast<int64_t>(sizeof(Unit));
    gather_routing_rows_kernel<Unit, IdxT><<<grid_for(n * upr), kThreads, 0, stream>>>(
        static_cast<const Unit*>(table), max_len, upr, batch_ids, positions, n,
        static_cast<Unit*>(out), bad, num_bad);
    return cudaGetLastError();
  });
}

template <typename IdxT>
cudaError_t launch_clear_routing_rows(void* table, int64_t seq_bytes, const IdxT* batch_ids,
                                      int64_t n, const unsigned long long* bad, int num_bad,
                                      cudaStream_t stream) {
  if (n <= 0 || seq_bytes <= 0) return cudaSuccess;
  return with_unit(seq_bytes, table, table, [&](auto unit) {
    using Unit = decltype(unit);
    const int64_t ups = seq_bytes / static_cast<int64_t>(sizeof(Unit));
    clear_routing_rows_kernel<Unit, IdxT><<<grid_for(n * ups), kThreads, 0, stream>>>(
        static_cast<Unit*>(table), ups, batch_ids, n, bad, num_bad);
    return cudaGetLastError();
  });
}

}  // namespace cuda
}  // namespace fdrr
