// C-ABI harness around routing_kernels.cuh — no Paddle, no framework.
//
// scripts/cuda_compile_check.sh compiles it (object only) for sm_80 and sm_90 so CI
// proves the kernels build; scripts/device_check.sh builds it as a shared library and
// drives it from Python (ctypes + torch or cupy) on a GPU machine.  Every function
// returns 0 on success, a cudaError_t value on a CUDA failure, or -1 for an unsupported
// dtype size.  Device pointers come from the caller; `stream` may be null (legacy stream).
//
// Dtype codes are element sizes in bytes: table 1/2/4 (uint8/uint16/uint32), ids 4/8
// (int32/int64), indices 4/8 (int32/int64).
#include <cuda_runtime.h>

#include <cstdint>

#include "routing_kernels.cuh"

namespace {

using fdrr::RecordArgs;

// The harness ABI carries no table / cache bounds (the caller checks its indices with
// fdrr_h_find_bad_index and passes the words): the kernels' own bounds stay open.
constexpr int64_t kNoBound = INT64_MAX;

template <typename BufT>
int record_rows_by_ids(void* buffer, const void* ids, int id_bytes, const fdrr::RowsArgs& a,
                       unsigned long long* counters, cudaStream_t stream) {
  if (id_bytes == 4) {
    return static_cast<int>(fdrr::cuda::launch_record_rows<BufT, int32_t>(
        static_cast<BufT*>(buffer), static_cast<const int32_t*>(ids), a, counters, stream));
  }
  if (id_bytes == 8) {
    return static_cast<int>(fdrr::cuda::launch_record_rows<BufT, int64_t>(
        static_cast<BufT*>(buffer), static_cast<const int64_t*>(ids), a, counters, stream));
  }
  return -1;
}

template <typename TableT, typename IdT>
int record_by_idx(void* table, const void* ids, const void* batch, const void* cu, const void* dec,
                  int idx_bytes, const RecordArgs& a, unsigned long long* errors,
                  cudaStream_t stream) {
  if (idx_bytes == 4) {
    return static_cast<int>(fdrr::cuda::launch_record_routing<TableT, IdT, int32_t>(
        static_cast<TableT*>(table), static_cast<const IdT*>(ids),
        static_cast<const int32_t*>(batch), static_cast<const int32_t*>(cu),
        static_cast<const int32_t*>(dec), a, errors, stream));
  }
  if (idx_bytes == 8) {
    return static_cast<int>(fdrr::cuda::launch_record_routing<TableT, IdT, int64_t>(
        static_cast<TableT*>(table), static_cast<const IdT*>(ids),
        static_cast<const int64_t*>(batch), static_cast<const int64_t*>(cu),
        static_cast<const int64_t*>(dec), a, errors, stream));
  }
  return -1;
}

template <typename TableT>
int record_by_ids(void* table, const void* ids, int id_bytes, const void* batch, const void* cu,
                  const void* dec, int idx_bytes, const RecordArgs& a,
                  unsigned long long* errors, cudaStream_t stream) {
  if (id_bytes == 4) {
    return record_by_idx<TableT, int32_t>(table, ids, batch, cu, dec, idx_bytes, a, errors,
                                          stream);
  }
  if (id_bytes == 8) {
    return record_by_idx<TableT, int64_t>(table, ids, batch, cu, dec, idx_bytes, a, errors,
                                          stream);
  }
  return -1;
}

}  // namespace

