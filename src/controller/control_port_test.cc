#include "controller/control_port.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <functional>
#include <map>
#include <utility>
#include <vector>

#include "wire/handshake.h"
#include "wire/socket.h"

namespace jaxtrain::controller {
namespace {

using namespace std::chrono_literals;

// What the port told its owner, in order.
struct Recorder : ControlPort::Delegate {
  void OnFrame(int rank, const wire::FrameView& f) override {
    frames.push_back({rank, std::string(f.body)});
  }
  void OnBadFrame(int rank, const std::string& what) override { bad.push_back({rank, what}); }
  void OnClosed(int rank, bool timed_out) override { closed.push_back(rank); }
  void Say(const std::string& line) override { said.push_back(line); }
  std::vector<std::pair<int, std::string>> frames;
  std::vector<std::pair<int, std::string>> bad;
  std::vector<int> closed;
  std::vector<std::string> said;
};

// The port in this thread, with peers on real sockets that speak the handshake as a worker does.
class ControlPortTest : public ::testing::Test {
 protected:
  static constexpr size_t kWorld = 2;

  void SetUp() override {
    auto fd = wire::Listen("127.0.0.1", 0, &port_number_);
    ASSERT_TRUE(fd.ok()) << fd.status().ToString();
    auto port = ControlPort::Create(*fd, secret_, clock_, 10s, recorder_);
    ASSERT_TRUE(port.ok()) << port.status().ToString();
    port_ = std::move(*port);
    port_->BeginAttempt(/*attempt=*/0, kWorld);
  }
  void TearDown() override {
    port_.reset();
    for (int fd : peers_) close(fd);
  }

  // Runs the port's side, as the controller's loop does, until `done` or 10 s have passed.
  bool PumpUntil(const std::function<bool()>& done) {
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (!done()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      pollfd fds[] = {{port_->ready_fd(), POLLIN, 0}, {port_->listen_fd(), POLLIN, 0}};
      poll(fds, 2, 5);
      port_->OnConnsReady();
      port_->Accept();
      port_->ExpireHandshakes();
      port_->Sweep();
    }
    return true;
  }

  int Connect() {
    auto fd = wire::Connect({"127.0.0.1", port_number_}, 5s);
    EXPECT_TRUE(fd.ok()) << fd.status().ToString();
    peers_.push_back(*fd);
    return *fd;
  }

  // Sends a frame as a worker does: sealed once the peer's handshake is done.
  void SendFrame(int fd, wire::MessageType type, std::string_view body) {
    ASSERT_TRUE(wire::WriteAll(fd, Framed(fd, type, body)).ok());
  }
  std::string Framed(int fd, wire::MessageType type, std::string_view body) {
    auto session = sessions_.find(fd);
    if (session == sessions_.end()) return *wire::EncodeFrame(type, body);
    std::string frame;
    EXPECT_TRUE(session->second.Seal(type, body, &frame).ok());
    return frame;
  }

  // The next frame the peer receives while the port runs; nullopt when the peer's connection is
  // closed first (or 10 s pass).
  std::optional<wire::Frame> NextFrame(int fd) {
    auto [at, _] = decoders_.try_emplace(fd, wire::kMaxWorkerFrameBody);
    wire::FrameDecoder& decoder = at->second;
    std::optional<wire::Frame> frame;
    bool closed = false;
    PumpUntil([&] {
      char buf[4096];
      ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) closed = true;
      if (n > 0) {
        EXPECT_TRUE(decoder.Feed(std::string_view(buf, static_cast<size_t>(n))).ok());
      }
      auto next = decoder.Next();
      if (next.ok() && next->has_value()) frame = std::move(**next);
      if (auto session = sessions_.find(fd); frame && session != sessions_.end()) {
        auto opened = session->second.Open(frame->type, frame->body.data(), frame->body.size());
        EXPECT_TRUE(opened.ok()) << opened.status().ToString();
        if (!opened.ok() || !*opened) {
          frame.reset();  // a shared frame's key: the shared frame is next
        } else {
          frame->body.resize((*opened)->body.size());
        }
      }
      return frame.has_value() || closed;
    });
    return frame;
  }

  // Whether the peer's connection is closed by the port (within 10 s), frames before it skipped.
  bool ClosedByPort(int fd) {
    while (NextFrame(fd)) {
    }
    char c;
    return recv(fd, &c, 1, MSG_DONTWAIT) == 0;
  }

