// Framework-free CPU kernel of the step buffer's per-layer record (and the plain description
// of a step's offload the CUDA side takes).
//
// No Paddle (or any framework) header here: step_ops.cc calls this loop for a CPU step
// buffer, and routing_kernels.cuh implements the same semantics for CUDA.  Every index
// computation is 64-bit (FastDeploy once overflowed a 32-bit stride).
//
// Step buffer layout (row-major, C-contiguous):
//   buffer[capacity][num_layers][top_k], element type uint8/uint16/uint32.
// Token t of the step is row t.  The fill value ("no routing") is the dtype's maximum,
// i.e. every byte 0xFF.
#pragma once

#include <cstdint>
#include <limits>

namespace fdrr {

// Shapes and scalars of one record call (token-major step buffer).
struct RowsArgs {
  int64_t capacity;      // buffer dim 0 (max_batched_tokens)
  int64_t num_layers;    // buffer dim 1
  int64_t top_k;         // buffer dim 2 (== topk_ids dim 1)
  int64_t num_tokens;    // topk_ids dim 0, at most capacity (checked by the caller)
  int64_t layer;         // buffer row of this MoE layer, 0 <= layer < num_layers
  int64_t num_experts;   // valid ids are [0, num_experts); at most the fill value
};

namespace detail {

// With a compile-time top_k (KS > 0) the per-token id loop unrolls and vectorises; KS == 0
// reads top_k at run time.
template <int KS, typename BufT, typename IdT>
int64_t record_rows(BufT* buffer, const IdT* topk_ids, const RowsArgs& a) {
  const BufT fill = std::numeric_limits<BufT>::max();
  const uint64_t num_experts = static_cast<uint64_t>(a.num_experts);
  const int64_t k_count = KS > 0 ? KS : a.top_k;
  const int64_t token_stride = a.num_layers * k_count;
  BufT* dst = buffer + a.layer * k_count;
  int64_t errors = 0;
  for (int64_t t = 0; t < a.num_tokens; ++t, dst += token_stride) {
    const IdT* src = topk_ids + t * k_count;
    for (int64_t k = 0; k < k_count; ++k) {
      // A negative id becomes a huge unsigned value, so one comparison covers both ends.
      const uint64_t v = static_cast<uint64_t>(static_cast<int64_t>(src[k]));
      const bool ok = v < num_experts;
      dst[k] = ok ? static_cast<BufT>(v) : fill;
      errors += ok ? 0 : 1;
    }
  }
  return errors;
}

}  // namespace detail

// The step buffer's row t, layer `layer`, receives topk_ids[t, :] for every token
// t < num_tokens (token t of the step is row t: no index arrays, no lookups).  Ids outside
// [0, num_experts) are written as the fill value; returns their count.
template <typename BufT, typename IdT>
int64_t record_rows_cpu(BufT* buffer, const IdT* topk_ids, const RowsArgs& a) {
  switch (a.top_k) {
    case 2: return detail::record_rows<2>(buffer, topk_ids, a);
    case 4: return detail::record_rows<4>(buffer, topk_ids, a);
    case 6: return detail::record_rows<6>(buffer, topk_ids, a);
    case 8: return detail::record_rows<8>(buffer, topk_ids, a);
    default: return detail::record_rows<0>(buffer, topk_ids, a);
  }
}

// The step's offload to host staging, as the CUDA side takes it (routing_kernels.cuh's
// launch_offload): plain data, so the host compiler fills it in step_ops.cc.
struct Offload {
  const void* rows;          // the step buffer (device)
  int64_t row_bytes;         // num_layers * top_k * itemsize
  int64_t num_tokens;        // rows to copy, at most the buffer's capacity
  const void* counters;      // int64 [1 + num_layers] (device)
  int64_t counter_bytes;
  const void* extra;         // optional device tensor (nullptr: none)
  int64_t extra_bytes;
  void* host_rows;
  void* host_counters;
  void* host_extra;
};

}  // namespace fdrr
