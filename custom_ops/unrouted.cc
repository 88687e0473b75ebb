// The unrouted-token count of a record, in the Paddle-free C library (fdrr_native.so).
//
// A record's ids are [layers, tokens, top_k] unsigned ints (uint8/uint16/uint32); a token is
// unrouted when any of its ids, in any layer, is the fill value (routing lost during
// capture).  The writer stamps the count on every record it builds from the engine's rows
// (fd_routing_replay/writer/record.py), so this is one pass at memory speed: NumPy's
// (ids == fill).any(...) takes ~20x a memcpy of a 15 MB record.  Called through ctypes
// (GIL released).
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

namespace {

// mask[t] |= token t has an element equal to `fill`, in layer rows of WORDS 64-bit words
// (WORDS == 0: `words` at run time): the classic has-zero-lane test on (word ^ fill in every
// lane), branch-free, so the token loop vectorises.
template <typename T, int WORDS>
void MarkWords(const unsigned char* data, int64_t layers, int64_t tokens, int64_t words, T fill,
               uint8_t* mask) {
  const uint64_t ones = sizeof(T) == 1 ? 0x0101010101010101ULL
                      : sizeof(T) == 2 ? 0x0001000100010001ULL : 0x0000000100000001ULL;
  const uint64_t highs = ones << (8 * sizeof(T) - 1);
  const uint64_t pattern = ones * static_cast<uint64_t>(fill);   // the fill in every lane
  const int64_t n = WORDS > 0 ? WORDS : words;
  for (int64_t l = 0; l < layers; ++l) {
    const unsigned char* base = data + l * tokens * n * 8;
    for (int64_t t = 0; t < tokens; ++t) {
      uint64_t hit = 0;
      for (int64_t w = 0; w < n; ++w) {
        uint64_t word;
        std::memcpy(&word, base + (t * n + w) * 8, 8);
        const uint64_t x = word ^ pattern;   // a zero lane: an element equal to the fill
        hit |= (x - ones) & ~x & highs;
      }
      mask[t] |= static_cast<uint8_t>(hit != 0);
    }
  }
}

template <typename T>
void MarkUnrouted(const unsigned char* data, int64_t layers, int64_t tokens, int64_t top_k, T fill,
                  uint8_t* mask) {
  const int64_t row_bytes = top_k * static_cast<int64_t>(sizeof(T));
  if (row_bytes % 8 == 0) {
    switch (row_bytes / 8) {
      case 1: return MarkWords<T, 1>(data, layers, tokens, 1, fill, mask);   // e.g. top-8 uint8
      case 2: return MarkWords<T, 2>(data, layers, tokens, 2, fill, mask);
      default: return MarkWords<T, 0>(data, layers, tokens, row_bytes / 8, fill, mask);
    }
  }
  for (int64_t l = 0; l < layers; ++l) {
    const T* base = reinterpret_cast<const T*>(data) + l * tokens * top_k;
    for (int64_t t = 0; t < tokens; ++t) {
      const T* row = base + t * top_k;
      uint8_t hit = 0;
      for (int64_t k = 0; k < top_k; ++k) hit |= static_cast<uint8_t>(row[k] == fill);
      mask[t] |= hit;
    }
  }
}

}  // namespace

extern "C" {

// Tokens of the C-contiguous [layers, tokens, top_k] array `ids` (elements of `itemsize`
// bytes: 1, 2 or 4) with `fill` in some layer; -2 for an unsupported size or fill, -3 when
// out of memory.
int64_t fdrr_count_unrouted(const void* ids, int64_t layers, int64_t tokens, int64_t top_k, int64_t itemsize,
                            uint64_t fill) {
  if (layers < 0 || tokens < 0 || top_k < 0 || (itemsize != 1 && itemsize != 2 && itemsize != 4) ||
      fill >> (8 * itemsize) != 0) {
    return -2;
  }
  if (tokens == 0) return 0;
  std::vector<uint8_t> mask;
  try {
    mask.assign(static_cast<size_t>(tokens), 0);
  } catch (const std::bad_alloc&) {
    return -3;
  }
  const auto* data = static_cast<const unsigned char*>(ids);
  switch (itemsize) {
    case 1: MarkUnrouted<uint8_t>(data, layers, tokens, top_k, static_cast<uint8_t>(fill), mask.data()); break;
    case 2: MarkUnrouted<uint16_t>(data, layers, tokens, top_k, static_cast<uint16_t>(fill), mask.data()); break;
    default: MarkUnrouted<uint32_t>(data, layers, tokens, top_k, static_cast<uint32_t>(fill), mask.data()); break;
  }
  int64_t count = 0;
  for (uint8_t m : mask) count += m;
  return count;
}

}  // extern "C"
