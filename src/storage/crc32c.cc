#include "storage/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace jaxtrain::storage {
namespace {

constexpr uint32_t kPolynomial = 0x82f63b78;  // reflected Castagnoli

std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPolynomial : c >> 1;
    table[i] = c;
  }
  return table;
}

uint32_t Software(uint32_t crc, const unsigned char* p, size_t n) {
  static const std::array<uint32_t, 256> kTable = MakeTable();
  for (size_t i = 0; i < n; ++i) crc = kTable[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
// clang 14 and later hold the crc32 instructions apart from the rest of SSE 4.2.
__attribute__((target("sse4.2,crc32"))) uint32_t Hardware(uint32_t crc, const unsigned char* p,
                                                          size_t n) {
  uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = _mm_crc32_u8(c32, *p);
  return c32;
}
#endif

}  // namespace

uint32_t Crc32c(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  static const bool kHasSse42 = __builtin_cpu_supports("sse4.2");
  crc = kHasSse42 ? Hardware(crc, p, n) : Software(crc, p, n);
#else
  crc = Software(crc, p, n);
#endif
  return ~crc;
}

}  // namespace jaxtrain::storage
