// SHA-256, the hash that checkpoint manifests vouch for copies with ("sha256", hex).
//
// Computed by OpenSSL's libcrypto, whose SHA-256 uses the CPU's SHA instructions where the CPU
// has them (x86 SHA extensions, ARMv8 SHA2): about five times the speed of a portable
// implementation. libcrypto is not linked in: it is loaded at first use (dlopen of
// libcrypto.so.3, else libcrypto.so.1.1), the copy that the process's Python already has loaded
// for hashlib, so that a wheel carries no OpenSSL of its own (auditwheel's manylinux policy
// does not allow linking it). Where neither can be loaded, libsodium's portable
// crypto_hash_sha256 computes the same values. The implementation is chosen once per process.
//
// Thread-safety: one object is used by one thread at a time; objects are independent.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace jaxtrain::storage {

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  // Extends the sum with `size` bytes at `data`.
  void Update(const void* data, size_t size);

  // The SHA-256 of everything passed to Update, as 64 lowercase hex digits. Ends the sum: the
  // object is not updated again.
  std::string HexDigest();

  // "openssl" or "libsodium": what computes the sums in this process (for benchmarks, logs).
  static const char* Implementation();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace jaxtrain::storage
