// WorkerClient against a controller reduced to the handshake, on a thread, over loopback TCP.
#include "worker/worker_client.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "wire/handshake.h"

namespace jaxtrain::worker {
namespace {

using wire::Frame;
using wire::MessageType;

// Bounds every blocking read so that a bug fails a test instead of hanging it.
constexpr timeval kNoHang{30, 0};

// One controller connection on its own thread: it accepts a worker, answers its hello with a
// challenge proven by `secret`, checks the worker's proof, sends `to_send` (sealed, as the bytes
// `wire_bytes` makes of it), and then records every frame (opened) until the worker closes the
// connection; or it misbehaves as `Behaviour` says.
class FakeController {
 public:
  enum class Behaviour {
    kNormal,
    kIgnoreHello,     // reads the hello and answers nothing until the worker closes
    kRefuseHello,     // answers the hello with a kRefused frame and closes the connection
    kDropFirst,       // closes the first connection after its hello, unanswered; serves the next
    kCloseAfterAuth,  // closes the connection after the handshake and `to_send`
  };

  explicit FakeController(std::string secret) : secret_(std::move(secret)) {
    auto fd = wire::Listen("127.0.0.1", 0, &port_);
    EXPECT_TRUE(fd.ok()) << fd.status().ToString();
    listen_fd_ = fd.ok() ? *fd : -1;
  }
  ~FakeController() {
    Join();
    close(listen_fd_);
  }

  WorkerClientOptions ClientOptions(std::string secret, uint32_t rank = 3) const {
    return {.controller = {"127.0.0.1", port_},
            .secret = std::move(secret),
            .rank = rank,
            .attempt = 2,
            .timeout = std::chrono::seconds(10)};
  }

  void Serve(std::vector<Frame> to_send = {}, Behaviour behaviour = Behaviour::kNormal) {
    thread_ = std::thread([this, to_send = std::move(to_send), behaviour] {
      int fd = Accept();
      if (fd < 0) return;
      if (behaviour == Behaviour::kDropFirst) {
        wire::FrameDecoder decoder(wire::kHelloSize);
        if (Read(fd, decoder)) ++hellos;
        close(fd);
        fd = Accept();
        if (fd < 0) return;
      }
      Session(fd, to_send, behaviour);
      close(fd);
    });
  }

  // Waits for the session to end; the results below are valid afterwards.
  void Join() {
    if (thread_.joinable()) thread_.join();
  }

  // What goes on the wire for `to_send`, given the connection's session: by default each frame
  // sealed in turn. Set before Serve().
  std::function<std::string(wire::SealedFrames&, const std::vector<Frame>&)> wire_bytes =
      [](wire::SealedFrames& session, const std::vector<Frame>& frames) {
        std::string out;
        for (const Frame& f : frames) EXPECT_TRUE(session.Seal(f.type, f.body, &out).ok());
        return out;
      };

  wire::Hello hello;                  // the worker's hello
  int hellos = 0;                     // hellos received, on all connections
  bool hello_proved_secret = false;   // the hello's MAC was made with `secret`
  bool got_auth = false;              // the worker sent a kAuth frame
  bool worker_proved_secret = false;  // ... that proves `secret`
  std::vector<Frame> received;        // after the handshake, in order

 private:
  // A blocking socket to the worker, or -1.
  int Accept() {
    pollfd p{listen_fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(kNoHang.tv_sec * 1000)) != 1) return -1;
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &kNoHang, sizeof(kNoHang));
    return fd;
  }

