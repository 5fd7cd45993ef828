#include "controller/run_output.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>

#include "storage/files.h"

namespace jaxtrain::controller {
namespace {

namespace fs = std::filesystem;
using std::chrono::seconds;

// A run's output to two pipes (the console and stderr) and its logs to a temporary directory.
class RunOutputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(pipe2(console_, O_CLOEXEC), 0);
    ASSERT_EQ(pipe2(stderr_, O_CLOEXEC), 0);
    std::string tmpl = (fs::temp_directory_path() / "run_output_test.XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    for (int fd : {console_[0], console_[1], stderr_[0], stderr_[1]}) close(fd);
    fs::remove_all(dir_);
  }
  RunOutput Make(bool status_line, const std::string& logs) {
    return RunOutput(
        console_[1], status_line, [logs](int r) { return logs + "/rank-" + std::to_string(r); }, 2,
        stderr_[1]);
  }
  static std::string Drain(int fd) {
    std::string out;
    char buf[4096];
    pollfd p{fd, POLLIN, 0};
    while (poll(&p, 1, 0) == 1 && (p.revents & POLLIN) != 0) {
      ssize_t n = read(fd, buf, sizeof(buf));
      if (n <= 0) break;
      out.append(buf, static_cast<size_t>(n));
    }
    return out;
  }

  int console_[2] = {-1, -1};
  int stderr_[2] = {-1, -1};
  std::string dir_;
};

TEST_F(RunOutputTest, RankOutputAndLinesGoToTheirFdsWithoutAStatusLine) {
  RunOutput out = Make(/*status_line=*/false, dir_);
  out.ShowStatus({.attempt = 0, .ranks_up = 1, .world_size = 2});
  out.ToConsole("(rank=0) hello\n");
  out.Say("restarting");
  ASSERT_TRUE(out.Flush(seconds(10)));
  EXPECT_EQ(Drain(console_[0]), "(rank=0) hello\n");
  EXPECT_EQ(Drain(stderr_[0]), "jaxtrain: restarting\n");
}

TEST_F(RunOutputTest, OutputIsWrittenAboveTheStatusLineWhichIsDrawnOnlyWhenItChanges) {
  RunOutput out = Make(/*status_line=*/true, dir_);
  const StatusView view{.attempt = 0, .ranks_up = 1, .world_size = 2};
  const std::string line = FormatStatus(view, TerminalWidth(console_[1]) - 1);
  out.ShowStatus(view);
  out.ShowStatus(view);  // unchanged: not drawn again
  out.ToConsole("(rank=1) hi\n");
  out.Say("a line");
  out.ClearStatus();
  out.ToConsole("(rank=1) after\n");
  ASSERT_TRUE(out.Flush(seconds(10)));
  EXPECT_EQ(Drain(console_[0]), std::string(kEraseLine) + line + kEraseLine + "(rank=1) hi\n" +
                                    line + kEraseLine + line + kEraseLine + "(rank=1) after\n");
  EXPECT_EQ(Drain(stderr_[0]), "jaxtrain: a line\n");
}

TEST_F(RunOutputTest, RankOutputReachesItsLogUnderTheAttemptsHeader) {
  RunOutput out = Make(/*status_line=*/false, dir_);
  out.BeginAttempt(3);
  EXPECT_EQ(out.WriteLog(1, "step 1\n"), "");
  EXPECT_EQ(out.CloseLogs(), "");
  auto text = storage::ReadFile(dir_ + "/rank-1");
  ASSERT_TRUE(text.ok());
  EXPECT_NE(text->find("attempt 3"), std::string::npos) << *text;
  EXPECT_NE(text->find("step 1\n"), std::string::npos) << *text;
}

TEST_F(RunOutputTest, ALogThatCannotBeWrittenIsSaidOnceAndReturnedOnce) {
  RunOutput out = Make(/*status_line=*/false, dir_ + "/missing");
  out.BeginAttempt(0);
  const std::string first = out.WriteLog(0, "text\n");
  EXPECT_NE(first, "");
  EXPECT_EQ(out.WriteLog(1, "text\n"), "");
  EXPECT_EQ(out.CloseLogs(), "");
  ASSERT_TRUE(out.Flush(seconds(10)));
  EXPECT_EQ(Drain(stderr_[0]), "jaxtrain: warning: " + first +
                                   "; rank output is missing from the logs from here on\n");
}

}  // namespace
}  // namespace jaxtrain::controller
