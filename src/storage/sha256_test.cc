#include "storage/sha256.h"

#include <gtest/gtest.h>

#include <string>

namespace jaxtrain::storage {
namespace {

std::string HexOf(const std::string& data) {
  Sha256 sum;
  sum.Update(data.data(), data.size());
  return sum.HexDigest();
}

TEST(Sha256Test, GivesTheStandardsTestVectors) {
  // FIPS 180-2, appendix B.
  EXPECT_EQ(HexOf(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(HexOf("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(HexOf("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(HexOf(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256Test, PiecesGiveTheSumOfTheWhole) {
  std::string data;
  for (int i = 0; i < 3 << 20; ++i) data.push_back(static_cast<char>(i * 131 % 251));
  Sha256 pieces;
  for (size_t done = 0, n = 1; done < data.size(); done += n, n = n * 3 + 7) {
    n = std::min(n, data.size() - done);
    pieces.Update(data.data() + done, n);
  }
  EXPECT_EQ(pieces.HexDigest(), HexOf(data));
}

TEST(Sha256Test, UsesOpenSslWhereTheHostHasIt) {
  // Every host the engine is built and tested on has libcrypto: the system's Python links it
  // for hashlib.
  EXPECT_STREQ(Sha256::Implementation(), "openssl");
}

}  // namespace
}  // namespace jaxtrain::storage
