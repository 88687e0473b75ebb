// Framework-free CPU kernels of fd-routing-replay's custom ops.
//
// No Paddle (or any framework) header here: routing_ops.cc wraps these loops in Paddle
// ops, and the same semantics are implemented for CUDA in routing_kernels.cuh.  Every
// index computation is 64-bit (FastDeploy once overflowed a 32-bit stride).
//
// Routing table layout (row-major, C-contiguous):
//   table[max_num_seqs][max_len][num_layers][top_k], element type uint8/uint16/uint32.
// The fill value ("no routing") is the dtype's maximum, i.e. every byte 0xFF, so the
// dtype-agnostic kernels (pack / gather / clear) only need the element size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace fdrr {

// Shapes and scalars of one record_routing call.
struct RecordArgs {
  int64_t max_num_seqs;  // table dim 0
  int64_t max_len;       // table dim 1
  int64_t num_layers;    // table dim 2
  int64_t top_k;         // table dim 3 (== topk_ids dim 1)
  int64_t num_tokens;    // topk_ids dim 0 (== batch_id_per_token numel)
  int64_t num_cu;        // cu_seqlens_q numel
  int64_t num_dec;       // seq_lens_decoder numel
  int64_t layer;         // MoE layer index, 0 <= layer < num_layers
  int64_t num_experts;   // valid ids are [0, num_experts); at most the fill value
};

// Number of sequences a batch id may address without reading past any input: sequence b
// needs seq_lens_decoder[b] and both ends of its span, cu_seqlens_q[b] and cu_seqlens_q[b+1].
inline int64_t record_seq_bound(const RecordArgs& a) {
  int64_t bound = a.max_num_seqs;
  if (a.num_dec < bound) bound = a.num_dec;
  if (a.num_cu - 1 < bound) bound = a.num_cu - 1;
  return bound < 0 ? 0 : bound;
}

// Position of token t in the table, or -1 when the token is skipped: padding (b < 0), a
// sequence past the table or the index arrays, a token outside its sequence's span
// [cu_seqlens_q[b], cu_seqlens_q[b+1]) (a stale batch id left in a reused buffer: without
// this check it would silently overwrite another position of sequence b), or a position
// outside [0, max_len).  Shared by the CPU loop and the CUDA kernel.
template <typename IdxT>
#if defined(__CUDACC__)
__host__ __device__
#endif
inline int64_t record_position(int64_t t, int64_t b, const IdxT* cu_seqlens_q,
                               const IdxT* seq_lens_decoder, int64_t seq_bound,
                               int64_t max_len) {
  if (b < 0 || b >= seq_bound) return -1;
  const int64_t start = static_cast<int64_t>(cu_seqlens_q[b]);
  if (t < start || t >= static_cast<int64_t>(cu_seqlens_q[b + 1])) return -1;
  const int64_t pos = static_cast<int64_t>(seq_lens_decoder[b]) + t - start;
  return (pos < 0 || pos >= max_len) ? -1 : pos;
}

namespace detail {

// record_routing with a compile-time top_k (KS > 0) so the per-token id loop unrolls and
// vectorises, or a runtime one (KS == 0).
template <int KS, typename TableT, typename IdT, typename IdxT>
int64_t record_routing(TableT* table, const IdT* topk_ids, const IdxT* batch_id_per_token,
                       const IdxT* cu_seqlens_q, const IdxT* seq_lens_decoder,
                       const RecordArgs& a) {
  const TableT fill = std::numeric_limits<TableT>::max();
  const int64_t seq_bound = record_seq_bound(a);
  const uint64_t num_experts = static_cast<uint64_t>(a.num_experts);
  const int64_t k_count = KS > 0 ? KS : a.top_k;
  const int64_t token_stride = a.num_layers * k_count;
  const int64_t seq_stride = a.max_len * token_stride;
  const int64_t layer_offset = a.layer * k_count;
  int64_t errors = 0;
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    const int64_t b = static_cast<int64_t>(batch_id_per_token[t]);
    const int64_t pos = record_position(t, b, cu_seqlens_q, seq_lens_decoder, seq_bound, a.max_len);
    if (pos < 0) continue;
    TableT* dst = table + b * seq_stride + pos * token_stride + layer_offset;
    const IdT* src = topk_ids + t * k_count;
    int64_t bad = 0;
    for (int64_t k = 0; k < k_count; ++k) {
      // A negative id becomes a huge unsigned value, so one comparison covers both ends.
      const uint64_t v = static_cast<uint64_t>(static_cast<int64_t>(src[k]));
      const bool ok = v < num_experts;
      dst[k] = ok ? static_cast<TableT>(v) : fill;
      bad += ok ? 0 : 1;
    }
    errors += bad;
  }
  return errors;
}

}  // namespace detail