  // Sends a hello for `rank` and answers the challenge; true once the port answered it.
  bool Handshake(int fd, wire::Hello hello, const std::string& secret) {
    SendFrame(fd, wire::MessageType::kHello, wire::EncodeHello(hello, secret));
    std::optional<wire::Frame> challenge = NextFrame(fd);
    if (!challenge || challenge->type != wire::MessageType::kChallenge) return false;
    wire::Nonce nonce;
    std::copy_n(challenge->body.begin(), nonce.size(), nonce.begin());
    wire::Mac proof = wire::WorkerProof(secret, hello, nonce);
    SendFrame(fd, wire::MessageType::kAuth,
              std::string_view(reinterpret_cast<const char*>(proof.data()), proof.size()));
    sessions_[fd] = wire::SealedFrames(wire::ControlSession(
        secret, wire::EncodeHello(hello, secret), challenge->body, wire::SessionEnd::kInitiator));
    return true;
  }

  int Authenticated(uint32_t rank) {
    int fd = Connect();
    EXPECT_TRUE(Handshake(fd, {.rank = rank, .nonce = wire::GenerateNonce()}, secret_));
    EXPECT_TRUE(PumpUntil([&] { return port_->connected(static_cast<int>(rank)); }));
    return fd;
  }

  const std::string secret_ = wire::GenerateSecret();
  FakeClock clock_;
  Recorder recorder_;
  int port_number_ = 0;
  std::unique_ptr<ControlPort> port_;
  std::vector<int> peers_;
  std::map<int, wire::FrameDecoder> decoders_;  // by peer: what it has received, unread
  std::map<int, wire::SealedFrames> sessions_;  // by peer: its session, once its proof is sent
};

TEST_F(ControlPortTest, AWorkersHandshakeMakesTheConnectionItsRanksBothWays) {
  int fd = Authenticated(1);
  EXPECT_FALSE(port_->connected(0));
  SendFrame(fd, wire::MessageType::kRegister, "{\"host\":\"h\"}");
  ASSERT_TRUE(PumpUntil([&] { return !recorder_.frames.empty(); }));
  EXPECT_EQ(recorder_.frames[0], (std::pair<int, std::string>{1, "{\"host\":\"h\"}"}));

  port_->Send(1, wire::MessageType::kCheckpointSettled, "settled");
  port_->SendShared(1, *wire::SealShared(wire::MessageType::kPayload, "the payload"));
  port_->Send(0, wire::MessageType::kCheckpointSettled, "nobody");  // no connection: nothing
  auto settled = NextFrame(fd);
  ASSERT_TRUE(settled.has_value());
  EXPECT_EQ(settled->type, wire::MessageType::kCheckpointSettled);
  auto payload = NextFrame(fd);
  ASSERT_TRUE(payload.has_value());
  EXPECT_EQ(payload->body, "the payload");
  EXPECT_TRUE(recorder_.closed.empty());
}

// A worker sends its proof and its registration in one write (worker_client.h): the frame after
// the proof is read under the authenticated limit and reaches the owner.
TEST_F(ControlPortTest, ARegistrationInTheProofsSegmentIsDelivered) {
  int fd = Connect();
  wire::Hello hello{.rank = 0, .nonce = wire::GenerateNonce()};
  SendFrame(fd, wire::MessageType::kHello, wire::EncodeHello(hello, secret_));
  std::optional<wire::Frame> challenge = NextFrame(fd);
  ASSERT_TRUE(challenge && challenge->type == wire::MessageType::kChallenge);
  wire::Nonce nonce;
  std::copy_n(challenge->body.begin(), nonce.size(), nonce.begin());
  wire::Mac proof = wire::WorkerProof(secret_, hello, nonce);
  // Longer than the proof's own limit (32 bytes), so it is read under the authenticated one.
  const std::string registration = R"({"host":")" + std::string(100, 'h') + R"(","pid":1})";
  std::string both = *wire::EncodeFrame(
      wire::MessageType::kAuth,
      std::string_view(reinterpret_cast<const char*>(proof.data()), proof.size()));
  wire::SealedFrames session(wire::ControlSession(secret_, wire::EncodeHello(hello, secret_),
                                                  challenge->body, wire::SessionEnd::kInitiator));
  ASSERT_TRUE(session.Seal(wire::MessageType::kRegister, registration, &both).ok());
  ASSERT_TRUE(wire::WriteAll(fd, both).ok());
  ASSERT_TRUE(PumpUntil([&] { return !recorder_.frames.empty(); }));
  EXPECT_TRUE(port_->connected(0));
  EXPECT_EQ(recorder_.frames[0], (std::pair<int, std::string>{0, registration}));
  EXPECT_TRUE(recorder_.bad.empty());
}

// After the handshake only frames the rank's worker sealed, in order, are read: one that was
// changed, replayed, reordered or injected on the way (or sent in the clear) ends the connection
// before anything of it reaches the owner, with a status that says why.
TEST_F(ControlPortTest, AFrameNotSealedByTheWorkerAsItsNextEndsTheConnection) {
  const std::string report = *wire::EncodeFrame(wire::MessageType::kReport, "not sealed");
  // Each case: the bytes a peer on the path writes into rank 0's stream after `before` frames
  // its worker sealed (which are delivered).
  struct Case {
    std::string name;
    std::function<std::string(int fd)> bytes;
    size_t delivered;
  };
  const std::vector<Case> cases = {
      {"changed",
       [&](int fd) {
         std::string f = Framed(fd, wire::MessageType::kDone, "{}");
         f.back() ^= 1;
         return f;
       },
       0},
      {"retyped",
       [&](int fd) {
         std::string f = Framed(fd, wire::MessageType::kDone, "{}");
         f[4] = static_cast<char>(wire::MessageType::kError);
         return f;
       },
       0},
      {"replayed",
       [&](int fd) {
         std::string f = Framed(fd, wire::MessageType::kDone, "{}");
         return f + f;
       },
       1},
      {"reordered",
       [&](int fd) {
         std::string first = Framed(fd, wire::MessageType::kReport, "12345678{}");
         std::string second = Framed(fd, wire::MessageType::kDone, "{}");
         return second + first;
       },
       0},
      {"injected in the clear", [&](int) { return report; }, 0},
      {"injected from another session",
       [&](int) {
         wire::SealedFrames other(wire::ControlSession(secret_, "another hello", "challenge",
                                                       wire::SessionEnd::kInitiator));
         std::string f;
         EXPECT_TRUE(other.Seal(wire::MessageType::kDone, "{}", &f).ok());
         return f;
       },
       0},
  };
  uint32_t attempt = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    port_->BeginAttempt(static_cast<int>(++attempt), kWorld);
    recorder_ = Recorder();
    int fd = Connect();
    ASSERT_TRUE(
        Handshake(fd, {.rank = 0, .attempt = attempt, .nonce = wire::GenerateNonce()}, secret_));
    ASSERT_TRUE(PumpUntil([&] { return port_->connected(0); }));
    ASSERT_TRUE(wire::WriteAll(fd, c.bytes(fd)).ok());
    ASSERT_TRUE(PumpUntil([&] { return !recorder_.closed.empty(); }));
    EXPECT_FALSE(port_->connected(0));
    EXPECT_EQ(recorder_.frames.size(), c.delivered);
    ASSERT_EQ(recorder_.bad.size(), 1u);
    EXPECT_EQ(recorder_.bad[0].first, 0);
    EXPECT_NE(recorder_.bad[0].second.find("did not seal as its next one"), std::string::npos)
        << recorder_.bad[0].second;
    EXPECT_TRUE(ClosedByPort(fd));
  }
}