  void Session(int fd, const std::vector<Frame>& to_send, Behaviour behaviour) {
    wire::FrameDecoder decoder(wire::kMaxWorkerFrameBody + wire::kSealedFrameOverhead);
    auto frame = Read(fd, decoder);
    if (!frame || frame->type != MessageType::kHello) return;
    ++hellos;
    const std::string hello_body = frame->body;
    // Read as an impostor would, without checking the hello's MAC (RefusesAControllerThat...).
    ASSERT_EQ(frame->body.size(), wire::kHelloSize);
    auto field = [&](size_t at) {
      const auto* u = reinterpret_cast<const unsigned char*>(frame->body.data() + at);
      return (uint32_t{u[0]} << 24) | (uint32_t{u[1]} << 16) | (uint32_t{u[2]} << 8) | u[3];
    };
    hello = {.rank = field(6), .attempt = field(10), .pid = field(14)};
    std::memcpy(hello.nonce.data(), frame->body.data() + 18, wire::kNonceSize);
    hello_proved_secret = wire::DecodeHello(frame->body, secret_).ok();
    if (behaviour == Behaviour::kRefuseHello) {
      Write(fd, wire::EncodeFrame(MessageType::kRefused, "rank 3 is already connected").value());
      return;
    }
    if (behaviour == Behaviour::kIgnoreHello) {
      while (Read(fd, decoder)) {
      }
      return;
    }
    wire::Nonce nonce = wire::GenerateNonce();
    wire::Mac proof = wire::ControllerProof(secret_, hello, nonce);
    std::string body(reinterpret_cast<const char*>(nonce.data()), nonce.size());
    body.append(reinterpret_cast<const char*>(proof.data()), proof.size());
    Write(fd, wire::EncodeFrame(MessageType::kChallenge, body).value());
    frame = Read(fd, decoder);
    got_auth = frame && frame->type == MessageType::kAuth;
    worker_proved_secret =
        got_auth && wire::MacEquals(wire::WorkerProof(secret_, hello, nonce), frame->body);
    if (!worker_proved_secret) return;
    wire::SealedFrames session(
        wire::ControlSession(secret_, hello_body, body, wire::SessionEnd::kResponder));
    Write(fd, wire_bytes(session, to_send));
    if (behaviour == Behaviour::kCloseAfterAuth) return;
    while ((frame = Read(fd, decoder))) {
      auto opened = session.Open(frame->type, frame->body.data(), frame->body.size());
      ASSERT_TRUE(opened.ok() && opened->has_value()) << opened.status().ToString();
      frame->body.resize((*opened)->body.size());
      received.push_back(*std::move(frame));
    }
  }

  static std::optional<Frame> Read(int fd, wire::FrameDecoder& decoder) {
    for (;;) {
      auto f = decoder.Next();
      if (!f.ok()) return std::nullopt;
      if (f->has_value()) return **f;
      char buf[4096];
      ssize_t n = recv(fd, buf, sizeof(buf), 0);
      if (n <= 0 || !decoder.Feed(std::string_view(buf, static_cast<size_t>(n))).ok()) {
        return std::nullopt;
      }
    }
  }

  static void Write(int fd, const std::string& bytes) {
    EXPECT_TRUE(wire::WriteAll(fd, bytes).ok());
  }

  std::string secret_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::thread thread_;
};

TEST(WorkerClientTest, ConnectsWithTheRunsSecret) {
  const std::string secret = wire::GenerateSecret();
  FakeController controller(secret);
  controller.Serve();
  {
    auto client = WorkerClient::Connect(controller.ClientOptions(secret));
    ASSERT_TRUE(client.ok()) << client.status().ToString();
  }
  controller.Join();
  EXPECT_TRUE(controller.hello_proved_secret);
  EXPECT_TRUE(controller.worker_proved_secret);
  EXPECT_EQ(controller.hellos, 1);
  EXPECT_EQ(controller.hello.rank, 3u);
  EXPECT_EQ(controller.hello.attempt, 2u);
  EXPECT_EQ(controller.hello.pid, static_cast<uint32_t>(getpid()));
}

TEST(WorkerClientTest, RefusesAControllerThatCannotProveTheSecret) {
  FakeController controller(wire::GenerateSecret());
  controller.Serve();
  auto client = WorkerClient::Connect(controller.ClientOptions(wire::GenerateSecret()));
  EXPECT_EQ(client.status().code(), StatusCode::kUnauthenticated) << client.status().ToString();
  controller.Join();
  EXPECT_FALSE(controller.got_auth) << "the worker answered a controller it does not trust";
}

TEST(WorkerClientTest, AControllerThatRefusesTheHelloIsUnauthenticatedWithItsReason) {
  const std::string secret = wire::GenerateSecret();
  FakeController controller(secret);
  controller.Serve({}, FakeController::Behaviour::kRefuseHello);
  auto client = WorkerClient::Connect(controller.ClientOptions(secret));
  EXPECT_EQ(client.status().code(), StatusCode::kUnauthenticated) << client.status().ToString();
  EXPECT_NE(client.status().message().find("refused this worker (rank 3, attempt 2): rank 3 is "
                                           "already connected"),
            std::string::npos)
      << client.status().message();
  controller.Join();
  EXPECT_EQ(controller.hellos, 1) << "a refused worker must not try again";
}

