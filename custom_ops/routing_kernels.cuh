// Framework-free CUDA kernels of fd-routing-replay's custom ops.
//
// Same semantics as the CPU loops in routing_kernels.h (read that file first); no Paddle
// header here.  routing_ops.cu wraps the launchers below in Paddle ops (GPU builds only)
// and cuda_harness.cu exposes them through a C ABI for scripts/device_check.py.
//
// Status: compile-checked with nvcc for sm_80 and sm_90 (scripts/cuda_compile_check.sh);
// not yet run on a GPU — scripts/device_check.sh is the check to run when one is lent.
//
// Index checks: the Paddle ops never check device indices on the device (no check kernel,
// no blocking copy): host indices are range-checked on the host before upload, and every
// copy kernel bounds-checks each index it reads and skips (gather, clear) or fills (pack)
// an out-of-range one, so a bad device index can never write out of bounds.  The optional
// `bad` words (find_bad_index_kernel) remain for callers that want a refusal before any
// write and can afford the synchronisation (cuda_harness.cu, scripts/device_check.py).
//
// Errors (bad expert ids) are summed per warp with a shuffle reduction and added with one
// atomic per warp, not per thread.
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

// Sum of `v` over the warp, in lane 0 (every lane of a full warp must call it).
__device__ __forceinline__ unsigned long long warp_sum(unsigned long long v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xFFFFFFFFu, v, offset);
  return v;
}

// Adds this thread's error count to *error_count with one atomic per warp.  kThreads is a
// multiple of 32 and every thread reaches this point, so the warps are full.
__device__ __forceinline__ void add_errors(unsigned long long errors,
                                           unsigned long long* error_count) {
  errors = warp_sum(errors);
  if ((threadIdx.x & 31) == 0 && errors != 0) atomicAdd(error_count, errors);
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
    // Padding, a stale batch id outside its sequence's span, a position past the table.
    const int64_t pos = record_position(t, b, cu_seqlens_q, seq_lens_decoder, seq_bound, a.max_len);
    if (pos < 0) continue;
    const uint64_t v = static_cast<uint64_t>(static_cast<int64_t>(topk_ids[i]));
    const bool ok = v < num_experts;
    table[b * seq_stride + pos * token_stride + a.layer * a.top_k + k] =
        ok ? static_cast<TableT>(v) : fill;
    errors += ok ? 0 : 1;
  }
  add_errors(errors, error_count);
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
// record_rows: the token-major step buffer.  buffer[t, layer, k] = topk_ids[t, k] for every
// token t of the step; one thread per (t, k); counters[0] += bad ids (one atomic per warp),
// counters[1 + layer] += 1 (thread 0 of block 0: one increment per call, so the count stays
// right when a CUDA graph replays the launch).
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
  add_errors(errors, counters);
  if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(counters + 1 + a.layer, 1ull);
}

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
//
// A transpose, done through shared memory so both sides are coalesced: a block takes a
// tile of kPackTokens tokens x `width` columns of a source row (a column = one unit of one
// layer; width = a whole number of layers), reads it row by row (consecutive threads read
// consecutive units of one token's row) and writes it layer by layer (consecutive threads
// write consecutive tokens' units of one layer).  A slot outside [0, num_slots) packs as
// the fill (all 0xFF bytes); nothing is read or written out of bounds.
constexpr int kPackTokens = 32;
constexpr int kPackColumns = 32;  // most units per tile row

template <typename Unit>
__device__ __forceinline__ Unit all_ones() {
  Unit ones;
  unsigned char* bytes = reinterpret_cast<unsigned char*>(&ones);
#pragma unroll
  for (int j = 0; j < static_cast<int>(sizeof(Unit)); ++j) bytes[j] = 0xFF;
  return ones;
}

