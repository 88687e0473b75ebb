// The `set` payload encoding of rr-v1 (docs/record-format.md, "Payload encoding set"),
// compiled: a plain C ABI with no Paddle (trainers read records without it), built with
// xxh3.cc into one library by fd_routing_replay/core/native.py, whose set-codec entry points
// fd_routing_replay/codec/setcodec.py declares.  fd_routing_replay/codec/set_numpy.py
// is the reference it must match byte for byte.
//
// A row (one token in one layer: k distinct expert ids out of E) is stored as its colex
// rank  C(c_0, 1) + C(c_1, 2) + ... + C(c_{k-1}, k)  over the sorted ids, in
// b = bit_length(C(E, k)) bits (C(E, k) itself marks a padding row), rows back to back in
// a little-endian bit stream.  Ranks are uint64 when b <= 64 and unsigned __int128 up to
// b = 128.
//
// Encode: blocks of 64 rows transposed so that each row is one SIMD lane, sorted by a
// Batcher network of element-wise min/max (vectorised by the compiler), then k table
// look-ups per row.  Decode, per row, for j = k .. 2: the largest c with C(c, j) <= v.  A
// table indexed by a key of v (its binary exponent and top m bits: the float64 bits of v,
// or an integer equivalent above 2^62) gives a lower bound of c; one branch-free step
// (rarely more) makes it exact.  m is chosen per level as the smallest that needs at most
// one step, so the tables stay small (a few KiB) and in L1.  16 rows are decoded in
// lockstep, level by level, so the CPU overlaps their dependency chains.
//
// Entry points return -1 when done, the index (>= 0) of the first bad row (encode: not a
// set; decode: a rank above C(E, k)), or -2 for arguments this library does not take.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <utility>
#include <vector>

#include "set_codec_tables.h"