// record_routing on CPU.  For token t of sequence b = batch_id_per_token[t] (b < 0 is
// padding) at position p = seq_lens_decoder[b] + t - cu_seqlens_q[b], writes
// topk_ids[t, :] into table[b, p, layer, :].  Tokens whose b or p is out of range, or that
// lie outside their sequence's span [cu_seqlens_q[b], cu_seqlens_q[b+1]), are skipped;
// ids outside [0, num_experts) are written as the fill value and counted.
// Returns the number of such bad ids (among written tokens only).
template <typename TableT, typename IdT, typename IdxT>
int64_t record_routing_cpu(TableT* table, const IdT* topk_ids, const IdxT* batch_id_per_token,
                           const IdxT* cu_seqlens_q, const IdxT* seq_lens_decoder,
                           const RecordArgs& a) {
  switch (a.top_k) {
#define FDRR_RECORD_K(K)                                                                   \
  case K:                                                                                  \
    return detail::record_routing<K>(table, topk_ids, batch_id_per_token, cu_seqlens_q,    \
                                     seq_lens_decoder, a);
    FDRR_RECORD_K(2)
    FDRR_RECORD_K(4)
    FDRR_RECORD_K(6)
    FDRR_RECORD_K(8)
#undef FDRR_RECORD_K
    default:
      return detail::record_routing<0>(table, topk_ids, batch_id_per_token, cu_seqlens_q,
                                       seq_lens_decoder, a);
  }
}

// Shapes and scalars of one record_rows call (token-major step buffer).
struct RowsArgs {
  int64_t capacity;      // buffer dim 0 (max_batched_tokens)
  int64_t num_layers;    // buffer dim 1
  int64_t top_k;         // buffer dim 2 (== topk_ids dim 1)
  int64_t num_tokens;    // topk_ids dim 0, at most capacity (checked by the caller)
  int64_t layer;         // buffer row of this MoE layer, 0 <= layer < num_layers
  int64_t num_experts;   // valid ids are [0, num_experts); at most the fill value
};

namespace detail {

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
      const uint64_t v = static_cast<uint64_t>(static_cast<int64_t>(src[k]));
      const bool ok = v < num_experts;
      dst[k] = ok ? static_cast<BufT>(v) : fill;
      errors += ok ? 0 : 1;
    }
  }
  return errors;
}

}  // namespace detail

// record_rows on CPU: the step buffer's row t, layer `layer`, receives topk_ids[t, :] for
// every token t < num_tokens (token t of the step is row t: no index arrays, no lookups).
// Ids outside [0, num_experts) are written as the fill value; returns their count.
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

// Position of the first index outside [0, bound), or -1 when all are in range.
template <typename IdxT>
int64_t first_bad_index(const IdxT* index, int64_t n, int64_t bound) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = static_cast<int64_t>(index[i]);
    if (v < 0 || v >= bound) return i;
  }
  return -1;
}

