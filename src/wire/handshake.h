// Mutual authentication by the run's secret, before anything else crosses the connection.
//
//   worker -> controller  kHello:     magic "JXTR", version, rank, attempt, pid, worker nonce,
//                                     HMAC(secret, "hello" | those 50 bytes)
//   controller -> worker  kChallenge: controller nonce, HMAC(secret, "controller" | hello |
//   nonce_c) worker -> controller  kAuth:      HMAC(secret, "worker" | hello | nonce_c)
//
// Each side proves it holds the secret without sending it, and each proof covers both fresh
// nonces, so a recorded handshake cannot be replayed. The hello's own MAC is the cheap first proof:
// the controller answers only hellos made with the secret, so a peer without it never holds more
// than a connection that has sent nothing valid (controller/control_port.h says how those are
// bounded); a recorded hello is valid again only within its run and attempt, and the controller
// refuses a worker nonce it has already seen. The worker checks the controller's proof before it
// accepts any other frame; the controller parses nothing but these fixed-size bodies from a peer
// that has not proven itself. HMAC-SHA-256 (libsodium). Thread-safe (pure functions).
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
constexpr uint16_t kProtocolVersion = 3;  // 3: frames after the handshake are sealed (frame.h)

using Nonce = std::array<uint8_t, kNonceSize>;
using Mac = std::array<uint8_t, kMacSize>;

struct Hello {
  uint32_t rank = 0;
  uint32_t attempt = 0;  // the incarnation: a worker of an earlier attempt is refused
  uint32_t pid = 0;
  Nonce nonce{};
};
constexpr size_t kHelloFieldsSize = 4 + 2 + 4 + 4 + 4 + kNonceSize;
constexpr size_t kHelloSize = kHelloFieldsSize + kMacSize;
constexpr size_t kChallengeSize = kNonceSize + kMacSize;
constexpr size_t kAuthSize = kMacSize;

// A fresh random secret (kSecretSize bytes) for a run.
std::string GenerateSecret();
Nonce GenerateNonce();

// The kHello body, MAC'd with `secret`.
std::string EncodeHello(const Hello& hello, std::string_view secret);
// Errors: kUnauthenticated for a body of the wrong size, a wrong magic or protocol version, or a
// MAC not made with `secret`.
StatusOr<Hello> DecodeHello(std::string_view body, std::string_view secret);

// The controller's proof; the kChallenge body is nonce_c followed by this MAC.
Mac ControllerProof(std::string_view secret, const Hello& hello, const Nonce& controller_nonce);
// The worker's proof; the kAuth body.
Mac WorkerProof(std::string_view secret, const Hello& hello, const Nonce& controller_nonce);

// HMAC-SHA-256 of `message` under `key` (the handshakes' and the secure channel's MAC).
Mac Hmac(std::string_view key, std::string_view message);

// Constant-time comparison of a received MAC.
bool MacEquals(const Mac& expected, std::string_view received);

std::string ToHex(std::string_view bytes);
// Errors: kInvalidArgument for odd length or a non-hex digit.
StatusOr<std::string> FromHex(std::string_view hex);

}  // namespace jaxtrain::wire