extern "C" {

int fdrr_h_record_routing(void* table, int table_bytes, int64_t max_num_seqs, int64_t max_len,
                          int64_t num_layers, int64_t top_k, const void* topk_ids, int id_bytes,
                          int64_t num_tokens, const void* batch_id_per_token,
                          const void* cu_seqlens_q, int64_t num_cu,
                          const void* seq_lens_decoder, int64_t num_dec, int idx_bytes,
                          int64_t layer, int64_t num_experts, unsigned long long* error_count,
                          void* stream) {
  const RecordArgs a{max_num_seqs, max_len, num_layers, top_k, num_tokens,
                     num_cu,       num_dec, layer,      num_experts};
  auto s = static_cast<cudaStream_t>(stream);
  switch (table_bytes) {
    case 1:
      return record_by_ids<uint8_t>(table, topk_ids, id_bytes, batch_id_per_token, cu_seqlens_q,
                                    seq_lens_decoder, idx_bytes, a, error_count, s);
    case 2:
      return record_by_ids<uint16_t>(table, topk_ids, id_bytes, batch_id_per_token,
                                     cu_seqlens_q, seq_lens_decoder, idx_bytes, a, error_count,
                                     s);
    case 4:
      return record_by_ids<uint32_t>(table, topk_ids, id_bytes, batch_id_per_token,
                                     cu_seqlens_q, seq_lens_decoder, idx_bytes, a, error_count,
                                     s);
    default:
      return -1;
  }
}

// Step buffer [capacity, num_layers, top_k]: buffer[t, layer, :] = topk_ids[t, :];
// counters[0] += bad ids, counters[1 + layer] += 1.
int fdrr_h_record_rows(void* buffer, int buffer_bytes, int64_t capacity, int64_t num_layers,
                       int64_t top_k, const void* topk_ids, int id_bytes, int64_t num_tokens,
                       int64_t layer, int64_t num_experts, unsigned long long* counters,
                       void* stream) {
  if (num_tokens > capacity) return -1;
  const fdrr::RowsArgs a{capacity, num_layers, top_k, num_tokens, layer, num_experts};
  auto s = static_cast<cudaStream_t>(stream);
  switch (buffer_bytes) {
    case 1: return record_rows_by_ids<uint8_t>(buffer, topk_ids, id_bytes, a, counters, s);
    case 2: return record_rows_by_ids<uint16_t>(buffer, topk_ids, id_bytes, a, counters, s);
    case 4: return record_rows_by_ids<uint32_t>(buffer, topk_ids, id_bytes, a, counters, s);
    default: return -1;
  }
}

int fdrr_h_find_bad_index(const void* index, int idx_bytes, int64_t n, int64_t bound,
                          unsigned long long* first_bad, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (idx_bytes == 4) {
    return static_cast<int>(fdrr::cuda::launch_find_bad_index(static_cast<const int32_t*>(index),
                                                              n, bound, first_bad, s));
  }
  if (idx_bytes == 8) {
    return static_cast<int>(fdrr::cuda::launch_find_bad_index(static_cast<const int64_t*>(index),
                                                              n, bound, first_bad, s));
  }
  return -1;
}

int fdrr_h_pack_routing(const void* source, int64_t num_layers, int64_t top_k,
                        int64_t elem_bytes, const void* slots, int idx_bytes, int64_t num_tokens,
                        void* out, const unsigned long long* bad, int num_bad, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (idx_bytes == 4) {
    return static_cast<int>(fdrr::cuda::launch_pack_routing(
        source, kNoBound, num_layers, top_k, elem_bytes, static_cast<const int32_t*>(slots),
        num_tokens, out, s, bad, num_bad));
  }
  if (idx_bytes == 8) {
    return static_cast<int>(fdrr::cuda::launch_pack_routing(
        source, kNoBound, num_layers, top_k, elem_bytes, static_cast<const int64_t*>(slots),
        num_tokens, out, s, bad, num_bad));
  }
  return -1;
}

int fdrr_h_gather_routing_rows(const void* table, int64_t max_len, int64_t row_bytes,
                               const void* batch_ids, const void* positions, int idx_bytes,
                               int64_t n, void* out, const unsigned long long* bad, int num_bad,
                               void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (idx_bytes == 4) {
    return static_cast<int>(fdrr::cuda::launch_gather_routing_rows(
        table, kNoBound, max_len, row_bytes, static_cast<const int32_t*>(batch_ids),
        static_cast<const int32_t*>(positions), n, out, s, bad, num_bad));
  }
  if (idx_bytes == 8) {
    return static_cast<int>(fdrr::cuda::launch_gather_routing_rows(
        table, kNoBound, max_len, row_bytes, static_cast<const int64_t*>(batch_ids),
        static_cast<const int64_t*>(positions), n, out, s, bad, num_bad));
  }
  return -1;
}

int fdrr_h_clear_routing_rows(void* table, int64_t seq_bytes, const void* batch_ids,
                              int idx_bytes, int64_t n, const unsigned long long* bad, int num_bad,
                              void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (idx_bytes == 4) {
    return static_cast<int>(fdrr::cuda::launch_clear_routing_rows(
        table, kNoBound, seq_bytes, static_cast<const int32_t*>(batch_ids), n, s, bad, num_bad));
  }
  if (idx_bytes == 8) {
    return static_cast<int>(fdrr::cuda::launch_clear_routing_rows(
        table, kNoBound, seq_bytes, static_cast<const int64_t*>(batch_ids), n, s, bad, num_bad));
  }
  return -1;
}

// Blocks until all work on the device is done; returns its status.
int fdrr_h_synchronize(void) { return static_cast<int>(cudaDeviceSynchronize()); }

// Human-readable name of a status returned above.
const char* fdrr_h_error_string(int status) {
  if (status == -1) return "unsupported dtype size";
  return cudaGetErrorString(static_cast<cudaError_t>(status));
}

}  // extern "C"
