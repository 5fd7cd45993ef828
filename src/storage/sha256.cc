#include "storage/sha256.h"

#include <dlfcn.h>
#include <sodium.h>

namespace jaxtrain::storage {
namespace {

// The few EVP functions used, with the signatures they have in OpenSSL 1.1 and 3 alike.
struct Evp {
  void* (*md_ctx_new)() = nullptr;
  void (*md_ctx_free)(void*) = nullptr;
  const void* (*sha256)() = nullptr;
  int (*digest_init_ex)(void*, const void*, void*) = nullptr;
  int (*digest_update)(void*, const void*, size_t) = nullptr;
  int (*digest_final_ex)(void*, unsigned char*, unsigned int*) = nullptr;
  const void* md = nullptr;  // EVP_sha256(): a static object of libcrypto's, never freed
};

template <typename F>
bool Resolve(void* library, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(library, name));
  return *out != nullptr;
}

// libcrypto's functions, loaded once; nullptr where no libcrypto could be loaded (or one lacks a
// function), and libsodium serves. The library is never unloaded.
const Evp* LoadEvp() {
  static const Evp* const kEvp = []() -> const Evp* {
    for (const char* name : {"libcrypto.so.3", "libcrypto.so.1.1"}) {
      void* library = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (library == nullptr) continue;
      static Evp evp;
      if (Resolve(library, "EVP_MD_CTX_new", &evp.md_ctx_new) &&
          Resolve(library, "EVP_MD_CTX_free", &evp.md_ctx_free) &&
          Resolve(library, "EVP_sha256", &evp.sha256) &&
          Resolve(library, "EVP_DigestInit_ex", &evp.digest_init_ex) &&
          Resolve(library, "EVP_DigestUpdate", &evp.digest_update) &&
          Resolve(library, "EVP_DigestFinal_ex", &evp.digest_final_ex) &&
          (evp.md = evp.sha256()) != nullptr) {
        return &evp;
      }
    }
    return nullptr;
  }();
  return kEvp;
}

}  // namespace

struct Sha256::State {
  const Evp* evp = nullptr;
  void* ctx = nullptr;  // evp's EVP_MD_CTX
  crypto_hash_sha256_state sodium;
};

Sha256::Sha256() : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.evp = LoadEvp();
  if (s.evp != nullptr) {
    s.ctx = s.evp->md_ctx_new();
    if (s.ctx != nullptr && s.evp->digest_init_ex(s.ctx, s.evp->md, nullptr) == 1) return;
    if (s.ctx != nullptr) s.evp->md_ctx_free(s.ctx);
    s.ctx = nullptr;  // out of memory in libcrypto: libsodium needs none
  }
  static const int kInit = sodium_init();  // once, before libsodium is used (>= 0: ready)
  (void)kInit;
  crypto_hash_sha256_init(&s.sodium);
}

Sha256::~Sha256() {
  if (state_->ctx != nullptr) state_->evp->md_ctx_free(state_->ctx);
}

void Sha256::Update(const void* data, size_t size) {
  State& s = *state_;
  if (s.ctx != nullptr) {
    // EVP_DigestUpdate fails only for a context that was never initialised.
    s.evp->digest_update(s.ctx, data, size);
  } else {
    crypto_hash_sha256_update(&s.sodium, static_cast<const unsigned char*>(data), size);
  }
}

std::string Sha256::HexDigest() {
  State& s = *state_;
  unsigned char digest[crypto_hash_sha256_BYTES];
  if (s.ctx != nullptr) {
    unsigned int n = 0;
    s.evp->digest_final_ex(s.ctx, digest, &n);
  } else {
    crypto_hash_sha256_final(&s.sodium, digest);
  }
  char hex[2 * sizeof(digest) + 1];
  sodium_bin2hex(hex, sizeof(hex), digest, sizeof(digest));
  return hex;
}

const char* Sha256::Implementation() { return LoadEvp() != nullptr ? "openssl" : "libsodium"; }

}  // namespace jaxtrain::storage