// A controller flooded by peers that prove nothing drops the oldest unproven connections; a
// worker whose connection was dropped before its hello was answered connects again.
TEST(WorkerClientTest, ConnectsAgainWhenTheControllerDropsItsConnectionUnanswered) {
  const std::string secret = wire::GenerateSecret();
  FakeController controller(secret);
  controller.Serve({}, FakeController::Behaviour::kDropFirst);
  {
    auto client = WorkerClient::Connect(controller.ClientOptions(secret));
    ASSERT_TRUE(client.ok()) << client.status().ToString();
  }
  controller.Join();
  EXPECT_EQ(controller.hellos, 2);
  EXPECT_TRUE(controller.worker_proved_secret);
}

TEST(WorkerClientTest, RetryDelaysGrowAndAreBounded) {
  using std::chrono::milliseconds;
  EXPECT_EQ(ConnectRetryDelay(1), milliseconds(10));
  EXPECT_EQ(ConnectRetryDelay(2), milliseconds(20));
  EXPECT_EQ(ConnectRetryDelay(6), milliseconds(320));
  EXPECT_EQ(ConnectRetryDelay(7), milliseconds(500));
  EXPECT_EQ(ConnectRetryDelay(1000), milliseconds(500));
}

TEST(WorkerClientTest, MetricsTooLargeForTheControllerAreRefusedBeforeSending) {
  const std::string secret = wire::GenerateSecret();
  FakeController controller(secret);
  controller.Serve();
  {
    auto client = WorkerClient::Connect(controller.ClientOptions(secret));
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    const std::string big(20 << 20, 'x');
    Status s = (*client)->Report(1, big);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("report() metrics are too large (20971520 bytes, limit " +
                               std::to_string(wire::kMaxWorkerFrameBody - 8) + ")"),
              std::string::npos)
        << s.message();
    s = (*client)->ReportCheckpoint(1, R"({"files":[]})", big);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("report() metrics are too large (20971520 bytes"), std::string::npos)
        << s.message();
    // The largest report the controller accepts still goes through.
    ASSERT_TRUE((*client)->Report(2, std::string(wire::kMaxWorkerFrameBody - 8, 'y')).ok());
  }
  controller.Join();
  ASSERT_EQ(controller.received.size(), 1u);
  EXPECT_EQ(controller.received[0].body.size(), wire::kMaxWorkerFrameBody);
}

TEST(WorkerClientTest, ACollectiveCallReturnsTheDataOfItsRelease) {
  const std::string secret = wire::GenerateSecret();
  const std::string release = wire::EncodeCollectiveRelease(
      {.sequence = 1, .kind = wire::CollectiveKind::kBroadcast, .data = "rank 0's"});
  FakeController controller(secret);
  controller.Serve({{MessageType::kCollectiveRelease, release}});
  {
    auto client = WorkerClient::Connect(controller.ClientOptions(secret));
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    (*client)->WatchController(7);
    const std::string big(wire::kMaxCollectiveData + 1, 'x');
    auto refused = (*client)->Collective(
        {.sequence = 1, .kind = wire::CollectiveKind::kBroadcast, .data = big});
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(refused.status().message(),
              "broadcast_from_rank_zero()'s data is 1048577 bytes pickled, more than the limit of "
              "1048576; broadcast small objects only (write large ones to a file and broadcast "
              "its path)");
    auto data = (*client)->Collective({.sequence = 1, .kind = wire::CollectiveKind::kBroadcast});
    ASSERT_TRUE(data.ok()) << data.status().ToString();
    EXPECT_EQ(*data, "rank 0's");
    (*client)->Stop();
  }
  controller.Join();
  ASSERT_EQ(controller.received.size(), 1u);  // the call refused was never sent
  EXPECT_EQ(controller.received[0].type, MessageType::kCollective);
  EXPECT_EQ(controller.received[0].body, wire::EncodeCollectiveBody(1, 2, ""));
}

