// XXH3-64 (seed 0, the default secret): the rr-v1 payload and header checksum
// (docs/record-format.md, "Checksum"), compiled into the Paddle-free library with the set
// codec and loaded with ctypes by fd_routing_replay/codec/checksum.py.  Written from the
// algorithm's public specification (xxHash's doc/xxhash_spec.md, "XXH3 Algorithm
// Description"); the tests compare it with the `xxhash` package on every length class.
//
// Inputs of 0-240 bytes take the short paths of the specification (scalar).  Longer inputs
// run the stripe loop in one of three kernels, chosen once per process from what the CPU
// supports: AVX-512 (one 512-bit accumulator), AVX2 (two 256-bit ones) or the portable
// scalar loop (any CPU).  The kernels hold the eight accumulators in registers across
// whole blocks; the long-input skeleton around them is shared.
//
// Entry points: fdrr_xxh3_64(data, length) hashes with the chosen kernel;
// fdrr_xxh3_64_with(data, length, kernel, out) with a given one (-2 when this CPU or
// build lacks it; for the tests); fdrr_xxh3_kernel() says which one is chosen
// (0 scalar, 1 AVX2, 2 AVX-512).
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#define FDRR_X86 1
#include <immintrin.h>
#endif

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "XXH3 reads little-endian words");

