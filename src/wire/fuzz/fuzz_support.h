// Shared by the fuzz targets and make_corpus.cc: a check that fails the fuzz run, and the fixed
// handshake the harnesses assume, so that the seed corpus can hold proofs that verify.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include "wire/channel.h"
#include "wire/handshake.h"

// Aborts (libFuzzer then saves the input as a crash) when an invariant of the code under test does
// not hold.
#define JT_FUZZ_CHECK(cond)                                                                  \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      std::fprintf(stderr, "%s:%d: fuzz invariant failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                          \
    }                                                                                        \
  } while (0)

namespace jaxtrain::wire::fuzz {

// The run's secret and the controller's nonce in every harness (the controller draws both at
// random; a harness must be deterministic).
inline std::string FixedSecret() { return std::string(kSecretSize, '\x5a'); }

inline Nonce FixedControllerNonce() {
  Nonce n{};
  for (size_t i = 0; i < n.size(); ++i) n[i] = static_cast<uint8_t>(0xc0 + i);
  return n;
}

// The hello of the seed conversations: rank 1 of attempt 0.
inline Hello SeedHello() {
  Hello h{.rank = 1, .attempt = 0, .pid = 4242};
  for (size_t i = 0; i < h.nonce.size(); ++i) h.nonce[i] = static_cast<uint8_t>(i * 7 + 1);
  return h;
}

// The secure channel's ends, initiator nonce and record keys in the channel harness.
inline ChannelEnds FixedEnds() {
  return {.purpose = "jaxtrain-join", .initiator = "host-1", .responder = "host-0"};
}

inline Nonce FixedChannelNonce() {
  Nonce n{};
  for (size_t i = 0; i < n.size(); ++i) n[i] = static_cast<uint8_t>(0x30 + i);
  return n;
}

inline Mac FixedKey(uint8_t seed) {
  Mac k{};
  for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<uint8_t>(seed * 31 + i);
  return k;
}

}  // namespace jaxtrain::wire::fuzz