namespace detail {

constexpr int64_t kPackTile = 256;  // tokens per tile (their rows stay in L2)

// out[l, t, :] = source[slots[t], l, :] for tokens [token_begin, token_end), rows of ROW
// bytes (ROW == 0: row_bytes at run time).  Tokens go in tiles: a tile's source rows are
// looked up once and stay in cache while each layer's output run is written sequentially.
// Rows of 8 bytes (uint8 x top-8) move as 2x2 blocks of SSE2 registers, 4 layers a pass.
template <int ROW, typename IdxT>
void pack_rows(const unsigned char* source, int64_t num_layers, int64_t row_bytes,
               const IdxT* slots, int64_t num_tokens, unsigned char* out, int64_t token_begin,
               int64_t token_end) {
  const unsigned char* rows[kPackTile];
  const int64_t src_stride = num_layers * row_bytes;  // bytes per slot
  const int64_t out_stride = num_tokens * row_bytes;  // bytes per layer
  for (int64_t t0 = token_begin; t0 < token_end; t0 += kPackTile) {
    const int64_t n = (token_end - t0 < kPackTile) ? token_end - t0 : kPackTile;
    for (int64_t i = 0; i < n; ++i) {
      rows[i] = source + static_cast<int64_t>(slots[t0 + i]) * src_stride;
    }
    int64_t l = 0;
#if defined(__SSE2__)
    if constexpr (ROW == 8) {
      for (; l + 4 <= num_layers; l += 4) {  // four layers per pass over the tile's rows
        unsigned char* d0 = out + l * out_stride + t0 * 8;
        const int64_t off = l * 8;
        int64_t i = 0;
        for (; i + 2 <= n; i += 2) {
          const auto* r0 = reinterpret_cast<const __m128i*>(rows[i] + off);
          const auto* r1 = reinterpret_cast<const __m128i*>(rows[i + 1] + off);
          const __m128i a = _mm_loadu_si128(r0), b = _mm_loadu_si128(r1);
          const __m128i c = _mm_loadu_si128(r0 + 1), d = _mm_loadu_si128(r1 + 1);
          unsigned char* o = d0 + i * 8;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm_unpacklo_epi64(a, b));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + out_stride), _mm_unpackhi_epi64(a, b));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 2 * out_stride),
                           _mm_unpacklo_epi64(c, d));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 3 * out_stride),
                           _mm_unpackhi_epi64(c, d));
        }
        for (; i < n; ++i) {
          for (int64_t j = 0; j < 4; ++j) {
            std::memcpy(d0 + j * out_stride + i * 8, rows[i] + off + j * 8, 8);
          }
        }
      }
      for (; l + 2 <= num_layers; l += 2) {
        unsigned char* d0 = out + l * out_stride + t0 * 8;
        unsigned char* d1 = d0 + out_stride;
        const int64_t off = l * 8;
        int64_t i = 0;
        for (; i + 2 <= n; i += 2) {
          // a = [t_i: layer l, l+1], b = [t_i+1: layer l, l+1] -> [l: t_i, t_i+1], [l+1: ...]
          const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i] + off));
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i + 1] + off));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(d0 + i * 8), _mm_unpacklo_epi64(a, b));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(d1 + i * 8), _mm_unpackhi_epi64(a, b));
        }
        for (; i < n; ++i) {
          std::memcpy(d0 + i * 8, rows[i] + off, 8);
          std::memcpy(d1 + i * 8, rows[i] + off + 8, 8);
        }
      }
    }
#endif
    for (; l < num_layers; ++l) {
      unsigned char* dst = out + l * out_stride + t0 * row_bytes;
      const int64_t off = l * row_bytes;
      for (int64_t i = 0; i < n; ++i, dst += row_bytes) {
        if constexpr (ROW > 0) {
          std::memcpy(dst, rows[i] + off, ROW);  // fixed size: plain (unaligned) moves
        } else {
          std::memcpy(dst, rows[i] + off, static_cast<size_t>(row_bytes));
        }
      }
    }
  }
}

}  // namespace detail

// Threads worth using for a pack of `bytes` output bytes: one per 4 MiB, at most
// `max_threads` and the hardware's count.  Small packs stay on the calling thread
// (a thread start costs tens of microseconds).
inline int pack_threads_for(int64_t bytes, int max_threads) {
  const int64_t by_size = bytes / (int64_t{4} << 20);
  int64_t n = by_size < max_threads ? by_size : max_threads;
  const int64_t hw = static_cast<int64_t>(std::thread::hardware_concurrency());
  if (hw > 0 && n > hw) n = hw;
  return n < 1 ? 1 : static_cast<int>(n);
}