namespace {

using u8 = uint8_t;
using u32 = uint32_t;
using u64 = uint64_t;
using u128 = unsigned __int128;

constexpr u64 kPrime32_1 = 0x9E3779B1U;
constexpr u64 kPrime32_2 = 0x85EBCA77U;
constexpr u64 kPrime32_3 = 0xC2B2AE3DU;
constexpr u64 kPrime64_1 = 0x9E3779B185EBCA87ULL;
constexpr u64 kPrime64_2 = 0xC2B2AE3D27D4EB4FULL;
constexpr u64 kPrime64_3 = 0x165667B19E3779F9ULL;
constexpr u64 kPrime64_4 = 0x85EBCA77C2B2AE63ULL;
constexpr u64 kPrime64_5 = 0x27D4EB2F165667C5ULL;
constexpr u64 kPrimeMx1 = 0x165667919E3779F9ULL;
constexpr u64 kPrimeMx2 = 0x9FB21C651E98DF25ULL;

alignas(64) constexpr u8 kSecret[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};
constexpr size_t kSecretSize = sizeof(kSecret);
constexpr size_t kStripe = 64;
constexpr size_t kStripesPerBlock = (kSecretSize - 64) / 8;  // 16
constexpr size_t kBlock = kStripe * kStripesPerBlock;          // 1024
constexpr size_t kScrambleAt = kSecretSize - 64;               // the last 64 bytes
constexpr size_t kLastStripeAt = kSecretSize - 71;
constexpr size_t kMergeAt = 11;

inline u64 Read64(const u8* p) { u64 v; std::memcpy(&v, p, 8); return v; }
inline u32 Read32(const u8* p) { u32 v; std::memcpy(&v, p, 4); return v; }
inline u64 Rotl64(u64 x, int r) { return (x << r) | (x >> (64 - r)); }
inline u64 MulFold(u64 a, u64 b) {
  const u128 m = static_cast<u128>(a) * b;
  return static_cast<u64>(m) ^ static_cast<u64>(m >> 64);
}

inline u64 Avalanche(u64 x) {
  x ^= x >> 37;
  x *= kPrimeMx1;
  return x ^ (x >> 32);
}

inline u64 AvalancheXxh64(u64 x) {
  x ^= x >> 33;
  x *= kPrime64_2;
  x ^= x >> 29;
  x *= kPrime64_3;
  return x ^ (x >> 32);
}

// ------------------------------------------------------------------ 0 to 240 bytes

u64 Hash0To16(const u8* p, size_t n) {
  if (n > 8) {
    const u64 low = Read64(kSecret + 24) ^ Read64(kSecret + 32) ^ Read64(p);
    const u64 high = Read64(kSecret + 40) ^ Read64(kSecret + 48) ^ Read64(p + n - 8);
    return Avalanche(n + __builtin_bswap64(low) + high + MulFold(low, high));
  }
  if (n >= 4) {
    const u64 combined = static_cast<u64>(Read32(p + n - 4)) | static_cast<u64>(Read32(p)) << 32;
    u64 value = (Read64(kSecret + 8) ^ Read64(kSecret + 16)) ^ combined;
    value ^= Rotl64(value, 49) ^ Rotl64(value, 24);
    value *= kPrimeMx2;
    value ^= (value >> 35) + n;
    value *= kPrimeMx2;
    return value ^ (value >> 28);
  }
  if (n > 0) {
    const u32 combined = static_cast<u32>(p[n - 1]) | static_cast<u32>(n) << 8 |
                         static_cast<u32>(p[0]) << 16 | static_cast<u32>(p[n >> 1]) << 24;
    return AvalancheXxh64(static_cast<u64>(Read32(kSecret) ^ Read32(kSecret + 4)) ^ combined);
  }
  return AvalancheXxh64(Read64(kSecret + 56) ^ Read64(kSecret + 64));
}

inline u64 Mix16(const u8* p, const u8* secret) {
  return MulFold(Read64(p) ^ Read64(secret), Read64(p + 8) ^ Read64(secret + 8));
}

u64 Hash17To128(const u8* p, size_t n) {
  u64 acc = n * kPrime64_1;
  for (ptrdiff_t i = static_cast<ptrdiff_t>((n - 1) >> 5); i >= 0; --i) {
    acc += Mix16(p + 16 * i, kSecret + 32 * i);
    acc += Mix16(p + n - 16 * i - 16, kSecret + 32 * i + 16);
  }
  return Avalanche(acc);
}

u64 Hash129To240(const u8* p, size_t n) {
  u64 acc = n * kPrime64_1;
  for (size_t i = 0; i < 8; ++i) acc += Mix16(p + 16 * i, kSecret + 16 * i);
  acc = Avalanche(acc);
  for (size_t i = 8; i < (n >> 4); ++i) acc += Mix16(p + 16 * i, kSecret + 16 * (i - 8) + 3);
  acc += Mix16(p + n - 16, kSecret + 119);
  return Avalanche(acc);
}

// ------------------------------------------------------------------ the stripe kernels
// Each kernel: Blocks(acc, p, count) runs `count` full blocks (16 stripes, then the
// scramble); Stripes(acc, p, count, secret) accumulates `count` stripes, the secret
// advancing 8 bytes a stripe, without a scramble.

struct Scalar {
  static inline void Stripe(u64* acc, const u8* p, const u8* secret) {
    for (int i = 0; i < 8; ++i) {
      const u64 data = Read64(p + 8 * i);
      const u64 key = data ^ Read64(secret + 8 * i);
      acc[i ^ 1] += data;
      acc[i] += (key & 0xFFFFFFFFULL) * (key >> 32);
    }
  }
  static void Stripes(u64* acc, const u8* p, size_t count, const u8* secret) {
    for (size_t s = 0; s < count; ++s) Stripe(acc, p + s * kStripe, secret + 8 * s);
  }
  static void Blocks(u64* acc, const u8* p, size_t count) {
    for (size_t b = 0; b < count; ++b, p += kBlock) {
      Stripes(acc, p, kStripesPerBlock, kSecret);
      for (int i = 0; i < 8; ++i) {
        u64 a = acc[i];
        a ^= a >> 47;
        a ^= Read64(kSecret + kScrambleAt + 8 * i);
        acc[i] = a * kPrime32_1;
      }
    }
  }
};

#ifdef FDRR_X86
// How far ahead of the stripe being hashed the kernels ask for data: 8 KiB.  Hashing a
// 15 MB buffer that is not in L2, both kernels ran at ~0.7x the time of a memcpy of it with
// no prefetch and ~0.4x (the speed of a plain read loop) with 8-32 KiB; beyond 8 KiB
// inputs that fit L2 got slower (benchmarks/bench_codec.py's machine, docs/benchmarks.md).
constexpr size_t kPrefetch = 8192;

struct Avx2 {
  __attribute__((target("avx2"))) static inline void Stripe(__m256i& a0, __m256i& a1, const u8* p,
                                                            const u8* secret) {
    const __m256i d0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i d1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
    const __m256i k0 = _mm256_xor_si256(d0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(secret)));
    const __m256i k1 = _mm256_xor_si256(d1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(secret + 32)));
    // acc[i] += lo32(key) * hi32(key); acc[i ^ 1] += data[i]
    a0 = _mm256_add_epi64(a0, _mm256_mul_epu32(k0, _mm256_srli_epi64(k0, 32)));
    a1 = _mm256_add_epi64(a1, _mm256_mul_epu32(k1, _mm256_srli_epi64(k1, 32)));
    a0 = _mm256_add_epi64(a0, _mm256_shuffle_epi32(d0, _MM_SHUFFLE(1, 0, 3, 2)));
    a1 = _mm256_add_epi64(a1, _mm256_shuffle_epi32(d1, _MM_SHUFFLE(1, 0, 3, 2)));
  }
  __attribute__((target("avx2"))) static inline __m256i Scramble(__m256i a, const u8* secret) {
    const __m256i prime = _mm256_set1_epi64x(kPrime32_1);
    a = _mm256_xor_si256(_mm256_xor_si256(a, _mm256_srli_epi64(a, 47)),
                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(secret)));
    const __m256i low = _mm256_mul_epu32(a, prime);
    const __m256i high = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), prime);
    return _mm256_add_epi64(low, _mm256_slli_epi64(high, 32));
  }
  __attribute__((target("avx2"))) static void Stripes(u64* acc, const u8* p, size_t count,
                                                      const u8* secret) {
    __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc));
    __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + 4));
    for (size_t s = 0; s < count; ++s) Stripe(a0, a1, p + s * kStripe, secret + 8 * s);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc), a0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + 4), a1);
  }
  __attribute__((target("avx2"))) static void Blocks(u64* acc, const u8* p, size_t count) {
    __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc));
    __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + 4));
    for (size_t b = 0; b < count; ++b, p += kBlock) {
      for (size_t s = 0; s < kStripesPerBlock; ++s) {
        _mm_prefetch(reinterpret_cast<const char*>(p + s * kStripe + kPrefetch), _MM_HINT_T0);
        Stripe(a0, a1, p + s * kStripe, kSecret + 8 * s);
      }
      a0 = Scramble(a0, kSecret + kScrambleAt);
      a1 = Scramble(a1, kSecret + kScrambleAt + 32);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc), a0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + 4), a1);
  }
};

