#include "wire/handshake.h"

#include <gtest/gtest.h>

namespace jaxtrain::wire {
namespace {

TEST(HandshakeTest, HelloRoundTrips) {
  std::string secret = GenerateSecret();
  Hello h{.rank = 3, .attempt = 2, .pid = 4242, .nonce = GenerateNonce()};
  std::string body = EncodeHello(h, secret);
  ASSERT_EQ(body.size(), kHelloSize);
  auto back = DecodeHello(body, secret);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->rank, 3u);
  EXPECT_EQ(back->attempt, 2u);
  EXPECT_EQ(back->pid, 4242u);
  EXPECT_EQ(back->nonce, h.nonce);
}

TEST(HandshakeTest, HelloWithWrongSizeOrMagicIsUnauthenticated) {
  const std::string secret = GenerateSecret();
  EXPECT_EQ(DecodeHello("short", secret).status().code(), StatusCode::kUnauthenticated);
  std::string body = EncodeHello(Hello{}, secret);
  body[0] = 'X';
  EXPECT_EQ(DecodeHello(body, secret).status().code(), StatusCode::kUnauthenticated);
  body = EncodeHello(Hello{}, secret);
  body[5] = 9;
  auto s = DecodeHello(body, secret).status();
  EXPECT_EQ(s.code(), StatusCode::kUnauthenticated);
  EXPECT_NE(s.message().find("protocol version"), std::string::npos);
}

TEST(HandshakeTest, HelloMadeWithoutTheSecretOrAlteredIsUnauthenticated) {
  const std::string secret = GenerateSecret();
  Hello h{.rank = 1, .attempt = 4, .pid = 7, .nonce = GenerateNonce()};
  // A hello of another run (another secret), e.g. a recorded one replayed.
  auto s = DecodeHello(EncodeHello(h, GenerateSecret()), secret).status();
  EXPECT_EQ(s.code(), StatusCode::kUnauthenticated);
  EXPECT_NE(s.message().find("secret"), std::string::npos) << s.message();
  // Every field is covered: a changed rank, attempt or nonce, or a changed MAC byte, fails.
  for (size_t at : {size_t{9}, size_t{13}, size_t{20}, kHelloSize - 1}) {
    std::string body = EncodeHello(h, secret);
    body[at] = static_cast<char>(body[at] ^ 1);
    EXPECT_EQ(DecodeHello(body, secret).status().code(), StatusCode::kUnauthenticated) << at;
  }
}

TEST(HandshakeTest, ProofsVerifyOnlyWithTheSameSecretAndNonces) {
  std::string secret = GenerateSecret();
  Hello h{.rank = 1, .attempt = 0, .pid = 1, .nonce = GenerateNonce()};
  Nonce nc = GenerateNonce();
  Mac proof = WorkerProof(secret, h, nc);
  std::string received(reinterpret_cast<const char*>(proof.data()), proof.size());
  EXPECT_TRUE(MacEquals(WorkerProof(secret, h, nc), received));
  EXPECT_FALSE(MacEquals(WorkerProof(GenerateSecret(), h, nc), received));
  EXPECT_FALSE(MacEquals(WorkerProof(secret, h, GenerateNonce()), received));
  Hello other = h;
  other.rank = 2;
  EXPECT_FALSE(MacEquals(WorkerProof(secret, other, nc), received));
  // The controller's proof is not a worker's proof.
  EXPECT_FALSE(MacEquals(ControllerProof(secret, h, nc), received));
  EXPECT_FALSE(MacEquals(proof, received.substr(1)));
}

TEST(HexTest, RoundTripsAndRejectsBadInput) {
  std::string bytes("\x00\x7f\xff", 3);
  EXPECT_EQ(ToHex(bytes), "007fff");
  EXPECT_EQ(*FromHex("007FFF"), bytes);
  EXPECT_EQ(FromHex("abc").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(FromHex("zz").status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace jaxtrain::wire