TEST_F(ControlPortTest, AHelloWithoutTheSecretIsRefusedUntold) {
  int fd = Connect();
  SendFrame(fd, wire::MessageType::kHello,
            wire::EncodeHello({.rank = 0, .nonce = wire::GenerateNonce()}, wire::GenerateSecret()));
  EXPECT_TRUE(ClosedByPort(fd));
  EXPECT_FALSE(port_->connected(0));
  ASSERT_FALSE(recorder_.said.empty());
  EXPECT_NE(recorder_.said[0].find("refused a control connection from 127.0.0.1"),
            std::string::npos)
      << recorder_.said[0];
}

TEST_F(ControlPortTest, AProvenHelloOfAnotherAttemptOrRankIsToldWhyItIsRefused) {
  for (wire::Hello hello : {wire::Hello{.rank = 0, .attempt = 1, .nonce = wire::GenerateNonce()},
                            wire::Hello{.rank = kWorld, .nonce = wire::GenerateNonce()}}) {
    int fd = Connect();
    SendFrame(fd, wire::MessageType::kHello, wire::EncodeHello(hello, secret_));
    auto refused = NextFrame(fd);
    ASSERT_TRUE(refused.has_value());
    EXPECT_EQ(refused->type, wire::MessageType::kRefused);
    EXPECT_NE(refused->body.find("is not part of this attempt (0)"), std::string::npos)
        << refused->body;
    EXPECT_TRUE(ClosedByPort(fd));
  }
}

TEST_F(ControlPortTest, ASecondConnectionOfARankAndAReplayedHelloAreRefused) {
  const wire::Hello hello{.rank = 0, .nonce = wire::GenerateNonce()};
  int first = Connect();
  ASSERT_TRUE(Handshake(first, hello, secret_));
  ASSERT_TRUE(PumpUntil([&] { return port_->connected(0); }));

  int again = Connect();  // a fresh hello of the same rank
  SendFrame(again, wire::MessageType::kHello,
            wire::EncodeHello({.rank = 0, .nonce = wire::GenerateNonce()}, secret_));
  auto refused = NextFrame(again);
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->body, "rank 0 is already connected");

  port_->Close(0);
  EXPECT_EQ(recorder_.closed, std::vector<int>{0});
  int replay = Connect();  // the recorded hello, once the rank has no connection
  SendFrame(replay, wire::MessageType::kHello, wire::EncodeHello(hello, secret_));
  EXPECT_TRUE(ClosedByPort(replay));
  EXPECT_FALSE(port_->connected(0));
  EXPECT_NE(recorder_.said.back().find("a replayed hello"), std::string::npos)
      << recorder_.said.back();
}