TEST(WorkerClientTest, TheConnectionsThreadAnswersAPingWhileACallWaits) {
  const std::string secret = wire::GenerateSecret();
  FakeController controller(secret);
  // The ping comes before the release the call waits for: the release's frame is read after it.
  controller.Serve(
      {{MessageType::kPing, ""},
       {MessageType::kCollectiveRelease, wire::EncodeCollectiveRelease({.sequence = 1})}});
  {
    auto client = WorkerClient::Connect(controller.ClientOptions(secret));
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    (*client)->WatchController(7);
    ASSERT_TRUE((*client)->Collective({.sequence = 1}).ok());
    (*client)->Stop();
  }
  controller.Join();
  std::vector<MessageType> types;
  for (const auto& f : controller.received) types.push_back(f.type);
  EXPECT_EQ(types.size(), 2u);
  EXPECT_EQ(std::count(types.begin(), types.end(), MessageType::kPong), 1);
}

// What faulthandler's handler does for the stacks (EnableStacks()), on the thread that gets the
// signal: write a dump into the descriptor it was given.
int stacks_fd = -1;
constexpr std::string_view kDump =
    "Thread 0x000000000000002a (most recent call first):\n  File \"t.py\", line 1 in f\n";
void DumpStacks(int) { [[maybe_unused]] ssize_t w = write(stacks_fd, kDump.data(), kDump.size()); }

TEST(WorkerClientTest, APingForStacksIsAnsweredWithTheDumpTheSignalsHandlerWrites) {
  stacks_fd = memfd_create("stacks-test", MFD_CLOEXEC);
  ASSERT_GE(stacks_fd, 0);
  const int sig = SIGRTMIN + 4;
  struct sigaction action {};
  action.sa_handler = DumpStacks;
  ASSERT_EQ(sigaction(sig, &action, nullptr), 0);
  const std::string secret = wire::GenerateSecret();
  FakeController controller(secret);
  // Twice: each answer holds that dump alone. The release sequences the test: read after both.
  controller.Serve(
      {{MessageType::kPing, "stacks"},
       {MessageType::kPing, "stacks"},
       {MessageType::kCollectiveRelease, wire::EncodeCollectiveRelease({.sequence = 1})}});
  {
    auto client = WorkerClient::Connect(controller.ClientOptions(secret));
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    (*client)->EnableStacks(stacks_fd, sig, 42);
    (*client)->WatchController(7);
    ASSERT_TRUE((*client)->Collective({.sequence = 1}).ok());
    (*client)->Stop();
  }
  controller.Join();
  signal(sig, SIG_DFL);
  close(stacks_fd);
  std::vector<wire::Pong> pongs;
  for (const auto& f : controller.received) {
    if (f.type != MessageType::kPong) continue;
    auto m = wire::DecodeWorkerMessage({f.type, f.body});
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    pongs.push_back(std::get<wire::Pong>(*m));
  }
  ASSERT_EQ(pongs.size(), 2u);
  for (const wire::Pong& p : pongs) {
    EXPECT_TRUE(p.has_stacks);
    EXPECT_EQ(p.stacks, kDump);
    EXPECT_EQ(p.thread, 42u);
    EXPECT_EQ(p.error, "");
    EXPECT_FALSE(p.settling);
  }
}

TEST(WorkerClientTest, AProfileRequestIsTakenOnceAndNotAnswered) {
  const std::string secret = wire::GenerateSecret();
  FakeController controller(secret);
  controller.Serve(
      {{MessageType::kPing, R"(profile {"dir":"/r/profiles/attempt-0/profile-1","steps":3})"},
       {MessageType::kCollectiveRelease, wire::EncodeCollectiveRelease({.sequence = 1})}});
  {
    auto client = WorkerClient::Connect(controller.ClientOptions(secret));
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    EXPECT_EQ((*client)->TakeProfileRequest(), "");
    (*client)->WatchController(7);
    ASSERT_TRUE((*client)->Collective({.sequence = 1}).ok());  // read after the request
    EXPECT_EQ((*client)->TakeProfileRequest(),
              R"({"dir":"/r/profiles/attempt-0/profile-1","steps":3})");
    EXPECT_EQ((*client)->TakeProfileRequest(), "");
    (*client)->Stop();
  }
  controller.Join();
  for (const auto& f : controller.received) EXPECT_NE(f.type, MessageType::kPong);
}

TEST(WorkerClientTest, AControllerThatNeverAnswersTimesOut) {
  const std::string secret = wire::GenerateSecret();
  FakeController controller(secret);
  controller.Serve({}, FakeController::Behaviour::kIgnoreHello);
  WorkerClientOptions options = controller.ClientOptions(secret);
  options.timeout = std::chrono::milliseconds(100);  // below a second, which must still count
  auto client = WorkerClient::Connect(options);
  EXPECT_EQ(client.status().code(), StatusCode::kDeadlineExceeded) << client.status().ToString();
}