// GCC 12's avx512fintrin.h trips -Wuninitialized in its own helpers (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define FDRR_AVX512 __attribute__((target("avx512f")))
struct Avx512 {
  // The stripe is read as two 256-bit halves: with one 512-bit load per stripe, hashing
  // data that streams from L3 or memory took twice as long on AMD Zen (measured), in L2 the
  // same.
  FDRR_AVX512 static inline __m512i Stripe(__m512i a, const u8* p, const u8* secret) {
    const __m512i data = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)), 1);
    const __m512i key = _mm512_xor_si512(data, _mm512_loadu_si512(secret));
    a = _mm512_add_epi64(a, _mm512_mul_epu32(key, _mm512_srli_epi64(key, 32)));
    return _mm512_add_epi64(a, _mm512_shuffle_epi32(data, _MM_PERM_BADC));
  }
  FDRR_AVX512 static void Stripes(u64* acc, const u8* p, size_t count, const u8* secret) {
    __m512i a = _mm512_loadu_si512(acc);
    for (size_t s = 0; s < count; ++s) a = Stripe(a, p + s * kStripe, secret + 8 * s);
    _mm512_storeu_si512(acc, a);
  }
  FDRR_AVX512 static void Blocks(u64* acc, const u8* p, size_t count) {
    const __m512i prime = _mm512_set1_epi64(kPrime32_1);
    const __m512i scramble = _mm512_loadu_si512(kSecret + kScrambleAt);
    __m512i a = _mm512_loadu_si512(acc);
    for (size_t b = 0; b < count; ++b, p += kBlock) {
      for (size_t s = 0; s < kStripesPerBlock; ++s) {
        _mm_prefetch(reinterpret_cast<const char*>(p + s * kStripe + kPrefetch), _MM_HINT_T0);
        a = Stripe(a, p + s * kStripe, kSecret + 8 * s);
      }
      a = _mm512_xor_si512(_mm512_xor_si512(a, _mm512_srli_epi64(a, 47)), scramble);
      a = _mm512_add_epi64(_mm512_mul_epu32(a, prime),
                           _mm512_slli_epi64(_mm512_mul_epu32(_mm512_srli_epi64(a, 32), prime), 32));
    }
    _mm512_storeu_si512(acc, a);
  }
};
#endif  // FDRR_X86