template <typename Unit, typename IdxT>
__global__ void pack_routing_tiled_kernel(const Unit* __restrict__ source, int64_t num_slots,
                                          int64_t num_layers, int64_t units_per_row,
                                          const IdxT* __restrict__ slots, int64_t num_tokens,
                                          Unit* __restrict__ out, const unsigned long long* bad,
                                          int num_bad) {
  __shared__ Unit tile[kPackTokens][kPackColumns + 1];
  __shared__ int64_t tile_slot[kPackTokens];
  if (bad != nullptr && any_bad(bad, num_bad)) return;
  const int64_t layers_per_tile = kPackColumns / units_per_row;
  const int64_t width = layers_per_tile * units_per_row;       // columns in this tile
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kPackTokens;
  const int64_t l0 = static_cast<int64_t>(blockIdx.y) * layers_per_tile;
  const int64_t layers = num_layers - l0 < layers_per_tile ? num_layers - l0 : layers_per_tile;
  const int64_t cols = layers * units_per_row;
  const int64_t tokens = num_tokens - t0 < kPackTokens ? num_tokens - t0 : kPackTokens;
  const int tid = threadIdx.x;
  if (tid < tokens) {
    const int64_t slot = static_cast<int64_t>(slots[t0 + tid]);
    tile_slot[tid] = (slot < 0 || slot >= num_slots) ? -1 : slot;
  }
  __syncthreads();
  const int64_t row_units = num_layers * units_per_row;
  for (int64_t j = tid; j < tokens * width; j += blockDim.x) {   // read: token-major
    const int64_t ti = j / width;
    const int64_t c = j - ti * width;
    if (c >= cols) continue;
    const int64_t slot = tile_slot[ti];
    tile[ti][c] = slot < 0 ? all_ones<Unit>() : source[slot * row_units + l0 * units_per_row + c];
  }
  __syncthreads();
  for (int64_t j = tid; j < layers * tokens * units_per_row; j += blockDim.x) {  // write
    const int64_t u = j % units_per_row;
    const int64_t rest = j / units_per_row;
    const int64_t ti = rest % tokens;
    const int64_t lt = rest / tokens;
    out[((l0 + lt) * num_tokens + t0 + ti) * units_per_row + u] = tile[ti][lt * units_per_row + u];
  }
}

// Rows wider than a tile (more than kPackColumns units): one thread per output unit.
template <typename Unit, typename IdxT>
__global__ void pack_routing_kernel(const Unit* __restrict__ source, int64_t num_slots,
                                    int64_t num_layers, int64_t units_per_row,
                                    const IdxT* __restrict__ slots, int64_t num_tokens,
                                    Unit* __restrict__ out, const unsigned long long* bad,
                                    int num_bad) {
  if (bad != nullptr && any_bad(bad, num_bad)) return;
  const int64_t total = num_layers * num_tokens * units_per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / units_per_row;
    const int64_t u = i - row * units_per_row;
    const int64_t l = row / num_tokens;
    const int64_t t = row - l * num_tokens;
    const int64_t slot = static_cast<int64_t>(slots[t]);
    out[i] = (slot < 0 || slot >= num_slots) ? all_ones<Unit>()
                                             : source[(slot * num_layers + l) * units_per_row + u];
  }
}

// gather_routing_rows: out[i, u] = table[batch_ids[i], positions[i], u] (row = L*K ids).
template <typename Unit, typename IdxT>
__global__ void gather_routing_rows_kernel(const Unit* __restrict__ table, int64_t max_len,
                                           int64_t units_per_row,
                                           const IdxT* __restrict__ batch_ids,
                                           const IdxT* __restrict__ positions, int64_t n,
                                           int64_t max_num_seqs, Unit* __restrict__ out,
                                           const unsigned long long* bad, int num_bad) {
  if (bad != nullptr && any_bad(bad, num_bad)) return;
  const int64_t total = n * units_per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / units_per_row;
    const int64_t u = i - r * units_per_row;
    const int64_t b = static_cast<int64_t>(batch_ids[r]);
    const int64_t p = static_cast<int64_t>(positions[r]);
    if (b < 0 || b >= max_num_seqs || p < 0 || p >= max_len) continue;  // left as allocated
    out[i] = table[(b * max_len + p) * units_per_row + u];
  }
}

