#include "controller/worker_group.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "launch/local_launcher.h"

namespace jaxtrain::controller {
namespace {

using namespace std::chrono_literals;

// What the group told its owner, in order: "log <rank> <text>", "console <text>", "exit <ranks>
// <status>".
struct Recorder : WorkerGroup::Delegate {
  void OnLog(int rank, std::string_view text) override {
    logs[rank] += text;
    events.push_back("log " + std::to_string(rank));
  }
  void OnConsole(std::string text) override { console += text; }
  void OnExit(const std::vector<int>& ranks, const launch::ExitStatus& status,
              const RankOutput& output) override {
    exits[ranks.front()] = status;
    events.push_back("exit " + std::to_string(ranks.front()));
    if (on_exit) on_exit();
  }
  std::map<int, std::string> logs;
  std::string console;
  std::map<int, launch::ExitStatus> exits;
  std::vector<std::string> events;
  std::function<void()> on_exit;
};

class WorkerGroupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto group = WorkerGroup::Create(launcher_, /*echo=*/true, recorder_);
    ASSERT_TRUE(group.ok()) << group.status().ToString();
    group_ = std::move(*group);
  }

  static launch::ProcessSpec Shell(int rank, const std::string& script) {
    return {.ranks = {rank}, .argv = {"/bin/sh", "-c", script}};
  }

  // Runs the group's side, as the controller's loop does, until `done` or 10 s have passed.
  bool PumpUntil(const std::function<bool()>& done) {
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (!done()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      pollfd fd{group_->ready_fd(), POLLIN, 0};
      poll(&fd, 1, 10);
      group_->OnReady();
    }
    return true;
  }

  launch::LocalLauncher launcher_;
  Recorder recorder_;
  std::unique_ptr<WorkerGroup> group_;
};

TEST_F(WorkerGroupTest, EachProcessesOutputAndExitReachTheOwnerOutputFirst) {
  ASSERT_TRUE(
      group_->Start({Shell(0, "echo zero; exit 0"), Shell(1, "echo one; echo more; exit 3")}).ok());
  EXPECT_EQ(group_->size(), 2u);
  ASSERT_TRUE(PumpUntil([&] { return group_->running() == 0 && group_->outputs_open() == 0; }));
  EXPECT_EQ(recorder_.logs[0], "zero\n");
  EXPECT_EQ(recorder_.logs[1], "one\nmore\n");
  EXPECT_EQ(recorder_.exits[0].exit_code, 0);
  EXPECT_EQ(recorder_.exits[1].exit_code, 3);
  // Within one rank, its output comes before its exit.
  for (int rank : {0, 1}) {
    auto log =
        std::find(recorder_.events.begin(), recorder_.events.end(), "log " + std::to_string(rank));
    auto exit =
        std::find(recorder_.events.begin(), recorder_.events.end(), "exit " + std::to_string(rank));
    ASSERT_NE(exit, recorder_.events.end());
    EXPECT_LT(log, exit);
  }
  EXPECT_NE(recorder_.console.find("(rank=0) zero\n"), std::string::npos) << recorder_.console;
  EXPECT_NE(recorder_.console.find("(rank=1) one\n(rank=1) more\n"), std::string::npos)
      << recorder_.console;
}

TEST_F(WorkerGroupTest, ASignalReachesEveryProcessAndEachIsReaped) {
  ASSERT_TRUE(group_->Start({Shell(0, "echo up; exec sleep 30"), Shell(1, "exec sleep 30")}).ok());
  ASSERT_TRUE(PumpUntil([&] { return recorder_.logs[0] == "up\n"; }));
  EXPECT_EQ(group_->running(), 2u);
  ASSERT_TRUE(group_->Signal(SIGTERM).ok());
  ASSERT_TRUE(PumpUntil([&] { return group_->running() == 0; }));
  EXPECT_EQ(recorder_.exits[0].signal, SIGTERM);
  EXPECT_EQ(recorder_.exits[1].signal, SIGTERM);
}

TEST_F(WorkerGroupTest, TheOwnerMaySignalTheGroupFromAnExit) {
  // As the controller does: the first failure stops the rest.
  recorder_.on_exit = [&] { (void)group_->Signal(SIGKILL); };
  ASSERT_TRUE(group_->Start({Shell(0, "exit 1"), Shell(1, "exec sleep 30")}).ok());
  ASSERT_TRUE(PumpUntil([&] { return group_->running() == 0; }));
  EXPECT_EQ(recorder_.exits[0].exit_code, 1);
  EXPECT_EQ(recorder_.exits[1].signal, SIGKILL);
}

TEST_F(WorkerGroupTest, AnUnendedLastLineIsShownWhenTheOutputEnds) {
  ASSERT_TRUE(group_->Start({Shell(0, "printf 'no newline'")}).ok());
  ASSERT_TRUE(PumpUntil([&] { return group_->running() == 0; }));
  group_->CloseOutputs();  // the attempt is over, whether or not its EOF was read
  EXPECT_EQ(group_->outputs_open(), 0u);
  EXPECT_EQ(recorder_.logs[0], "no newline");
  EXPECT_NE(recorder_.console.find("(rank=0) no newline\n"), std::string::npos)
      << recorder_.console;
}

TEST_F(WorkerGroupTest, AnOutputMayOutliveItsProcessAndANewAttemptReplacesTheGroup) {
  // The shell exits at once; its child keeps the pipe open a little longer.
  ASSERT_TRUE(group_->Start({Shell(0, "(sleep 0.3; echo late) & exit 0")}).ok());
  ASSERT_TRUE(PumpUntil([&] { return group_->running() == 0; }));
  ASSERT_TRUE(PumpUntil([&] { return group_->outputs_open() == 0; }));
  EXPECT_EQ(recorder_.logs[0], "late\n");

  ASSERT_TRUE(group_->Start({Shell(0, "exit 0"), Shell(1, "exit 0"), Shell(2, "exit 5")}).ok());
  EXPECT_EQ(group_->size(), 3u);
  ASSERT_TRUE(PumpUntil([&] { return group_->running() == 0; }));
  EXPECT_EQ(recorder_.exits[2].exit_code, 5);
}

TEST_F(WorkerGroupTest, AGroupThatCannotBeLaunchedStartsNothing) {
  Status s = group_->Start({{.ranks = {0}, .argv = {"/nonexistent/worker"}}});
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(group_->running(), 0u);
}

}  // namespace
}  // namespace jaxtrain::controller