TEST(WorkerClientTest, NoControllerListeningIsUnavailable) {
  auto port = wire::PickFreePort("127.0.0.1");
  ASSERT_TRUE(port.ok());
  auto client = WorkerClient::Connect({.controller = {"127.0.0.1", *port},
                                       .secret = wire::GenerateSecret(),
                                       .timeout = std::chrono::seconds(10)});
  EXPECT_EQ(client.status().code(), StatusCode::kUnavailable) << client.status().ToString();
}

TEST(WorkerClientTest, SendsRegisterReportsAndDoneInOrder) {
  const std::string secret = wire::GenerateSecret();
  FakeController controller(secret);
  controller.Serve();
  {
    WorkerClientOptions options = controller.ClientOptions(secret);
    options.registration = R"({"host":"h","pid":1})";
    auto client = WorkerClient::Connect(options);
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    ASSERT_TRUE((*client)->Report(1, R"({"loss":1.0})").ok());
    ASSERT_TRUE((*client)->Report(2, R"({"loss":0.5})").ok());
    ASSERT_TRUE((*client)->Report(uint64_t{1} << 40, "{}").ok());
    ASSERT_TRUE((*client)->SendDone("{}").ok());
  }
  controller.Join();

  const std::vector<Frame>& frames = controller.received;
  ASSERT_EQ(frames.size(), 5u);
  EXPECT_EQ(frames[0].type, MessageType::kRegister);
  EXPECT_EQ(frames[0].body, R"({"host":"h","pid":1})");
  const std::pair<uint64_t, std::string> reports[] = {
      {1, R"({"loss":1.0})"}, {2, R"({"loss":0.5})"}, {uint64_t{1} << 40, "{}"}};
  for (size_t i = 0; i < 3; ++i) {
    const Frame& f = frames[i + 1];
    EXPECT_EQ(f.type, MessageType::kReport);
    uint64_t round = 0;
    std::string_view metrics;
    ASSERT_TRUE(wire::DecodeReportBody(f.body, &round, &metrics).ok());
    EXPECT_EQ(round, reports[i].first);
    EXPECT_EQ(metrics, reports[i].second);
  }
  EXPECT_EQ(frames[4].type, MessageType::kDone);
  EXPECT_EQ(frames[4].body, "{}");
}

// report() sends its metrics-only rounds without noting them first (session.py's fast path): the
// count a preemption's answer names comes from the reports themselves, and a report queued
// behind a checkpoint and sent late does not take it back.
TEST(WorkerClientTest, ReportsCountTheirRoundsAndALateOneDoesNotLowerTheCount) {
  const std::string secret = wire::GenerateSecret();
  FakeController controller(secret);
  controller.Serve();
  {
    auto client = WorkerClient::Connect(controller.ClientOptions(secret));
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    EXPECT_EQ((*client)->rounds(), 0u);
    ASSERT_TRUE((*client)->Report(1, "{}").ok());
    EXPECT_EQ((*client)->rounds(), 1u);
    (*client)->NoteRound(3);  // rounds 2 and 3 queued behind a checkpoint
    ASSERT_TRUE((*client)->Report(2, "{}").ok());
    EXPECT_EQ((*client)->rounds(), 3u);
    ASSERT_TRUE((*client)->Report(4, "{}").ok());
    EXPECT_EQ((*client)->rounds(), 4u);
    ASSERT_TRUE((*client)->SendDone("{}").ok());
  }
  controller.Join();
}

TEST(WorkerClientTest, SendsAnError) {
  const std::string secret = wire::GenerateSecret();
  FakeController controller(secret);
  controller.Serve();
  {
    auto client = WorkerClient::Connect(controller.ClientOptions(secret));
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    ASSERT_TRUE((*client)->SendError(R"({"message":"boom"})").ok());
  }
  controller.Join();
  ASSERT_EQ(controller.received.size(), 1u);
  EXPECT_EQ(controller.received[0].type, MessageType::kError);
  EXPECT_EQ(controller.received[0].body, R"({"message":"boom"})");
}

