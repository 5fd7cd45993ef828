#include "wire/out_queue.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

namespace jaxtrain::wire {
namespace {

class SocketPair {
 public:
  SocketPair() { EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, fds_), 0); }
  ~SocketPair() {
    close(fds_[0]);
    close(fds_[1]);
  }
  int writer() const { return fds_[0]; }
  int reader() const { return fds_[1]; }
  // Everything readable now.
  std::string Drain() const {
    std::string out;
    char buf[65536];
    for (ssize_t n; (n = read(fds_[1], buf, sizeof(buf))) > 0;) out.append(buf, n);
    return out;
  }

 private:
  int fds_[2] = {-1, -1};
};

TEST(OutQueueTest, WritesOwnedAndSharedBytesInOrder) {
  SocketPair pair;
  auto shared = std::make_shared<const std::string>("-shared-");
  OutQueue q;
  q.Push("a");
  q.PushShared(shared);
  q.Push("b");
  EXPECT_EQ(q.pending_bytes(), 10u);
  ASSERT_TRUE(q.Flush(pair.writer()).ok());
  EXPECT_TRUE(q.empty());
  EXPECT_EQ(pair.Drain(), "a-shared-b");
}

TEST(OutQueueTest, ManyQueuesHoldOneSharedPayloadOnce) {
  auto payload = std::make_shared<const std::string>(std::string(1 << 20, 'p'));
  std::vector<OutQueue> queues(64);
  for (OutQueue& q : queues) {
    q.Push("header");
    q.PushShared(payload);
  }
  for (const OutQueue& q : queues) {
    EXPECT_EQ(q.owned_bytes(), 6u);
    EXPECT_EQ(q.pending_bytes(), 6u + payload->size());
  }
  EXPECT_EQ(payload.use_count(), 65);
}

TEST(OutQueueTest, APartialWriteResumesWhereItStopped) {
  SocketPair pair;
  int small = 4096;
  ASSERT_EQ(setsockopt(pair.writer(), SOL_SOCKET, SO_SNDBUF, &small, sizeof(small)), 0);
  std::string body;
  for (int i = 0; i < 200000; ++i) body.push_back(static_cast<char>('a' + i % 26));
  auto shared = std::make_shared<const std::string>(body);
  OutQueue q;
  q.Push("<");
  q.PushShared(shared);
  q.Push(">");
  std::string received;
  while (!q.empty()) {
    ASSERT_TRUE(q.Flush(pair.writer()).ok());
    received += pair.Drain();
  }
  received += pair.Drain();
  EXPECT_EQ(received, "<" + body + ">");
  EXPECT_EQ(q.pending_bytes(), 0u);
  EXPECT_EQ(q.owned_bytes(), 0u);
}

TEST(OutQueueTest, PushesBetweenPartialWritesKeepTheirOrder) {
  SocketPair pair;
  int small = 4096;
  ASSERT_EQ(setsockopt(pair.writer(), SOL_SOCKET, SO_SNDBUF, &small, sizeof(small)), 0);
  OutQueue q;
  std::string sent, received;
  for (int i = 0; i < 2000; ++i) {
    std::string chunk = std::to_string(i) + std::string(static_cast<size_t>(i % 97), '.') + ";";
    sent += chunk;
    q.Push(chunk);
    ASSERT_TRUE(q.Flush(pair.writer()).ok());
    if (i % 7 == 0) received += pair.Drain();
  }
  while (!q.empty()) {
    ASSERT_TRUE(q.Flush(pair.writer()).ok());
    received += pair.Drain();
  }
  received += pair.Drain();
  EXPECT_EQ(received, sent);
  EXPECT_EQ(q.owned_bytes(), 0u);
}

TEST(OutQueueTest, APeerThatIsGoneIsUnavailable) {
  OutQueue q;
  q.Push("x");
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  close(fds[1]);
  EXPECT_EQ(q.Flush(fds[0]).code(), StatusCode::kUnavailable);
  EXPECT_FALSE(q.empty());
  close(fds[0]);
}

}  // namespace
}  // namespace jaxtrain::wire
