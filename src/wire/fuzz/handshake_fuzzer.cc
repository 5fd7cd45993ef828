// Fuzzes what the controller parses from a peer that has not proven anything (handshake.h):
// DecodeHello (with the hello's MAC) on any body, MacEquals on any received proof, and the two as
// the controller chains them (the auth body checked against the proof for the hello it received),
// plus the hex codec that carries the run's secret to the workers. Each answer is checked against a
// reference written here. Which frame the controller accepts at which stage is fuzzed by
// frame_decoder_fuzzer.cc's model of the controller.
//
// Input: any bytes, taken whole by each function and also split into a hello (the first kHelloSize
// bytes) and the auth body that should prove it (the rest). corpus/handshake (from make_corpus.cc)
// holds such a pair whose proof verifies under the fixed secret and controller nonce of
// fuzz_support.h, so the accepting branch is reached too.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>

#include "wire/fuzz/fuzz_support.h"
#include "wire/handshake.h"

namespace jaxtrain::wire::fuzz {
namespace {

std::string_view View(const Mac& mac) {
  return {reinterpret_cast<const char*>(mac.data()), mac.size()};
}

// MacEquals on an exact-size heap copy of `received`, so AddressSanitizer sees any read past it.
bool MacEqualsExact(const Mac& expected, std::string_view received) {
  std::unique_ptr<char[]> copy(new char[received.size()]);
  if (!received.empty()) std::memcpy(copy.get(), received.data(), received.size());
  return MacEquals(expected, std::string_view(copy.get(), received.size()));
}

void CheckMacEquals(const Mac& expected, std::string_view received) {
  bool same = received == View(expected);
  JT_FUZZ_CHECK(MacEqualsExact(expected, received) == same);
}

uint32_t GetU32(std::string_view p) {
  const auto* u = reinterpret_cast<const unsigned char*>(p.data());
  return (uint32_t{u[0]} << 24) | (uint32_t{u[1]} << 16) | (uint32_t{u[2]} << 8) | u[3];
}

// The reference: a hello is accepted exactly when it is framed as version 3 and its MAC is the one
// the secret gives its fields.
void CheckDecodeHello(std::string_view body) {
  StatusOr<Hello> hello = DecodeHello(body, FixedSecret());
  bool framed = body.size() == kHelloSize && body.substr(0, 4) == "JXTR" &&
                body.substr(4, 2) == std::string_view("\x00\x03", 2);
  bool well_formed = false;
  if (framed) {
    Hello fields{.rank = GetU32(body.substr(6)),
                 .attempt = GetU32(body.substr(10)),
                 .pid = GetU32(body.substr(14))};
    std::memcpy(fields.nonce.data(), body.data() + 18, kNonceSize);
    well_formed = EncodeHello(fields, FixedSecret()) == body;
  }
  JT_FUZZ_CHECK(hello.ok() == well_formed);
  if (hello.ok()) {
    JT_FUZZ_CHECK(EncodeHello(*hello, FixedSecret()) == body);
  } else {
    JT_FUZZ_CHECK(hello.status().code() == StatusCode::kUnauthenticated);
  }
}

// The controller's two handshake steps on an unauthenticated peer's bodies.
void CheckHandshake(std::string_view hello_body, std::string_view auth_body) {
  StatusOr<Hello> hello = DecodeHello(hello_body, FixedSecret());
  if (!hello.ok()) return;
  Mac proof = WorkerProof(FixedSecret(), *hello, FixedControllerNonce());
  JT_FUZZ_CHECK(View(ControllerProof(FixedSecret(), *hello, FixedControllerNonce())) !=
                View(proof));
  CheckMacEquals(proof, auth_body);
}

bool IsHexDigit(char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

void CheckHex(std::string_view bytes) {
  StatusOr<std::string> decoded = FromHex(bytes);
  bool well_formed = bytes.size() % 2 == 0 && std::all_of(bytes.begin(), bytes.end(), IsHexDigit);
  JT_FUZZ_CHECK(decoded.ok() == well_formed);
  if (decoded.ok()) {
    std::string lower(bytes);
    std::transform(lower.begin(), lower.end(), lower.begin(),
                   [](char c) { return c >= 'A' && c <= 'F' ? static_cast<char>(c + 32) : c; });
    JT_FUZZ_CHECK(ToHex(*decoded) == lower);
  } else {
    JT_FUZZ_CHECK(decoded.status().code() == StatusCode::kInvalidArgument);
  }

  std::string hex = ToHex(bytes);
  JT_FUZZ_CHECK(hex.size() == 2 * bytes.size());
  StatusOr<std::string> back = FromHex(hex);
  JT_FUZZ_CHECK(back.ok() && *back == bytes);
}

void Run(std::string_view input) {
  static const Mac kSeedProof = WorkerProof(FixedSecret(), SeedHello(), FixedControllerNonce());
  CheckDecodeHello(input);
  CheckMacEquals(kSeedProof, input);
  CheckHandshake(input.substr(0, kHelloSize), input.substr(std::min(input.size(), kHelloSize)));
  CheckHex(input);
}

}  // namespace
}  // namespace jaxtrain::wire::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  jaxtrain::wire::fuzz::Run(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