// pack_routing on CPU: out[l, t, :] = source[slots[t], l, :] for the slot cache
// source[num_slots][num_layers][top_k] and out[num_layers][num_tokens][top_k], with
// elements of elem_bytes bytes.  The caller has checked every slot (first_bad_index).
// Large packs split the tokens over up to `max_threads` std::threads (no OpenMP: the
// host process may already run another OpenMP runtime).
template <typename IdxT>
void pack_routing_cpu(const void* source, int64_t num_layers, int64_t top_k,
                      int64_t elem_bytes, const IdxT* slots, int64_t num_tokens, void* out,
                      int max_threads = 1) {
  const auto* src = static_cast<const unsigned char*>(source);
  auto* dst = static_cast<unsigned char*>(out);
  const int64_t row = top_k * elem_bytes;
  void (*range)(const unsigned char*, int64_t, int64_t, const IdxT*, int64_t, unsigned char*,
                int64_t, int64_t);
  switch (row) {
    case 4: range = detail::pack_rows<4, IdxT>; break;
    case 6: range = detail::pack_rows<6, IdxT>; break;
    case 8: range = detail::pack_rows<8, IdxT>; break;
    case 12: range = detail::pack_rows<12, IdxT>; break;
    case 16: range = detail::pack_rows<16, IdxT>; break;
    case 24: range = detail::pack_rows<24, IdxT>; break;
    case 32: range = detail::pack_rows<32, IdxT>; break;
    case 64: range = detail::pack_rows<64, IdxT>; break;
    default: range = detail::pack_rows<0, IdxT>; break;
  }
  const int threads = pack_threads_for(num_layers * num_tokens * row, max_threads);
  if (threads <= 1) {
    range(src, num_layers, row, slots, num_tokens, dst, 0, num_tokens);
    return;
  }
  // Whole tiles per thread, so no two threads write the same output cache line twice.
  const int64_t tiles = (num_tokens + detail::kPackTile - 1) / detail::kPackTile;
  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(threads - 1));
  int64_t begin = 0;
  for (int w = 0; w < threads; ++w) {
    const int64_t end_tile = tiles * (w + 1) / threads;
    const int64_t end = end_tile * detail::kPackTile < num_tokens ? end_tile * detail::kPackTile
                                                                  : num_tokens;
    bool started = false;
    if (w + 1 < threads) {
      try {
        workers.emplace_back(range, src, num_layers, row, slots, num_tokens, dst, begin, end);
        started = true;
      } catch (...) {  // no thread available: do this share on the calling thread
      }
    }
    if (!started) range(src, num_layers, row, slots, num_tokens, dst, begin, end);
    begin = end;
  }
  for (auto& worker : workers) worker.join();
}

// gather_routing_rows on CPU: out[i, :, :] = table[batch_ids[i], positions[i], :, :],
// i.e. one contiguous row of row_bytes = num_layers * top_k * elem_bytes per index pair.
// The caller has checked both index arrays.
template <typename IdxT>
void gather_routing_rows_cpu(const void* table, int64_t max_len, int64_t row_bytes,
                             const IdxT* batch_ids, const IdxT* positions, int64_t n,
                             void* out) {
  const auto* src = static_cast<const unsigned char*>(table);
  auto* dst = static_cast<unsigned char*>(out);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = static_cast<int64_t>(batch_ids[i]) * max_len +
                        static_cast<int64_t>(positions[i]);
    std::memcpy(dst + i * row_bytes, src + row * row_bytes, static_cast<size_t>(row_bytes));
  }
}

// clear_routing_rows on CPU: table[batch_ids[i], ...] = fill for every i, where
// seq_bytes = max_len * num_layers * top_k * elem_bytes.  The fill (dtype max) is all
// 0xFF bytes for every unsigned dtype.  The caller has checked batch_ids.
template <typename IdxT>
void clear_routing_rows_cpu(void* table, int64_t seq_bytes, const IdxT* batch_ids, int64_t n) {
  auto* dst = static_cast<unsigned char*>(table);
  for (int64_t i = 0; i < n; ++i) {
    std::memset(dst + static_cast<int64_t>(batch_ids[i]) * seq_bytes, 0xFF,
                static_cast<size_t>(seq_bytes));
  }
}

}  // namespace fdrr
