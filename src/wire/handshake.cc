#include "wire/handshake.h"

#include <sodium.h>

#include <cstring>

#include "wire/big_endian.h"

namespace jaxtrain::wire {
namespace {

void InitSodium() {
  static const int kInit = sodium_init();
  (void)kInit;
}

// The hello's fields, without its MAC.
std::string HelloFields(const Hello& hello) {
  std::string out = "JXTR";
  out.push_back(static_cast<char>(kProtocolVersion >> 8));
  out.push_back(static_cast<char>(kProtocolVersion & 0xff));
  PutU32(&out, hello.rank);
  PutU32(&out, hello.attempt);
  PutU32(&out, hello.pid);
  out.append(reinterpret_cast<const char*>(hello.nonce.data()), hello.nonce.size());
  return out;
}

Mac HelloMac(std::string_view secret, std::string_view fields) {
  return Hmac(secret, "jaxtrain-hello" + std::string(fields));
}

Mac Proof(std::string_view role, std::string_view secret, const Hello& hello,
          const Nonce& controller_nonce) {
  std::string message(role);
  message += EncodeHello(hello, secret);
  message.append(reinterpret_cast<const char*>(controller_nonce.data()), controller_nonce.size());
  return Hmac(secret, message);
}

}  // namespace

Mac Hmac(std::string_view secret, std::string_view message) {
  InitSodium();
  Mac mac{};
  crypto_auth_hmacsha256_state state;
  crypto_auth_hmacsha256_init(&state, reinterpret_cast<const unsigned char*>(secret.data()),
                              secret.size());
  crypto_auth_hmacsha256_update(&state, reinterpret_cast<const unsigned char*>(message.data()),
                                message.size());
  crypto_auth_hmacsha256_final(&state, mac.data());
  return mac;
}

std::string GenerateSecret() {
  InitSodium();
  std::string secret(kSecretSize, '\0');
  randombytes_buf(secret.data(), secret.size());
  return secret;
}

Nonce GenerateNonce() {
  InitSodium();
  Nonce n{};
  randombytes_buf(n.data(), n.size());
  return n;
}

std::string EncodeHello(const Hello& hello, std::string_view secret) {
  std::string out = HelloFields(hello);
  Mac mac = HelloMac(secret, out);
  out.append(reinterpret_cast<const char*>(mac.data()), mac.size());
  return out;
}

StatusOr<Hello> DecodeHello(std::string_view body, std::string_view secret) {
  if (body.size() != kHelloSize) {
    return UnauthenticatedError("hello of " + std::to_string(body.size()) + " bytes, expected " +
                                std::to_string(kHelloSize));
  }
  if (body.substr(0, 4) != "JXTR") return UnauthenticatedError("hello without the JXTR magic");
  uint16_t version =
      static_cast<uint16_t>((static_cast<uint8_t>(body[4]) << 8) | static_cast<uint8_t>(body[5]));
  if (version != kProtocolVersion) {
    return UnauthenticatedError("protocol version " + std::to_string(version) + ", expected " +
                                std::to_string(kProtocolVersion) +
                                " (are the driver and the worker the same jaxtrain version?)");
  }
  Hello h;
  h.rank = GetU32(body.data() + 6);
  h.attempt = GetU32(body.data() + 10);
  h.pid = GetU32(body.data() + 14);
  std::memcpy(h.nonce.data(), body.data() + 18, kNonceSize);
  if (!MacEquals(HelloMac(secret, body.substr(0, kHelloFieldsSize)),
                 body.substr(kHelloFieldsSize))) {
    return UnauthenticatedError("the hello's MAC was not made with this run's secret");
  }
  return h;
}

Mac ControllerProof(std::string_view secret, const Hello& hello, const Nonce& controller_nonce) {
  return Proof("jaxtrain-controller", secret, hello, controller_nonce);
}

Mac WorkerProof(std::string_view secret, const Hello& hello, const Nonce& controller_nonce) {
  return Proof("jaxtrain-worker", secret, hello, controller_nonce);
}

bool MacEquals(const Mac& expected, std::string_view received) {
  return received.size() == kMacSize &&
         sodium_memcmp(expected.data(), received.data(), kMacSize) == 0;
}

std::string ToHex(std::string_view bytes) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 0xf]);
  }
  return out;
}

StatusOr<std::string> FromHex(std::string_view hex) {
  auto value = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (hex.size() % 2 != 0) return InvalidArgumentError("hex string of odd length");
  std::string out;
  out.reserve(hex.size() / 2);
  for (size_t i = 0; i < hex.size(); i += 2) {
    int hi = value(hex[i]), lo = value(hex[i + 1]);
    if (hi < 0 || lo < 0) return InvalidArgumentError("non-hex digit in hex string");
    out.push_back(static_cast<char>(hi << 4 | lo));
  }
  return out;
}

}  // namespace jaxtrain::wire