// clear_routing_rows: every unit of table[batch_ids[i]] = all 0xFF bytes (the fill).
template <typename Unit, typename IdxT>
__global__ void clear_routing_rows_kernel(Unit* __restrict__ table, int64_t units_per_seq,
                                          int64_t max_num_seqs,
                                          const IdxT* __restrict__ batch_ids, int64_t n,
                                          const unsigned long long* bad, int num_bad) {
  if (bad != nullptr && any_bad(bad, num_bad)) return;
  const Unit ones = all_ones<Unit>();
  const int64_t total = n * units_per_seq;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / units_per_seq;
    const int64_t u = i - r * units_per_seq;
    const int64_t b = static_cast<int64_t>(batch_ids[r]);
    if (b < 0 || b >= max_num_seqs) continue;
    table[b * units_per_seq + u] = ones;
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

// bad/num_bad: optional device words written by launch_find_bad_index (nullptr/0: none;
// the Paddle ops pass none).
template <typename IdxT>
cudaError_t launch_pack_routing(const void* source, int64_t num_slots, int64_t num_layers,
                                int64_t top_k, int64_t elem_bytes, const IdxT* slots,
                                int64_t num_tokens, void* out, cudaStream_t stream,
                                const unsigned long long* bad = nullptr, int num_bad = 0) {
  const int64_t row_bytes = top_k * elem_bytes;
  const int64_t total_bytes = num_layers * num_tokens * row_bytes;
  if (total_bytes <= 0) return cudaSuccess;
  return with_unit(row_bytes, source, out, [&](auto unit) {
    using Unit = decltype(unit);
    const int64_t upr = row_bytes / static_cast<int64_t>(sizeof(Unit));
    if (upr <= kPackColumns) {
      const int64_t layers_per_tile = kPackColumns / upr;
      const dim3 grid(static_cast<unsigned int>((num_tokens + kPackTokens - 1) / kPackTokens),
                      static_cast<unsigned int>((num_layers + layers_per_tile - 1) / layers_per_tile));
      pack_routing_tiled_kernel<Unit, IdxT><<<grid, kThreads, 0, stream>>>(
          static_cast<const Unit*>(source), num_slots, num_layers, upr, slots, num_tokens,
          static_cast<Unit*>(out), bad, num_bad);
    } else {
      pack_routing_kernel<Unit, IdxT>
          <<<grid_for(total_bytes / static_cast<int64_t>(sizeof(Unit))), kThreads, 0, stream>>>(
              static_cast<const Unit*>(source), num_slots, num_layers, upr, slots, num_tokens,
              static_cast<Unit*>(out), bad, num_bad);
    }
    return cudaGetLastError();
  });
}

template <typename IdxT>
cudaError_t launch_gather_routing_rows(const void* table, int64_t max_num_seqs, int64_t max_len,
                                       int64_t row_bytes, const IdxT* batch_ids,
                                       const IdxT* positions, int64_t n, void* out,
                                       cudaStream_t stream, const unsigned long long* bad = nullptr,
                                       int num_bad = 0) {
  if (n <= 0 || row_bytes <= 0) return cudaSuccess;
  return with_unit(row_bytes, table, out, [&](auto unit) {
    using Unit = decltype(unit);
    const int64_t upr = row_bytes / static_cast<int64_t>(sizeof(Unit));
    gather_routing_rows_kernel<Unit, IdxT><<<grid_for(n * upr), kThreads, 0, stream>>>(
        static_cast<const Unit*>(table), max_len, upr, batch_ids, positions, n, max_num_seqs,
        static_cast<Unit*>(out), bad, num_bad);
    return cudaGetLastError();
  });
}

template <typename IdxT>
cudaError_t launch_clear_routing_rows(void* table, int64_t max_num_seqs, int64_t seq_bytes,
                                      const IdxT* batch_ids, int64_t n, cudaStream_t stream,
                                      const unsigned long long* bad = nullptr, int num_bad = 0) {
  if (n <= 0 || seq_bytes <= 0) return cudaSuccess;
  return with_unit(seq_bytes, table, table, [&](auto unit) {
    using Unit = decltype(unit);
    const int64_t ups = seq_bytes / static_cast<int64_t>(sizeof(Unit));
    clear_routing_rows_kernel<Unit, IdxT><<<grid_for(n * ups), kThreads, 0, stream>>>(
        static_cast<Unit*>(table), ups, max_num_seqs, batch_ids, n, bad, num_bad);
    return cudaGetLastError();
  });
}

}  // namespace cuda
}  // namespace fdrr