// More than 240 bytes: full blocks, then the last block's stripes but its last, then the
// input's last 64 bytes as one stripe (it may overlap the stripes before it).
template <typename Kernel>
u64 HashLong(const u8* p, size_t n) {
  alignas(64) u64 acc[8] = {kPrime32_3, kPrime64_1, kPrime64_2, kPrime64_3,
                            kPrime64_4, kPrime32_2, kPrime64_5, kPrime32_1};
  const size_t blocks = (n - 1) / kBlock;
  Kernel::Blocks(acc, p, blocks);
  const size_t rest = n - blocks * kBlock;
  Kernel::Stripes(acc, p + blocks * kBlock, (rest - 1) / kStripe, kSecret);
  Kernel::Stripes(acc, p + n - kStripe, 1, kSecret + kLastStripeAt);
  u64 result = n * kPrime64_1;
  for (int i = 0; i < 4; ++i) {
    result += MulFold(acc[2 * i] ^ Read64(kSecret + kMergeAt + 16 * i),
                      acc[2 * i + 1] ^ Read64(kSecret + kMergeAt + 16 * i + 8));
  }
  return Avalanche(result);
}

enum Kernel : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

bool Supported(int64_t kernel) {
  if (kernel == kScalar) return true;
#ifdef FDRR_X86
  __builtin_cpu_init();
  if (kernel == kAvx2) return __builtin_cpu_supports("avx2");
  if (kernel == kAvx512) return __builtin_cpu_supports("avx512f");
#endif
  return false;
}

int64_t Best() {
  if (Supported(kAvx512)) return kAvx512;
  return Supported(kAvx2) ? kAvx2 : kScalar;
}

const int64_t kChosen = Best();

u64 Hash(const u8* p, size_t n, int64_t kernel) {
  if (n <= 16) return Hash0To16(p, n);
  if (n <= 128) return Hash17To128(p, n);
  if (n <= 240) return Hash129To240(p, n);
#ifdef FDRR_X86
  if (kernel == kAvx512) return HashLong<Avx512>(p, n);
  if (kernel == kAvx2) return HashLong<Avx2>(p, n);
#endif
  return HashLong<Scalar>(p, n);
}

}  // namespace

extern "C" {

uint64_t fdrr_xxh3_64(const void* data, int64_t length) {
  return Hash(static_cast<const u8*>(data), static_cast<size_t>(length), kChosen);
}

int64_t fdrr_xxh3_64_with(const void* data, int64_t length, int64_t kernel, uint64_t* out) {
  if (length < 0 || !Supported(kernel)) return -2;
  *out = Hash(static_cast<const u8*>(data), static_cast<size_t>(length), kernel);
  return 0;
}

int64_t fdrr_xxh3_kernel(void) { return kChosen; }

}  // extern "C"