namespace {

// ------------------------------------------------------------------ bit stream

inline u64 Load64(const u8* p) { u64 v; std::memcpy(&v, p, 8); return v; }
inline void Store64(u8* p, u64 v) { std::memcpy(p, &v, 8); }

// Appends fields of up to 64 bits, least significant bit first.
struct BitWriter {
  u8* out;
  u128 acc = 0;
  int filled = 0;
  explicit BitWriter(u8* o) : out(o) {}
  inline void Put(u64 value, int width) {
    acc |= static_cast<u128>(value) << filled;
    filled += width;
    if (filled >= 64) {
      Store64(out, static_cast<u64>(acc));
      out += 8;
      acc >>= 64;
      filled -= 64;
    }
  }
  inline void Put(u128 value, int width) {
    if (width <= 64) return Put(static_cast<u64>(value), width);
    Put(static_cast<u64>(value), 64);
    Put(static_cast<u64>(value >> 64), width - 64);
  }
  void Flush() {
    for (int i = 0; filled > 0; ++i, filled -= 8) out[i] = static_cast<u8>(acc >> (8 * i));
  }
};

// Reads the b-bit value at bit `pos` of `base`; needs 17 readable bytes from pos / 8.
template <typename R>
inline R ReadValue(const u8* base, u64 pos, int bits, R mask) {
  const u8* p = base + (pos >> 3);
  const int shift = static_cast<int>(pos & 7);
  if constexpr (sizeof(R) == 8) {
    if (bits <= 57) return (Load64(p) >> shift) & mask;
  }
  u128 x = (static_cast<u128>(Load64(p + 8)) << 64 | Load64(p)) >> shift;
  if (bits > 120 && shift) x |= static_cast<u128>(p[16]) << (128 - shift);
  return static_cast<R>(x) & mask;
}

// ------------------------------------------------------------------ encode

constexpr int kBlock = 64;  // rows sorted side by side (one SIMD lane per row)

// One comparator of the network over the kBlock rows of a block (vectorised).
template <typename T>
inline void CompareExchange(T* __restrict a, T* __restrict b) {
  for (int r = 0; r < kBlock; ++r) {
    const T x = a[r], y = b[r];
    const T low = x < y ? x : y, high = x < y ? y : x;  // (std::min/max defeat GCC 12's vectoriser)
    a[r] = low;
    b[r] = high;
  }
}

// One block of rows [0, count), column-major (cols[i * kBlock + r]: slot i of row r):
// sorts every row, then the first row that is neither a set nor padding (-1: none) and
// the value of each row in `ranks`.
template <typename T, typename R>
int SortAndRank(const Context& ctx, T* cols, int count, T fill, const R* const* tables, R* ranks) {
  const int k = ctx.top_k;
  if (ctx.network.empty() && k > 1) {  // too many slots for the network: sort row by row
    std::vector<T> row(k);
    for (int r = 0; r < count; ++r) {
      for (int i = 0; i < k; ++i) row[i] = cols[i * kBlock + r];
      std::sort(row.begin(), row.end());
      for (int i = 0; i < k; ++i) cols[i * kBlock + r] = row[i];
    }
  }
  for (const auto& pair : ctx.network) CompareExchange(cols + pair.first * kBlock, cols + pair.second * kBlock);
  const T largest = static_cast<T>(ctx.experts - 1);  // E - 1 fits T (the fill value does)
  const T* last = cols + (k - 1) * kBlock;
  u8 padding[kBlock], ok[kBlock];
  for (int r = 0; r < kBlock; ++r) {
    padding[r] = (cols[r] == fill) & (last[r] == fill);
    ok[r] = last[r] <= largest;
  }
  for (int i = 1; i < k; ++i) {
    const T* low = cols + (i - 1) * kBlock;
    const T* high = cols + i * kBlock;
    for (int r = 0; r < kBlock; ++r) ok[r] &= low[r] < high[r];
  }
  for (int r = 0; r < count; ++r)
    if (!(ok[r] | padding[r])) return r;
  for (int r = 0; r < count; ++r) {
    R rank = 0;
    for (int i = 0; i < k; ++i) rank += tables[i + 1][std::min(cols[i * kBlock + r], largest)];
    ranks[r] = padding[r] ? static_cast<R>(ctx.padding) : rank;
  }
  return -1;
}

// Rows [0, count) of k slots into columns (cols[i * kBlock + r]); unrolled for k <= 16.
template <int K, typename T>
inline void TransposeK(const T* src, T* cols, int count) {
  for (int r = 0; r < count; ++r)
    for (int i = 0; i < K; ++i) cols[i * kBlock + r] = src[r * K + i];
}
template <typename T>
void Transpose(const T* src, T* cols, int count, int k) {
  switch (k) {
    case 1: return TransposeK<1>(src, cols, count);
    case 2: return TransposeK<2>(src, cols, count);
    case 3: return TransposeK<3>(src, cols, count);
    case 4: return TransposeK<4>(src, cols, count);
    case 5: return TransposeK<5>(src, cols, count);
    case 6: return TransposeK<6>(src, cols, count);
    case 7: return TransposeK<7>(src, cols, count);
    case 8: return TransposeK<8>(src, cols, count);
    case 9: return TransposeK<9>(src, cols, count);
    case 10: return TransposeK<10>(src, cols, count);
    case 12: return TransposeK<12>(src, cols, count);
    case 16: return TransposeK<16>(src, cols, count);
    default:
      for (int r = 0; r < count; ++r)
        for (int i = 0; i < k; ++i) cols[i * kBlock + r] = src[r * k + i];
  }
}

template <typename T, typename R>
int64_t EncodeRows(const Context& ctx, const T* ids, int64_t rows, T fill, u8* out) {
  const int k = ctx.top_k;
  std::vector<const R*> tables(k + 1);
  for (int j = 1; j <= k; ++j) {
    if constexpr (sizeof(R) == 8) tables[j] = ctx.rank64[j].data();
    else tables[j] = ctx.rank128[j].data();
  }
  std::vector<T> cols(static_cast<size_t>(k) * kBlock);
  R ranks[kBlock];
  BitWriter writer(out);
  for (int64_t n = 0; n < rows; n += kBlock) {
    const int count = static_cast<int>(std::min<int64_t>(kBlock, rows - n));
    const T* src = ids + n * k;
    if (count < kBlock) std::fill(cols.begin(), cols.end(), fill);  // rows past the end: padding
    Transpose(src, cols.data(), count, k);
    const int bad = SortAndRank<T, R>(ctx, cols.data(), count, fill, tables.data(), ranks);
    if (bad >= 0) return n + bad;
    for (int r = 0; r < count; ++r) writer.Put(ranks[r], ctx.bits);
  }
  writer.Flush();
  return -1;
}

// ------------------------------------------------------------------ decode

template <typename V>
struct LevelView {
  const uint16_t* guess;
  const Pair<V>* pairs;
  int m, steps;
  bool float_key;
  int shift;
  u64 base;
  inline u64 KeyOf(V v) const {
    if constexpr (sizeof(V) == 8) {
      if (float_key) return FloatKey(v, shift, base);
    }
    return Key(v, m);
  }
};

// c = max{c < E : C(c, j) <= v} at one level, then v -= C(c, j).  Steps = 1: the
// guess or the one after it, chosen without a branch (it is a coin flip).
template <typename V>
inline u32 Unrank(V& v, const LevelView<V>& level) {
  const u32 c = level.guess[level.KeyOf(v)];
  const Pair<V> pair = level.pairs[c];
  const V step = static_cast<V>(pair.next <= v);
  v -= pair.at + ((pair.next - pair.at) & (static_cast<V>(0) - step));
  return c + static_cast<u32>(step);
}

// Any number of steps (a table too coarse for one: E in the tens of thousands).
template <typename V>
inline u32 UnrankSteps(V& v, const LevelView<V>& level) {
  u32 c = level.guess[level.KeyOf(v)];
  while (level.pairs[c].next <= v) ++c;
  v -= level.pairs[c].at;
  return c;
}

template <typename V>
inline u32 UnrankAny(V& v, const LevelView<V>& level) {
  return level.steps <= 1 ? Unrank(v, level) : UnrankSteps(v, level);
}

template <typename T, typename R>
int64_t DecodeRange(const Context& ctx, const u8* base, u64 pos, int64_t first, int64_t last,
                    T* out, T fill) {
  const int k = ctx.top_k;
  const int bits = ctx.bits;
  const R mask = static_cast<R>(bits >= 8 * static_cast<int>(sizeof(R)) ? ~static_cast<R>(0)
                                                                        : (static_cast<R>(1) << bits) - 1);
  const R padding = static_cast<R>(ctx.padding);
  std::vector<LevelView<u64>> narrow(k + 1);
  std::vector<LevelView<u128>> wide(k + 1);
  int top_narrow = k;  // levels above it are wide (the wide ones are the top levels)
  for (int j = k; j >= 2; --j) {
    const Level& level = ctx.levels[j];
    const int shift = 52 - level.m;
    const u64 base = u64{1023} << level.m;
    narrow[j] = {level.guess.data(), level.pairs64.data(), level.m, level.steps, level.float_key, shift, base};
    wide[j] = {level.guess.data(), level.pairs128.data(), level.m, level.steps, false, shift, base};
    if (level.wide && top_narrow == j) top_narrow = j - 1;
  }
  const u32* last_two = ctx.last_two.empty() ? nullptr : ctx.last_two.data();
  const int lowest = last_two ? 3 : 2;  // the last level done by Unrank
  int64_t n = first;
  for (; n < last; n += kLockstep, pos += static_cast<u64>(bits) * kLockstep) {
    const int count = static_cast<int>(std::min<int64_t>(kLockstep, last - n));
    R v[kLockstep];
    bool plain = count == kLockstep;
    for (int r = 0; r < count; ++r) {
      v[r] = ReadValue<R>(base, pos + static_cast<u64>(r) * bits, bits, mask);
      plain &= v[r] < padding;
    }
    T* row = out + n * k;
    if (plain) {  // kLockstep ordinary rows, level by level
      u64 rest[kLockstep];
      if constexpr (sizeof(R) == 16) {
        for (int j = k; j > top_narrow; --j) {
          const LevelView<u128> level = wide[j];
          if (level.steps <= 1) {
#pragma GCC unroll 16
            for (int r = 0; r < kLockstep; ++r) row[r * k + j - 1] = static_cast<T>(Unrank(v[r], level));
          } else {
            for (int r = 0; r < kLockstep; ++r) row[r * k + j - 1] = static_cast<T>(UnrankSteps(v[r], level));
          }
        }
      }
      for (int r = 0; r < kLockstep; ++r) rest[r] = static_cast<u64>(v[r]);
      for (int j = top_narrow; j >= lowest; --j) {
        const LevelView<u64> level = narrow[j];
        if (level.steps <= 1) {
#pragma GCC unroll 16
          for (int r = 0; r < kLockstep; ++r) row[r * k + j - 1] = static_cast<T>(Unrank(rest[r], level));
        } else {
          for (int r = 0; r < kLockstep; ++r) row[r * k + j - 1] = static_cast<T>(UnrankSteps(rest[r], level));
        }
      }
      if (last_two) {
        for (int r = 0; r < kLockstep; ++r) {
          const u32 both = last_two[rest[r]];
          row[r * k] = static_cast<T>(both & 0xffff);
          row[r * k + 1] = static_cast<T>(both >> 16);
        }
      } else {
        for (int r = 0; r < kLockstep; ++r) row[r * k] = static_cast<T>(rest[r]);
      }
      continue;
    }
    for (int r = 0; r < count; ++r, row += k) {  // padding, a bad rank or the last rows
      if (v[r] > padding) return n + r;
      if (v[r] == padding) {
        for (int i = 0; i < k; ++i) row[i] = fill;
        continue;
      }
      R value = v[r];
      if constexpr (sizeof(R) == 16) {
        for (int j = k; j > top_narrow; --j) row[j - 1] = static_cast<T>(UnrankAny(value, wide[j]));
      }
      u64 rest = static_cast<u64>(value);
      for (int j = top_narrow; j >= lowest; --j) row[j - 1] = static_cast<T>(UnrankAny(rest, narrow[j]));
      if (last_two) {
        row[0] = static_cast<T>(last_two[rest] & 0xffff);
        row[1] = static_cast<T>(last_two[rest] >> 16);
      } else {
        row[0] = static_cast<T>(rest);
      }
    }
  }
  return -1;
}

template <typename T, typename R>
int64_t DecodeRows(const Context& ctx, const u8* payload, int64_t nbytes, int64_t rows, T* out, T fill) {
  // Rows whose 17-byte read window lies inside the payload read it directly; the last
  // few read from a zero-padded copy of the payload's tail.
  const u64 bits = static_cast<u64>(ctx.bits);
  int64_t direct = 0;
  if (nbytes >= 17) direct = std::min<int64_t>(rows, static_cast<int64_t>(((static_cast<u64>(nbytes) - 17) * 8) / bits + 1));
  const int64_t bad = DecodeRange<T, R>(ctx, payload, 0, 0, direct, out, fill);
  if (bad >= 0 || direct == rows) return bad;
  const u64 start = (direct * bits) >> 3;
  u8 tail[96] = {};
  std::memcpy(tail, payload + start, static_cast<size_t>(nbytes - static_cast<int64_t>(start)));
  return DecodeRange<T, R>(ctx, tail, direct * bits - 8 * start, direct, rows, out, fill);
}

using EncodeFn = int64_t (*)(const Context&, const void*, int64_t, u32, u8*);
using DecodeFn = int64_t (*)(const Context&, const u8*, int64_t, int64_t, void*, u32);

template <typename T, typename R>
int64_t EncodeEntry(const Context& ctx, const void* ids, int64_t rows, u32 fill, u8* out) {
  return EncodeRows<T, R>(ctx, static_cast<const T*>(ids), rows, static_cast<T>(fill), out);
}
template <typename T, typename R>
int64_t DecodeEntry(const Context& ctx, const u8* payload, int64_t nbytes, int64_t rows, void* out, u32 fill) {
  return DecodeRows<T, R>(ctx, payload, nbytes, rows, static_cast<T*>(out), static_cast<T>(fill));
}

// One instance per (id item size, rank width).
EncodeFn EncodeFor(const Context& ctx, int64_t itemsize) {
  const bool wide = ctx.bits > 64;
  switch (itemsize) {
    case 1: return wide ? EncodeEntry<u8, u128> : EncodeEntry<u8, u64>;
    case 2: return wide ? EncodeEntry<uint16_t, u128> : EncodeEntry<uint16_t, u64>;
    case 4: return wide ? EncodeEntry<u32, u128> : EncodeEntry<u32, u64>;
    default: return nullptr;
  }
}
DecodeFn DecodeFor(const Context& ctx, int64_t itemsize) {
  const bool wide = ctx.bits > 64;
  switch (itemsize) {
    case 1: return wide ? DecodeEntry<u8, u128> : DecodeEntry<u8, u64>;
    case 2: return wide ? DecodeEntry<uint16_t, u128> : DecodeEntry<uint16_t, u64>;
    case 4: return wide ? DecodeEntry<u32, u128> : DecodeEntry<u32, u64>;
    default: return nullptr;
  }
}

}  // namespace

