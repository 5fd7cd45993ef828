#include "wire/channel.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

namespace jaxtrain::wire {
namespace {

const ChannelEnds kJoin{.purpose = "jaxtrain-join", .initiator = "host-1", .responder = "host-0"};

// A finished handshake between two in-memory ends; `secret_b` is the responder's.
struct Pair {
  Session initiator, responder;
  Status status;
};

Pair Handshake(const std::string& secret_a, const std::string& secret_b,
               const ChannelEnds& ends = kJoin, std::string purpose = "jaxtrain-join",
               std::string me = "host-0") {
  Pair p;
  ChannelInitiator a(secret_a, ends);
  ChannelResponder b(secret_b, std::move(purpose), std::move(me));
  std::string open = a.Open().value();
  Status checked = b.OnOpen(open);
  std::string answer = checked.ok() ? b.Accept()
                       : checked.code() == StatusCode::kPermissionDenied
                           ? b.Refuse(checked.message())
                           : ChannelResponder::UnauthenticatedRefusal();
  StatusOr<std::string> confirm = a.OnAnswer(answer, &p.initiator);
  if (!confirm.ok()) {
    p.status = confirm.status();
    return p;
  }
  p.status = b.OnConfirm(*confirm, &p.responder);
  return p;
}

TEST(ChannelTest, RecordsRoundTripBothWaysInOrder) {
  std::string secret = GenerateSecret();
  Pair p = Handshake(secret, secret);
  ASSERT_TRUE(p.status.ok()) << p.status.ToString();
  for (std::string text :
       {std::string(), std::string("command"), std::string(kMaxRecordPlaintext, 'x')}) {
    std::string record = p.initiator.Seal(text).value();
    ASSERT_EQ(record.size(), 4 + Session::SealedSize(text.size()));
    EXPECT_EQ(p.responder.Open(std::string_view(record).substr(4)).value(), text);
    std::string reply = "!" + text.substr(std::min<size_t>(1, text.size()));
    std::string back = p.responder.Seal(reply).value();
    EXPECT_EQ(p.initiator.Open(std::string_view(back).substr(4)).value(), reply);
  }
  EXPECT_EQ(p.initiator.Seal(std::string(kMaxRecordPlaintext + 1, 'x')).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(ChannelTest, AChangedRepeatedOrReorderedRecordIsRefused) {
  std::string secret = GenerateSecret();
  Pair p = Handshake(secret, secret);
  ASSERT_TRUE(p.status.ok());
  Pair q = Handshake(secret, secret);  // another session of the same secret
  std::string other = q.initiator.Seal("echo hello").value().substr(4);
  EXPECT_EQ(p.responder.Open(other).status().code(), StatusCode::kUnauthenticated);

  Pair r = Handshake(secret, secret);
  std::string changed = r.initiator.Seal("echo hello").value().substr(4);
  changed[0] ^= 1;
  EXPECT_EQ(r.responder.Open(changed).status().code(), StatusCode::kUnauthenticated);
  // Once one record failed, the session stays refused.
  EXPECT_EQ(r.responder.Open(r.initiator.Seal("x").value().substr(4)).status().code(),
            StatusCode::kUnauthenticated);

  Pair s = Handshake(secret, secret);
  (void)s.initiator.Seal("one");
  std::string two = s.initiator.Seal("two").value().substr(4);
  EXPECT_EQ(s.responder.Open(two).status().code(), StatusCode::kUnauthenticated);  // reordered

  Pair t = Handshake(secret, secret);
  std::string only = t.initiator.Seal("one").value().substr(4);
  ASSERT_TRUE(t.responder.Open(only).ok());
  EXPECT_EQ(t.responder.Open(only).status().code(), StatusCode::kUnauthenticated);  // repeated
}

TEST(ChannelTest, AWrongSecretOnEitherEndFailsWithoutASession) {
  Pair p = Handshake(GenerateSecret(), GenerateSecret());
  EXPECT_EQ(p.status.code(), StatusCode::kUnauthenticated);
  EXPECT_NE(p.status.message().find("do not hold the same secret"), std::string::npos);
}

TEST(ChannelTest, AnOpenForAnotherPurposeOrEndIsRefusedWithAReasonTheInitiatorCanCheck) {
  std::string secret = GenerateSecret();
  Pair purpose = Handshake(secret, secret, kJoin, "jaxtrain-agent:run1", "host-0");
  EXPECT_EQ(purpose.status.code(), StatusCode::kPermissionDenied);
  EXPECT_NE(purpose.status.message().find("a connection for 'jaxtrain-join' reached 'host-0', "
                                          "which serves 'jaxtrain-agent:run1'"),
            std::string::npos)
      << purpose.status.message();
  Pair end = Handshake(secret, secret, kJoin, "jaxtrain-join", "host-2");
  EXPECT_EQ(end.status.code(), StatusCode::kPermissionDenied);
  EXPECT_NE(end.status.message().find("meant for 'host-0' reached 'host-2'"), std::string::npos);
}

// The relay attack of a proof made for one connection: an open (or a whole handshake) made for a
// join is worth nothing to a responder of another purpose or name, and its confirm proves nothing
// for another accept.
TEST(ChannelTest, ARelayedOpenOrConfirmOpensNoOtherSession) {
  std::string secret = GenerateSecret();
  ChannelInitiator joiner(secret, kJoin);
  std::string open = joiner.Open().value();

  ChannelResponder agent(secret, "jaxtrain-agent:run1", "host-2");
  EXPECT_EQ(agent.OnOpen(open).code(), StatusCode::kPermissionDenied);
  Session session;
  EXPECT_EQ(agent.OnConfirm(std::string(kMacSize, '\0'), &session).code(),
            StatusCode::kFailedPrecondition);

  // The real coordinator answers; the attacker relays the joiner's confirm to a second responder
  // of the same purpose and name, which drew its own nonce.
  ChannelResponder coordinator(secret, "jaxtrain-join", "host-0");
  ASSERT_TRUE(coordinator.OnOpen(open).ok());
  std::string accept = coordinator.Accept();
  std::string confirm = joiner.OnAnswer(accept, &session).value();
  ChannelResponder second(secret, "jaxtrain-join", "host-0");
  ASSERT_TRUE(second.OnOpen(open).ok());  // the open alone is replayable ...
  (void)second.Accept();
  EXPECT_EQ(second.OnConfirm(confirm, &session).code(),
            StatusCode::kUnauthenticated);  // ... but proves nothing to another accept
  EXPECT_TRUE(coordinator.OnConfirm(confirm, &session).ok());
}

TEST(ChannelTest, MalformedHandshakeMessagesAreErrorsNotCrashes) {
  std::string secret = GenerateSecret();
  ChannelResponder b(secret, "p", "me");
  for (std::string bad :
       {std::string(), std::string("JXCH"), std::string(5000, 'A'), std::string(70, '\0')}) {
    EXPECT_EQ(b.OnOpen(bad).code(), StatusCode::kUnauthenticated);
  }
  ChannelInitiator a(secret, {.purpose = "p", .initiator = "you", .responder = "me"});
  ASSERT_TRUE(a.Open().ok());
  Session s;
  EXPECT_EQ(a.OnAnswer("", &s).status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(a.OnAnswer(std::string(1 + kNonceSize + kMacSize, 'A') + "x", &s).status().code(),
            StatusCode::kDataLoss);
  EXPECT_EQ(a.OnAnswer(std::string(1 + kNonceSize + kMacSize, 'A'), &s).status().code(),
            StatusCode::kUnauthenticated);
  ChannelInitiator empty(secret, {.purpose = "", .initiator = "a", .responder = "b"});
  EXPECT_EQ(empty.Open().status().code(), StatusCode::kInvalidArgument);
}

TEST(ChannelTest, OverASocketPairWithFilesAndTheInitiatorsName) {
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  std::string secret = GenerateSecret();
  StatusOr<Channel> accepted = UnavailableError("not yet");
  std::thread responder([&] {
    accepted = Channel::Accept(fds[1], secret, "jaxtrain-join", "host-0", {"host-1", "host-3"},
                               std::chrono::seconds(10));
  });
  StatusOr<Channel> connected = Channel::Connect(fds[0], secret, kJoin, std::chrono::seconds(10));
  responder.join();
  ASSERT_TRUE(connected.ok()) << connected.status().ToString();
  ASSERT_TRUE(accepted.ok()) << accepted.status().ToString();
  EXPECT_EQ(accepted->peer(), "host-1");

  std::string big(kMaxRecordPlaintext * 2 + 5, 'z');
  std::thread sender([&] { ASSERT_TRUE(connected->Send(big, std::chrono::seconds(10)).ok()); });
  std::string got;
  for (int i = 0; i < 3; ++i) got += accepted->Receive(std::chrono::seconds(10)).value();
  sender.join();
  EXPECT_EQ(got, big);

  char path[] = "/tmp/channel_test_XXXXXX";
  int file = mkstemp(path);
  ASSERT_GE(file, 0);
  unlink(path);
  std::string contents(3 * 1000 * 1000, 'q');
  ASSERT_EQ(write(file, contents.data(), contents.size()), static_cast<ssize_t>(contents.size()));
  std::thread file_sender([&] {
    ASSERT_TRUE(accepted->SendFile(file, contents.size(), std::chrono::seconds(10)).ok());
  });
  std::string received;
  while (received.size() < contents.size()) {
    received += connected->Receive(std::chrono::seconds(10)).value();
  }
  file_sender.join();
  EXPECT_EQ(received, contents);
  close(file);
  char small_path[] = "/tmp/channel_test_XXXXXX";
  int small = mkstemp(small_path);
  ASSERT_GE(small, 0);
  unlink(small_path);
  ASSERT_EQ(write(small, "0123456789", 10), 10);
  EXPECT_EQ(accepted->SendFile(small, 11, std::chrono::seconds(10)).code(), StatusCode::kDataLoss);
  close(small);
  EXPECT_EQ(connected->Receive(std::chrono::seconds(10)).value(), "0123456789");

  EXPECT_EQ(accepted->Receive(std::chrono::milliseconds(50)).status().code(),
            StatusCode::kDeadlineExceeded);
  close(fds[0]);
  StatusOr<std::string> closed = accepted->Receive(std::chrono::seconds(10));
  EXPECT_EQ(closed.status().code(), StatusCode::kUnavailable);
  close(fds[1]);
}

TEST(ChannelTest, AcceptRefusesAnInitiatorNotListedAndSaysSo) {
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  std::string secret = GenerateSecret();
  StatusOr<Channel> accepted = UnavailableError("not yet");
  std::thread responder([&] {
    accepted = Channel::Accept(fds[1], secret, "jaxtrain-join", "host-0", {"host-2"},
                               std::chrono::seconds(10));
  });
  StatusOr<Channel> connected = Channel::Connect(fds[0], secret, kJoin, std::chrono::seconds(10));
  responder.join();
  EXPECT_EQ(accepted.status().code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(connected.status().code(), StatusCode::kPermissionDenied);
  EXPECT_NE(connected.status().message().find("accepts no connection from 'host-1'"),
            std::string::npos)
      << connected.status().message();
  close(fds[0]);
  close(fds[1]);
}

TEST(ChannelTest, ASilentResponderTimesOut) {
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  StatusOr<Channel> connected =
      Channel::Connect(fds[0], GenerateSecret(), kJoin, std::chrono::milliseconds(100));
  EXPECT_EQ(connected.status().code(), StatusCode::kDeadlineExceeded);
  close(fds[0]);
  close(fds[1]);
}

}  // namespace
}  // namespace jaxtrain::wire
