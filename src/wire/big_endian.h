// Big-endian (network order) 32-bit integers in byte strings, as the frame and handshake formats
// encode them (docs/wire.md). Internal to the wire component.
#pragma once

#include <cstdint>
#include <string>

namespace jaxtrain::wire {

inline void PutU32(std::string* out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out->push_back(static_cast<char>(v >> shift));
}

// The 4 bytes at `p`, which the caller has checked are there.
inline uint32_t GetU32(const char* p) {
  const auto* u = reinterpret_cast<const unsigned char*>(p);
  return (uint32_t{u[0]} << 24) | (uint32_t{u[1]} << 16) | (uint32_t{u[2]} << 8) | u[3];
}

}  // namespace jaxtrain::wire
