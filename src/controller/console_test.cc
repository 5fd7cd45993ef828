#include "controller/console.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>

namespace jaxtrain::controller {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

class ConsoleTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(pipe2(fds_, O_CLOEXEC), 0); }
  void TearDown() override {
    for (int fd : fds_) {
      if (fd >= 0) close(fd);
    }
  }
  // Everything in the pipe now, without blocking.
  std::string Drain() {
    std::string out;
    char buf[65536];
    pollfd p{fds_[0], POLLIN, 0};
    while (poll(&p, 1, 0) == 1 && (p.revents & POLLIN) != 0) {
      ssize_t n = read(fds_[0], buf, sizeof(buf));
      if (n <= 0) break;
      out.append(buf, static_cast<size_t>(n));
    }
    return out;
  }
  int fds_[2] = {-1, -1};
};

TEST_F(ConsoleTest, WritesChunksInOrder) {
  Console console;
  EXPECT_TRUE(console.Write(fds_[1], "one\n"));
  EXPECT_TRUE(console.Write(fds_[1], "two\n"));
  ASSERT_TRUE(console.Flush(seconds(10)));
  EXPECT_EQ(Drain(), "one\ntwo\n");
  EXPECT_EQ(console.dropped_bytes(), 0u);
}

TEST_F(ConsoleTest, AReaderThatStopsReadingNeverBlocksTheWriterAndIsToldWhatWasDropped) {
  // The pipe holds 64 KiB; the queue 256 KiB more. Nobody reads while 1 MiB is written: every
  // Write() returns at once, and what does not fit is dropped.
  Console console(256 << 10);
  const std::string line(1023, 'x');
  int refused = 0;
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 1024; ++i) refused += console.Write(fds_[1], line + "\n") ? 0 : 1;
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(5)) << "Write() blocked";
  EXPECT_GT(refused, 0);
  EXPECT_EQ(console.dropped_bytes(), static_cast<uint64_t>(refused) * 1024);
  EXPECT_FALSE(console.Flush(milliseconds(50))) << "nothing reads: the queue cannot drain";

  // The reader comes back: the queue drains, then a notice says how much was not shown.
  std::string shown;
  auto deadline = std::chrono::steady_clock::now() + seconds(20);
  while (shown.find("were not shown") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline) {
    shown += Drain();
  }
  ASSERT_TRUE(console.Flush(seconds(10)));
  shown += Drain();
  EXPECT_NE(shown.find("jaxtrain: " + std::to_string(refused * 1024) +
                       " bytes of worker output were not shown here"),
            std::string::npos)
      << shown.substr(shown.size() - 200);
  // What was shown is whole lines, as queued, then the notice.
  size_t lines = 0;
  for (size_t at = 0, nl; (nl = shown.find('\n', at)) != std::string::npos; at = nl + 1) {
    std::string got = shown.substr(at, nl - at);
    if (got.rfind("jaxtrain: ", 0) == 0) break;
    EXPECT_EQ(got, line);
    ++lines;
  }
  EXPECT_EQ(lines, static_cast<size_t>(1024 - refused));
}

TEST_F(ConsoleTest, AClosedReaderDropsTheRestAndFlushReturns) {
  Console console;
  close(fds_[0]);
  fds_[0] = -1;
  console.Write(fds_[1], "lost\n");
  EXPECT_TRUE(console.Flush(seconds(10)));
  EXPECT_FALSE(console.Write(fds_[1], "also lost\n"));
  EXPECT_EQ(console.dropped_bytes(), 15u);
}

TEST_F(ConsoleTest, DestroyingItWhileAWriteIsBlockedReturns) {
  auto console = std::make_unique<Console>(8 << 20);
  console->Write(fds_[1], std::string(1 << 20, 'y'));  // more than the pipe holds
  std::this_thread::sleep_for(milliseconds(50));
  auto start = std::chrono::steady_clock::now();
  console.reset();  // must not wait for a reader that never comes
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(5));
  // Once it is gone, nothing more is written: the rest of the chunk is not left to a writer
  // that outlives it (which would write to whatever the fd is by then).
  const size_t shown = Drain().size();
  EXPECT_LT(shown, 1u << 20);
  std::this_thread::sleep_for(milliseconds(300));
  EXPECT_EQ(Drain(), "");
}

}  // namespace
}  // namespace jaxtrain::controller