TEST_F(ControlPortTest, AWrongProofIsRefused) {
  int fd = Connect();
  const wire::Hello hello{.rank = 1, .nonce = wire::GenerateNonce()};
  SendFrame(fd, wire::MessageType::kHello, wire::EncodeHello(hello, secret_));
  auto challenge = NextFrame(fd);
  ASSERT_TRUE(challenge.has_value());
  SendFrame(fd, wire::MessageType::kAuth, std::string(wire::kAuthSize, 'x'));
  EXPECT_TRUE(ClosedByPort(fd));
  EXPECT_FALSE(port_->connected(1));
}

TEST_F(ControlPortTest, AFloodOfSilentConnectionsIsCappedAndAWorkerStillGetsThrough) {
  const size_t cap = ControlPort::MaxUnproven(kWorld);
  std::vector<int> silent;
  for (size_t i = 0; i < cap + 20; ++i) silent.push_back(Connect());
  int worker = Authenticated(0);
  EXPECT_TRUE(port_->connected(0));
  EXPECT_GE(port_->dropped(), 20);
  int closed = 0;
  for (int fd : silent) {
    char c;
    if (recv(fd, &c, 1, MSG_DONTWAIT) == 0) ++closed;
  }
  EXPECT_GE(closed, 20);  // the oldest, dropped to make room
  ASSERT_FALSE(recorder_.said.empty());
  EXPECT_NE(recorder_.said[0].find("have not sent a valid hello; dropping the oldest"),
            std::string::npos)
      << recorder_.said[0];
  (void)worker;
}

TEST_F(ControlPortTest, AHandshakeNotDoneByItsDeadlineIsClosed) {
  int authed = Authenticated(0);
  int silent = Connect();
  ASSERT_TRUE(PumpUntil([&] { return port_->NextDeadline().has_value(); }));
  EXPECT_EQ(*port_->NextDeadline(), clock_.Now() + 10s);
  clock_.Advance(9s);
  port_->ExpireHandshakes();
  char c;
  EXPECT_EQ(recv(silent, &c, 1, MSG_DONTWAIT), -1);  // still open
  clock_.Advance(1s);
  EXPECT_TRUE(ClosedByPort(silent));
  EXPECT_EQ(port_->dropped(), 1);
  EXPECT_FALSE(port_->NextDeadline().has_value());
  EXPECT_TRUE(port_->connected(0));  // an authenticated connection has no deadline
  (void)authed;
}

TEST_F(ControlPortTest, ARanksClosedConnectionAndABadFrameAreTold) {
  int zero = Authenticated(0);
  int one = Authenticated(1);
  close(zero);
  peers_.erase(std::find(peers_.begin(), peers_.end(), zero));
  ASSERT_TRUE(PumpUntil([&] { return !recorder_.closed.empty(); }));
  EXPECT_EQ(recorder_.closed, std::vector<int>{0});
  EXPECT_FALSE(port_->connected(0));

  const char zero_length[] = {0, 0, 0, 0, 5};  // a frame header with a length of 0
  ASSERT_TRUE(wire::WriteAll(one, std::string_view(zero_length, sizeof(zero_length))).ok());
  ASSERT_TRUE(PumpUntil([&] { return !recorder_.bad.empty(); }));
  EXPECT_EQ(recorder_.bad[0].first, 1);
  EXPECT_TRUE(port_->connected(1));  // the owner decides; it stays open until then
}

TEST_F(ControlPortTest, ANewAttemptClosesEveryConnectionWithoutTellingAndAnswersItsOwnHellos) {
  int old = Authenticated(0);
  port_->BeginAttempt(/*attempt=*/1, kWorld);
  EXPECT_FALSE(port_->connected(0));
  EXPECT_TRUE(recorder_.closed.empty());
  EXPECT_TRUE(ClosedByPort(old));
  int fd = Connect();
  ASSERT_TRUE(Handshake(fd, {.rank = 0, .attempt = 1, .nonce = wire::GenerateNonce()}, secret_));
  EXPECT_TRUE(PumpUntil([&] { return port_->connected(0); }));
}

}  // namespace
}  // namespace jaxtrain::controller
