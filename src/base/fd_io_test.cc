#include "base/fd_io.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <thread>

namespace jaxtrain {
namespace {

TEST(FdIoTest, WritesAndReadsMoreThanAPipeHolds) {
  int fds[2];
  ASSERT_EQ(pipe2(fds, O_CLOEXEC), 0);
  std::string data(1 << 20, 'x');
  for (size_t i = 0; i < data.size(); i += 4093) data[i] = static_cast<char>('a' + i % 26);
  std::thread writer([&] {
    EXPECT_TRUE(WriteAll(fds[1], data).ok());
    close(fds[1]);
  });
  auto read = ReadAll(fds[0]);
  writer.join();
  close(fds[0]);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(*read, data);
}

TEST(FdIoTest, AWriteToAPipeWithoutReaderNamesWhatFailed) {
  signal(SIGPIPE, SIG_IGN);
  int fds[2];
  ASSERT_EQ(pipe2(fds, O_CLOEXEC), 0);
  close(fds[0]);
  int err = 0;
  Status s = WriteAll(fds[1], "hello", "write to the console", &err);
  close(fds[1]);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(err, EPIPE);
  EXPECT_NE(s.message().find("write to the console"), std::string::npos) << s.ToString();
}

TEST(FdIoTest, ReadingAClosedFdIsAnError) { EXPECT_FALSE(ReadAll(-1, "read the thing").ok()); }

}  // namespace
}  // namespace jaxtrain
