#include "launch/local_launcher.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "launch/process.h"

namespace jaxtrain::launch {
namespace {

std::string ReadAll(int fd) {
  std::string out;
  char buf[256];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    poll(&p, 1, 5000);
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

ExitStatus WaitExit(const LaunchedProcess& p) {
  pollfd pfd{p.pidfd, POLLIN, 0};
  EXPECT_EQ(poll(&pfd, 1, 10000), 1);
  auto s = TryReap(p.pid);
  EXPECT_TRUE(s.has_value());
  return *s;
}

TEST(LocalLauncherTest, RunsProcessesWithEnvAndMergedOutput) {
  LocalLauncher launcher;
  setenv("JT_LAUNCH_TEST_DROP", "x", 1);
  std::vector<ProcessSpec> specs;
  for (int r = 0; r < 2; ++r) {
    specs.push_back(
        {{r},
         {"/bin/sh", "-c", "echo out $JT_RANK ${JT_LAUNCH_TEST_DROP:-unset}; echo err >&2"},
         {{"JT_RANK", std::to_string(r)}},
         {"JT_LAUNCH_TEST_DROP"},
         "/"});
  }
  auto procs = launcher.Launch(specs);
  ASSERT_TRUE(procs.ok()) << procs.status().ToString();
  ASSERT_EQ(procs->size(), 2u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(ReadAll((*procs)[r].output_fd), "out " + std::to_string(r) + " unset\nerr\n");
    EXPECT_TRUE(WaitExit((*procs)[r]).ok());
    close((*procs)[r].pidfd);
    close((*procs)[r].output_fd);
  }
}

TEST(LocalLauncherTest, TheSecretArrivesOnAnInheritedPipeAndNotInTheEnvironment) {
  LocalLauncher launcher;
  setenv("JAXTRAIN_RUN_SECRET", "inherited-from-an-outer-run", 1);
  ProcessSpec spec{
      {0},
      {"/bin/sh", "-c", "cat <&$JAXTRAIN_RUN_SECRET_FD; echo; tr '\\0' '\\n' < /proc/self/environ"},
      {},
      {},
      ""};
  spec.secret = "0123abcd";
  auto procs = launcher.Launch({spec});
  unsetenv("JAXTRAIN_RUN_SECRET");
  ASSERT_TRUE(procs.ok()) << procs.status().ToString();
  std::string out = ReadAll((*procs)[0].output_fd);
  EXPECT_TRUE(WaitExit((*procs)[0]).ok());
  close((*procs)[0].pidfd);
  close((*procs)[0].output_fd);
  ASSERT_EQ(out.substr(0, 9), "0123abcd\n") << out;
  const std::string environ_text = out.substr(9);
  EXPECT_EQ(environ_text.find("0123abcd"), std::string::npos) << environ_text;
  EXPECT_EQ(environ_text.find("JAXTRAIN_RUN_SECRET="), std::string::npos) << environ_text;
  EXPECT_NE(environ_text.find("JAXTRAIN_RUN_SECRET_FD="), std::string::npos) << environ_text;
}

TEST(LocalLauncherTest, SignalGroupReachesEveryProcess) {
  LocalLauncher launcher;
  std::vector<ProcessSpec> specs(3, ProcessSpec{{0}, {"/bin/sleep", "30"}, {}, {}, ""});
  auto procs = launcher.Launch(specs);
  ASSERT_TRUE(procs.ok());
  ASSERT_TRUE(launcher.SignalGroup(SIGTERM).ok());
  for (auto& p : *procs) {
    ExitStatus s = WaitExit(p);
    EXPECT_EQ(s.signal, SIGTERM);
    EXPECT_EQ(s.ToString(), "killed by signal 15 (SIGTERM)");
    close(p.pidfd);
    close(p.output_fd);
  }
  EXPECT_TRUE(launcher.SignalGroup(SIGKILL).ok()) << "a group that has ended is not an error";
}

TEST(LocalLauncherTest, AProcessThatCannotStartFailsTheWholeLaunch) {
  LocalLauncher launcher;
  std::vector<ProcessSpec> specs = {{{0}, {"/bin/sleep", "30"}, {}, {}, ""},
                                    {{1}, {"/nonexistent/python"}, {}, {}, ""}};
  auto procs = launcher.Launch(specs);
  ASSERT_FALSE(procs.ok());
  EXPECT_EQ(procs.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(procs.status().message().find("rank 1"), std::string::npos);
  EXPECT_NE(procs.status().message().find("/nonexistent/python"), std::string::npos);
}

// The way a child gets its directory on glibc before 2.29 (the oldest the wheels run on): the
// program starts in the directory with its arguments intact, as with posix_spawn's own chdir.
TEST(SpawnTest, ChdirThroughShellStartsTheProgramInItsDirectoryWithItsArguments) {
  char dir[] = "/tmp/jt-spawn-cwd-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  SpawnOptions direct{.argv = {"/bin/sh", "-c", R"(pwd; echo "$1|$2")", "sh", "a b", "$HOME"},
                      .cwd = dir};
  for (const SpawnOptions& options : {direct, ChdirThroughShell(direct)}) {
    auto spawned = SpawnWithOutputPipe(options);
    ASSERT_TRUE(spawned.ok()) << spawned.status().ToString();
    EXPECT_EQ(ReadAll(spawned->output_fd), std::string(dir) + "\na b|$HOME\n");
    close(spawned->output_fd);
    int status = 0;
    ASSERT_EQ(waitpid(spawned->pid, &status, 0), spawned->pid);
    EXPECT_EQ(status, 0);
  }
  rmdir(dir);
}

TEST(ExitStatusTest, DescribesExitCodes) {
  EXPECT_EQ((ExitStatus{.exit_code = 3}).ToString(), "exited with status 3");
  EXPECT_TRUE((ExitStatus{.exit_code = 0}).ok());
  EXPECT_EQ(SignalName(SIGKILL), "SIGKILL");
}

}  // namespace
}  // namespace jaxtrain::launch
