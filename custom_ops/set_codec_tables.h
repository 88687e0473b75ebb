// The tables of the set codec (custom_ops/set_codec.cc): for one (E, k), the binomials
// of the rank sums, the per-level unranking tables and their keys, the sorting network.
// Built once per (E, k) by NewContext and immutable afterwards.  Included by
// set_codec.cc only (one translation unit: everything here has internal linkage).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

using u8 = uint8_t;
using u32 = uint32_t;
using u64 = uint64_t;
using u128 = unsigned __int128;

constexpr int kMaxBits = 128;
constexpr int64_t kMaxExperts = 1 << 16;
constexpr int kMaxKeyBits = 12;   // the coarsest table is (bits + 1) * 2^12 entries
constexpr int kLockstep = 16;     // rows decoded side by side
constexpr int kMaxNetwork = 64;   // more slots than this: sorted row by row
constexpr u64 kMaxLastTwo = u64{1} << 17;  // the last two levels by one look-up up to here (512 KiB)
constexpr int64_t kMaxTable = int64_t{1} << 22;  // (k + 1) * E binomials at most
constexpr u128 kU128Max = ~static_cast<u128>(0);
constexpr u64 kU64Max = ~static_cast<u64>(0);

inline u128 SatAdd(u128 a, u128 b) { return a + b < a ? kU128Max : a + b; }

inline int BitLength(u128 v) {
  const u64 hi = static_cast<u64>(v >> 64);
  return hi ? 128 - __builtin_clzll(hi) : 64 - __builtin_clzll(static_cast<u64>(v) | 1);
}

// The table key of v: v itself below 2^(m+1), else (q << m) + (v >> q) with q the shift
// that leaves m + 1 significant bits.  Monotone in v.
inline u64 Key(u64 v, int m) {
  const int q = std::max(64 - __builtin_clzll(v | 1) - m - 1, 0);
  return (static_cast<u64>(q) << m) + (v >> q);
}
inline u64 Key(u128 v, int m) {
  const int q = std::max(BitLength(v) - m - 1, 0);
  return (static_cast<u64>(q) << m) + static_cast<u64>(v >> q);
}
// The smallest v whose key is `key`.
inline u128 KeyStart(u64 key, int m) {
  if (key < (u64{1} << m)) return key;
  const int q = static_cast<int>(key >> m) - 1;
  return static_cast<u128>((u64{1} << m) + (key & ((u64{1} << m) - 1))) << q;
}

// The float key of v < 2^62: the top bits of the float64 of (v | 1) (its exponent and m
// mantissa bits), less those of 1.0.  Cheaper than Key (a conversion and a shift), but
// rounding blurs the bucket edges; FloatBucket accounts for that.
inline u64 FloatKey(u64 v, int shift, u64 base) {
  const double d = static_cast<double>(static_cast<int64_t>(v | 1));
  u64 b;
  std::memcpy(&b, &d, 8);
  return (b >> shift) - base;
}
// floor and ceil of the float64 the float key `key` starts at.
inline void FloatStart(u64 key, int m, u128* floor, u128* ceil) {
  const int e = static_cast<int>(key >> m);
  const u128 mantissa = (u64{1} << m) + (key & ((u64{1} << m) - 1));
  if (e >= m) {
    *floor = *ceil = mantissa << (e - m);
  } else {
    *floor = mantissa >> (m - e);
    *ceil = (mantissa + (u64{1} << (m - e)) - 1) >> (m - e);
  }
}

template <typename V>
struct Pair { V at, next; };  // C(c, j), C(c + 1, j): one load for the step and the rest

struct Level {
  bool wide = false;                // ranks at this level may need more than 64 bits
  bool float_key = false;           // FloatKey (ranks below 2^62) or Key
  int m = 0, steps = 0;             // key bits; most single steps after the guess
  std::vector<uint16_t> guess;      // a lower bound of c per key (c < E <= 65536)
  std::vector<Pair<u64>> pairs64;   // C(c, j), C(c + 1, j) for c < E, saturated (narrow)
  std::vector<Pair<u128>> pairs128; // the same, 128 bits (wide levels)
};

struct Context {
  int experts = 0, top_k = 0, bits = 0;
  u128 padding = 0;                 // C(E, k): the value of a padding row
  std::vector<std::vector<u64>> rank64;   // [j][n] = C(n, j), j in [1, k], n < E (b <= 64)
  std::vector<std::vector<u128>> rank128; // the same for b > 64
  std::vector<Level> levels;              // index j in [2, k]
  std::vector<std::pair<int, int>> network;  // the sorting network (empty: k = 1 or k > 64)
  std::vector<u32> last_two;  // rest below C(E, 2) -> c_0 | c_1 << 16 (empty: too big, k = 1)
};

// Batcher's odd-even merge sort for n inputs, as (low, high) comparators.
std::vector<std::pair<int, int>> Batcher(int n) {
  std::vector<std::pair<int, int>> pairs;
  for (int p = 1; p < n; p *= 2)
    for (int k = p; k >= 1; k /= 2)
      for (int j = k % p; j < n - k; j += 2 * k)
        for (int i = 0; i < std::min(k, n - j - k); ++i)
          if ((i + j) / (2 * p) == (i + j + k) / (2 * p)) pairs.emplace_back(i + j, i + j + k);
  return pairs;
}