TEST(WorkerClientTest, SendsAPreemptionNoticeWithItsSourceAndDeadline) {
  const std::string secret = wire::GenerateSecret();
  FakeController controller(secret);
  controller.Serve();
  {
    auto client = WorkerClient::Connect(controller.ClientOptions(secret));
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    EXPECT_EQ((*client)->SendPreemptionNotice("", 5).code(), StatusCode::kInvalidArgument);
    ASSERT_TRUE((*client)->SendPreemptionNotice("GCE metadata: preempted", 1234).ok());
  }
  controller.Join();
  ASSERT_EQ(controller.received.size(), 1u);
  EXPECT_EQ(controller.received[0].type, MessageType::kPreemption);
  auto decoded = wire::DecodeWorkerMessage(
      {.type = controller.received[0].type, .body = controller.received[0].body});
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
  EXPECT_EQ(std::get<wire::Preemption>(*decoded),
            (wire::Preemption{.source = "GCE metadata: preempted", .deadline_ms = 1234}));
}

TEST(WorkerClientTest, ItsLastFrameReachesABusyControllerThoughItClosesWithANoticeUnread) {
  // A worker ends right after its last frame, with a notice it never read on its socket: closing
  // such a socket resets the connection, and a reset drops what the controller's TCP has not yet
  // acknowledged. The controller here reads 4 KiB at a time, behind a worker that reports 12 MB.
  const std::string secret = wire::GenerateSecret();
  FakeController controller(secret);
  controller.Serve({{.type = MessageType::kCheckpointSettled, .body = "release"}});
  constexpr int kReports = 200;
  {
    auto client = WorkerClient::Connect(controller.ClientOptions(secret));
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    const std::string metrics = R"({"pad":")" + std::string(60000, 'x') + R"("})";
    for (int round = 1; round <= kReports; ++round) {
      ASSERT_TRUE((*client)->Report(static_cast<uint64_t>(round), metrics).ok());
    }
    ASSERT_TRUE((*client)->SendDone("{}").ok());
  }
  controller.Join();
  ASSERT_EQ(controller.received.size(), kReports + 1u);
  EXPECT_EQ(controller.received.back().type, MessageType::kDone);
}

TEST(WorkerClientTest, WaitStartReturnsTheStartMessageAndThePayload) {
  const std::string secret = wire::GenerateSecret();
  const std::string start = R"({"coordinator":"127.0.0.1:1234","world_size":4})";
  const std::string payload("pickled\0function\xff", 17);
  FakeController controller(secret);
  controller.Serve({{MessageType::kStart, start}, {MessageType::kPayload, payload}});
  auto client = WorkerClient::Connect(controller.ClientOptions(secret));
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  auto info = (*client)->WaitStart();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->json, start);
  EXPECT_EQ(info->payload, payload);
}

TEST(WorkerClientTest, WaitStartOpensFramesSharedByEveryRank) {
  const std::string secret = wire::GenerateSecret();
  const std::string start = R"({"coordinator":"127.0.0.1:1234","world_size":4})";
  const std::string payload("pickled\0function\xff", 17);
  FakeController controller(secret);
  controller.wire_bytes = [](wire::SealedFrames& session, const std::vector<Frame>& frames) {
    std::string out;
    for (const Frame& f : frames) {
      wire::SharedFrame shared = *wire::SealShared(f.type, f.body);
      EXPECT_TRUE(session.SealKeyOf(shared, &out).ok());
      out += *shared.frame;
    }
    return out;
  };
  controller.Serve({{MessageType::kStart, start}, {MessageType::kPayload, payload}});
  auto client = WorkerClient::Connect(controller.ClientOptions(secret));
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  auto info = (*client)->WaitStart();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->json, start);
  EXPECT_EQ(info->payload, payload);
}

