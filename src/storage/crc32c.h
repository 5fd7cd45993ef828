// CRC-32C (Castagnoli), the checksum of checkpoint manifests. Uses the SSE4.2 instruction when the
// CPU has it, a table otherwise; both give the same values. Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

namespace jaxtrain::storage {

// Extends `crc` (0 to start) with `n` bytes.
uint32_t Crc32c(uint32_t crc, const void* data, size_t n);

}  // namespace jaxtrain::storage
