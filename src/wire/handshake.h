// Mutual authentication by the run's secret, before anything else crosses the connection.
//
//   worker -> controller  kHello:     magic "JXTR", version, rank, attempt, pid, worker nonce
//   controller -> worker  kChallenge: controller nonce, HMAC(secret, "controller" | hello |
//   nonce_c) worker -> controller  kAuth:      HMAC(secret, "worker" | hello | nonce_c)
//
// Each side proves it holds the secret without sending it, and each proof covers both fresh
// nonces, so a recorded handshake cannot be replayed. The worker checks the controller's proof
// before it accepts any other frame; the controller parses nothing but these fixed-size bodies
// from a peer that has not proven itself. HMAC-SHA-256 (libsodium). Thread-safe (pure functions).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "base/status.h"

namespace jaxtrain::wire {

constexpr size_t kSecretSize = 32;
constexpr size_t kNonceSize = 32;
constexpr size_t kMacSize = 32;
constexpr uint16_t kProtocolVersion = 1;

using Nonce = std::array<uint8_t, kNonceSize>;
using Mac = std::array<uint8_t, kMacSize>;

struct Hello {
  uint32_t rank = 0;
  uint32_t attempt = 0;  // the incarnation: a worker of an earlier attempt is refused
  uint32_t pid = 0;
  Nonce nonce{};
};
constexpr size_t kHelloSize = 4 + 2 + 4 + 4 + 4 + kNonceSize;
constexpr size_t kChallengeSize = kNonceSize + kMacSize;
constexpr size_t kAuthSize = kMacSize;

// A fresh random secret (kSecretSize bytes) for a run.
std::string GenerateSecret();
Nonce GenerateNonce();

std::string EncodeHello(const Hello& hello);
// Errors: kUnauthenticated for a body of the wrong size, a wrong magic or protocol version.
StatusOr<Hello> DecodeHello(std::string_view body);

// The controller's proof; the kChallenge body is nonce_c followed by this MAC.
Mac ControllerProof(std::string_view secret, const Hello& hello, const Nonce& controller_nonce);
// The worker's proof; the kAuth body.
Mac WorkerProof(std::string_view secret, const Hello& hello, const Nonce& controller_nonce);

// Constant-time comparison of a received MAC.
bool MacEquals(const Mac& expected, std::string_view received);

std::string ToHex(std::string_view bytes);
// Errors: kInvalidArgument for odd length or a non-hex digit.
StatusOr<std::string> FromHex(std::string_view hex);

}  // namespace jaxtrain::wire