extern "C" {

// The ABI of the whole library (this file's entry points, xxh3.cc's and unrouted.cc's),
// checked on load.  3: fdrr_count_unrouted.
int64_t fdrr_native_abi_version(void) { return 3; }

int64_t fdrr_set_max_rank_bits(void) { return kMaxBits; }

// The tables for (E, k), or NULL (unsupported: k outside [1, E], E > 65536, over 128 bits,
// out of memory).  Immutable once built: calls may share it across threads.
void* fdrr_set_context_new(int64_t num_experts, int64_t top_k) {
  try {
    return NewContext(num_experts, top_k);
  } catch (...) {
    return nullptr;
  }
}

void fdrr_set_context_free(void* ctx) { delete static_cast<Context*>(ctx); }

int64_t fdrr_set_context_bits(const void* ctx) { return static_cast<const Context*>(ctx)->bits; }

// ids: rows * k unsigned ints of `itemsize` bytes (1, 2, 4); out: ceil(rows * b / 8) bytes.
int64_t fdrr_set_encode(const void* ctx, const void* ids, int64_t itemsize, int64_t rows,
                        uint64_t fill, uint8_t* out, int64_t out_nbytes) {
  const Context& c = *static_cast<const Context*>(ctx);
  const EncodeFn fn = EncodeFor(c, itemsize);
  if (!fn || rows < 0 || fill > 0xffffffffu) return -2;
  if (out_nbytes != static_cast<int64_t>((static_cast<u128>(rows) * c.bits + 7) / 8)) return -2;
  if (rows == 0) return -1;
  try {
    return fn(c, ids, rows, static_cast<u32>(fill), out);
  } catch (...) {
    return -2;
  }
}

// payload: ceil(rows * b / 8) bytes; out: rows * k unsigned ints of `itemsize` bytes.
int64_t fdrr_set_decode(const void* ctx, const uint8_t* payload, int64_t nbytes, int64_t rows,
                        void* out, int64_t itemsize, uint64_t fill) {
  const Context& c = *static_cast<const Context*>(ctx);
  const DecodeFn fn = DecodeFor(c, itemsize);
  if (!fn || rows < 0 || fill > 0xffffffffu) return -2;
  if (nbytes != static_cast<int64_t>((static_cast<u128>(rows) * c.bits + 7) / 8)) return -2;
  if (rows == 0) return -1;
  try {
    return fn(c, payload, nbytes, rows, out, static_cast<u32>(fill));
  } catch (...) {
    return -2;
  }
}

}  // extern "C"