// For column col (C(n, j), n in [0, E), non-decreasing) and ranks below `bound`: the
// steps a table of m key bits needs, and (when `guess`) the table itself: per key, the
// answer for the smallest rank that can have that key.
int PlanTable(const std::vector<u128>& col, u128 bound, int m, bool float_key,
              std::vector<uint16_t>* guess) {
  const int shift = 52 - m;
  const u64 base = u64{1023} << m;
  const u64 size = (float_key ? FloatKey(static_cast<u64>(bound - 1), shift, base) : Key(bound - 1, m)) + 1;
  if (guess) guess->assign(size, 0);
  const size_t experts = col.size();
  size_t low = 0, high = 0;  // answer(first rank of the key), answer(last rank of the key)
  int steps = 0;
  for (u64 key = 0; key < size; ++key) {
    u128 first, last;
    if (float_key) {
      // float64(x) >= s implies x >= s - s / 2^53 (exact below 2^53), and x = v | 1 is
      // v or v + 1; float64(x) < s' (the next key's start) implies v < s'.
      u128 floor, ceil;
      FloatStart(key, m, &floor, &ceil);
      const u128 margin = (floor >> 53) + 1;
      first = key == 0 || floor <= margin ? 0 : floor - margin;
      FloatStart(key + 1, m, &floor, &ceil);
      last = key + 1 < size ? std::min(ceil - 1, bound - 1) : bound - 1;
    } else {
      first = KeyStart(key, m);
      last = key + 1 < size ? KeyStart(key + 1, m) - 1 : bound - 1;
    }
    while (low + 1 < experts && col[low + 1] <= first) ++low;
    high = std::max(high, low);
    while (high + 1 < experts && col[high + 1] <= last) ++high;
    steps = std::max(steps, static_cast<int>(high - low));
    if (guess) (*guess)[key] = static_cast<uint16_t>(low);
  }
  return steps;
}

Context* NewContext(int64_t experts, int64_t top_k) {
  if (experts < 1 || experts > kMaxExperts || top_k < 1 || top_k > experts) return nullptr;
  if ((top_k + 1) * experts > kMaxTable) return nullptr;
  const int e = static_cast<int>(experts), k = static_cast<int>(top_k);
  // Pascal's triangle, saturated: binom[j][n] = C(n, j) for n in [0, E].
  std::vector<std::vector<u128>> binom(k + 1, std::vector<u128>(e + 1, 0));
  for (int n = 0; n <= e; ++n) binom[0][n] = 1;
  for (int j = 1; j <= k; ++j)
    for (int n = 1; n <= e; ++n) binom[j][n] = SatAdd(binom[j][n - 1], binom[j - 1][n - 1]);
  const u128 padding = binom[k][e];
  if (padding == kU128Max) return nullptr;  // C(E, k) >= 2^128 - 1: more than 128 bits
  auto* ctx = new Context();
  ctx->experts = e;
  ctx->top_k = k;
  ctx->padding = padding;
  ctx->bits = BitLength(padding);
  const bool wide = ctx->bits > 64;
  (wide ? static_cast<void>(ctx->rank128.resize(k + 1)) : ctx->rank64.resize(k + 1));
  for (int j = 1; j <= k; ++j) {
    if (wide) {
      ctx->rank128[j].assign(binom[j].begin(), binom[j].end() - 1);
    } else {
      ctx->rank64[j].resize(e);
      for (int n = 0; n < e; ++n) ctx->rank64[j][n] = static_cast<u64>(std::min<u128>(binom[j][n], kU64Max));
    }
  }
  if (k <= kMaxNetwork) ctx->network = Batcher(k);
  // The rest before level 2 is below C(E, 2) and below C(E, k).
  const u128 pairs = k >= 2 ? std::min(binom[2][e], padding) : 0;
  if (k >= 2 && pairs <= kMaxLastTwo) {
    ctx->last_two.resize(static_cast<size_t>(pairs));
    for (u64 c1 = 1, v = 0; c1 < static_cast<u64>(e) && v < pairs; ++c1)
      for (u64 c0 = 0; c0 < c1 && v < pairs; ++c0, ++v) ctx->last_two[v] = static_cast<u32>(c0 | c1 << 16);
  }
  ctx->levels.resize(k + 1);
  for (int j = 2; j <= k; ++j) {
    Level& level = ctx->levels[j];
    // At level j the remaining rank is below C(E, j) and below C(E, k).
    const u128 bound = std::min(binom[j][e], padding);
    level.wide = bound - 1 > kU64Max;
    level.float_key = bound <= (u128{1} << 62);
    std::vector<u128> col(binom[j].begin(), binom[j].end() - 1);
    int m = 2;
    while (m < kMaxKeyBits && PlanTable(col, bound, m, level.float_key, nullptr) > 1) ++m;
    level.m = m;
    level.steps = PlanTable(col, bound, m, level.float_key, &level.guess);
    for (int c = 0; c < e; ++c) {
      if (level.wide) {
        level.pairs128.push_back({binom[j][c], binom[j][c + 1]});
      } else {
        level.pairs64.push_back({static_cast<u64>(std::min<u128>(binom[j][c], kU64Max)),
                                 static_cast<u64>(std::min<u128>(binom[j][c + 1], kU64Max))});
      }
    }
  }
  return ctx;
}

}  // namespace