// Nothing the controller sends after the handshake is used unless it opens as the controller's
// next sealed frame: a frame changed, replayed, reordered or injected on the way (a payload that
// would be unpickled, above all) ends the connection with kUnauthenticated.
TEST(WorkerClientTest, AFrameNotSealedByTheControllerAsItsNextEndsTheConnection) {
  using Bytes = std::function<std::string(wire::SealedFrames&)>;
  const std::string start = R"({"coordinator":"127.0.0.1:1234","world_size":4})";
  auto seal = [](wire::SealedFrames& session, MessageType type, std::string_view body) {
    std::string out;
    EXPECT_TRUE(session.Seal(type, body, &out).ok());
    return out;
  };
  const std::vector<std::pair<std::string, Bytes>> cases = {
      {"a changed payload",
       [&](wire::SealedFrames& s) {
         std::string payload = seal(s, MessageType::kPayload, "pickled function");
         payload[payload.size() / 2] ^= 1;
         return seal(s, MessageType::kStart, start) + payload;
       }},
      {"a replayed start",
       [&](wire::SealedFrames& s) {
         std::string frame = seal(s, MessageType::kStart, start);
         return frame + frame;
       }},
      {"reordered frames",
       [&](wire::SealedFrames& s) {
         std::string first = seal(s, MessageType::kStart, start);
         return seal(s, MessageType::kPayload, "pickled function") + first;
       }},
      {"a payload injected in the clear",
       [&](wire::SealedFrames& s) {
         return seal(s, MessageType::kStart, start) +
                *wire::EncodeFrame(MessageType::kPayload, "an attacker's pickle");
       }},
      {"a shared payload under another key",
       [&](wire::SealedFrames& s) {
         std::string out = seal(s, MessageType::kStart, start);
         EXPECT_TRUE(s.SealKeyOf(*wire::SealShared(MessageType::kPayload, "x"), &out).ok());
         return out + *wire::SealShared(MessageType::kPayload, "an attacker's pickle")->frame;
       }},
      {"a shared payload replayed without its key",
       [&](wire::SealedFrames& s) {
         wire::SharedFrame shared = *wire::SealShared(MessageType::kStart, start);
         std::string out;
         EXPECT_TRUE(s.SealKeyOf(shared, &out).ok());
         return out + *shared.frame + *shared.frame;
       }},
  };
  for (const auto& [name, bytes] : cases) {
    SCOPED_TRACE(name);
    const std::string secret = wire::GenerateSecret();
    FakeController controller(secret);
    controller.wire_bytes = [&](wire::SealedFrames& s, const std::vector<Frame>&) {
      return bytes(s);
    };
    controller.Serve();
    auto client = WorkerClient::Connect(controller.ClientOptions(secret));
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    auto info = (*client)->WaitStart();
    EXPECT_EQ(info.status().code(), StatusCode::kUnauthenticated) << info.status().ToString();
    EXPECT_NE(info.status().message().find("did not seal as its next one"), std::string::npos)
        << info.status().message();
  }
}

TEST(WorkerClientTest, WaitStartIsUnavailableWhenTheControllerCloses) {
  const std::string secret = wire::GenerateSecret();
  FakeController controller(secret);
  controller.Serve({}, FakeController::Behaviour::kCloseAfterAuth);
  auto client = WorkerClient::Connect(controller.ClientOptions(secret));
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  EXPECT_EQ((*client)->WaitStart().status().code(), StatusCode::kUnavailable);
}

TEST(WorkerClientTest, AStartWithoutItsPayloadIsUnavailable) {
  const std::string secret = wire::GenerateSecret();
  FakeController controller(secret);
  controller.Serve({{MessageType::kStart, "{}"}, {MessageType::kStart, "{}"}});
  auto client = WorkerClient::Connect(controller.ClientOptions(secret));
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  EXPECT_EQ((*client)->WaitStart().status().code(), StatusCode::kUnavailable);
}

// A worker never outlives its controller: the end of the connection ends the process.
TEST(WorkerClientDeathTest, WatchControllerExitsWhenTheConnectionEnds) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::string secret = wire::GenerateSecret();
  EXPECT_EXIT(
      {
        FakeController controller(secret);
        controller.Serve({}, FakeController::Behaviour::kCloseAfterAuth);
        auto client = WorkerClient::Connect(controller.ClientOptions(secret));
        if (!client.ok()) _exit(1);
        (*client)->WatchController(7);
        controller.Join();
        for (;;) pause();
      },
      testing::ExitedWithCode(7), "lost the connection to the controller");
}

TEST(WorkerClientTest, StopDisarmsWatchController) {
  const std::string secret = wire::GenerateSecret();
  FakeController controller(secret);
  controller.Serve();
  {
    auto client = WorkerClient::Connect(controller.ClientOptions(secret));
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    (*client)->WatchController(7);
    // Stop() ends the watcher by shutting down the reading side; that must not end the process.
    (*client)->Stop();
    ASSERT_TRUE((*client)->SendDone("{}").ok());
  }
  controller.Join();
  ASSERT_EQ(controller.received.size(), 1u);
  EXPECT_EQ(controller.received[0].type, MessageType::kDone);
}

}  // namespace
}  // namespace jaxtrain::worker
