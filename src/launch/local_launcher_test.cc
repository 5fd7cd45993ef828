#include "launch/local_launcher.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <map>
#include <memory>

#include "launch/launcher.h"
#include "launch/process.h"
#include "launch/standby_pool.h"
#include "launch/testing/process_state.h"

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

TEST(LocalLauncherTest, TheSharedEnvironmentReachesEveryProcessAndItsOwnEntriesWin) {
  LocalLauncher launcher;
  auto shared = std::make_shared<std::map<std::string, std::string>>(
      std::map<std::string, std::string>{{"JT_SHARED", "all"}, {"JT_MINE", "shared"}});
  std::vector<ProcessSpec> specs;
  for (int r = 0; r < 2; ++r) {
    ProcessSpec spec{{r}, {"/bin/sh", "-c", "echo $JT_SHARED $JT_MINE"}, {}, {}, ""};
    spec.shared_env = shared;
    if (r == 1) spec.env["JT_MINE"] = "own";
    specs.push_back(std::move(spec));
  }
  EXPECT_EQ(specs[1].Env(),
            (std::map<std::string, std::string>{{"JT_MINE", "own"}, {"JT_SHARED", "all"}}));
  auto procs = launcher.Launch(specs);
  ASSERT_TRUE(procs.ok()) << procs.status().ToString();
  const std::string expected[] = {"all shared\n", "all own\n"};
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(ReadAll((*procs)[r].output_fd), expected[r]);
    EXPECT_TRUE(WaitExit((*procs)[r]).ok());
    close((*procs)[r].pidfd);
    close((*procs)[r].output_fd);
  }
}

TEST(LauncherTest, MergeUniformSeesTheSharedEnvironment) {
  auto shared = std::make_shared<std::map<std::string, std::string>>(
      std::map<std::string, std::string>{{"JT_SHARED", "all"}});
  std::vector<ProcessSpec> specs(2, ProcessSpec{{0}, {"/bin/true"}, {}, {}, ""});
  specs[1].ranks = {1};
  for (auto& spec : specs) spec.shared_env = shared;
  specs[0].env["JT_RANK"] = "0";
  specs[1].env["JT_RANK"] = "1";
  auto group = MergeUniform(specs, {"JT_RANK"}, "Test");
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  EXPECT_EQ(group->env, (std::map<std::string, std::string>{{"JT_SHARED", "all"}}));
  EXPECT_EQ(group->ranks, (std::vector<int>{0, 1}));
  // A shared entry one spec overrides differs between ranks like any other.
  specs[1].env["JT_SHARED"] = "other";
  auto differs = MergeUniform(specs, {"JT_RANK"}, "Test");
  ASSERT_FALSE(differs.ok());
  EXPECT_NE(differs.status().message().find("JT_SHARED differs between ranks"), std::string::npos)
      << differs.status().message();
}

TEST(LauncherTest, MergeUniformPassesEachRankItsOwnValuesOfThePassedNames) {
  std::vector<ProcessSpec> specs(3, ProcessSpec{{0}, {"/bin/true"}, {}, {}, ""});
  for (int r = 0; r < 3; ++r) {
    specs[r].ranks = {r};
    specs[r].env = {{"JT_SHARED", "all"}, {"JT_ID", std::to_string(r)}};
  }
  specs[2].env.erase("JT_ID");  // a rank without it has it unset
  auto group = MergeUniform(specs, {}, "Test", {"JT_ID", "JT_UNUSED"});
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  EXPECT_EQ(group->env, (std::map<std::string, std::string>{
                            {"JT_SHARED", "all"},
                            {kRankEnvVariable, R"({"0":{"JT_ID":"0"},"1":{"JT_ID":"1"}})"}}));
  EXPECT_EQ(group->unset_env, (std::set<std::string>{"JT_ID"}));
  // Passed names that every rank has alike stay shared; nothing is passed per rank then.
  specs[2].env["JT_ID"] = "0";
  specs[1].env["JT_ID"] = "0";
  auto alike = MergeUniform(specs, {}, "Test", {"JT_ID"});
  ASSERT_TRUE(alike.ok()) << alike.status().ToString();
  EXPECT_EQ(alike->env, (std::map<std::string, std::string>{{"JT_SHARED", "all"}, {"JT_ID", "0"}}));
  EXPECT_TRUE(alike->unset_env.empty());
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

// A process that prints what it was started with: its pid to <dir>/pid.<rank> first, then what
// reaches it on its secret pipe (a standby's activation, or a fresh process's secret), then
// whether its environment had a standby's and an activation's variables.
std::vector<ProcessSpec> EchoSpecs(const std::string& dir, const std::string& x) {
  std::vector<ProcessSpec> specs;
  for (int r = 0; r < 2; ++r) {
    ProcessSpec spec{{r},
                     {"/bin/sh", "-c",
                      "echo $$ > " + dir + "/pid.$JT_R.$$ && mv " + dir + "/pid.$JT_R.$$ " + dir +
                          "/pid.$JT_R; cat <&$JAXTRAIN_RUN_SECRET_FD; echo;"
                          " echo standby=${JAXTRAIN_STANDBY:-no} attempt=${JAXTRAIN_ATTEMPT:-no}"},
                     {{"JT_R", std::to_string(r)}, {"JT_X", x}, {"JAXTRAIN_ATTEMPT", "3"}},
                     {},
                     ""};
    spec.secret = "s3cret";
    specs.push_back(spec);
  }
  return specs;
}

std::string TempDir() {
  char dir[] = "/tmp/jt-standby-XXXXXX";
  EXPECT_NE(mkdtemp(dir), nullptr);
  return dir;
}

std::vector<std::string> LaunchAndRead(LocalLauncher& launcher,
                                       const std::vector<ProcessSpec>& specs) {
  auto procs = launcher.Launch(specs);
  EXPECT_TRUE(procs.ok()) << procs.status().ToString();
  std::vector<std::string> out;
  if (!procs.ok()) return out;
  for (auto& p : *procs) {
    out.push_back(ReadAll(p.output_fd));
    EXPECT_TRUE(WaitExit(p).ok());
    close(p.pidfd);
    close(p.output_fd);
  }
  return out;
}

// The pid written (atomically, by a rename) to `path`, once it is there: 0 after 10 s without it.
int WaitForPidFile(const std::string& path) {
  for (int i = 0; i < 1000 && access(path.c_str(), F_OK) != 0; ++i) usleep(10000);
  FILE* f = fopen(path.c_str(), "r");
  if (f == nullptr) return 0;
  int pid = 0;
  if (fscanf(f, "%d", &pid) != 1) pid = 0;
  fclose(f);
  return pid;
}

std::string Joined(const std::vector<std::string>& notes) {
  std::string out;
  for (const auto& n : notes) out += n + "\n";
  return out;
}

TEST(StandbyTest, TheNextLaunchActivatesTheStandbysWithTheSecretAndTheAttempt) {
  signal(SIGPIPE, SIG_IGN);
  StandbyPool pool;
  LocalLauncher launcher(&pool);
  const std::string dir = TempDir();
  auto specs = EchoSpecs(dir, "a");
  ASSERT_TRUE(launcher.PrepareNext(specs).ok());
  EXPECT_EQ(pool.size(), 2u);
  ASSERT_TRUE(launcher.PrepareNext(specs).ok());  // one set ahead at most
  EXPECT_EQ(pool.size(), 2u);
  auto out = LaunchAndRead(launcher, specs);
  ASSERT_EQ(out.size(), 2u);
  for (const auto& o : out) {
    // The attempt came with the activation; the environment had the standby marker only.
    EXPECT_EQ(o, R"({"env":{"JAXTRAIN_ATTEMPT":"3"},"secret":"s3cret"})"
                 "\nstandby=1 attempt=no\n");
  }
  EXPECT_EQ(pool.size(), 0u);
  EXPECT_NE(Joined(launcher.TakeDetails()).find("ranks 0,1 started from standby workers"),
            std::string::npos);
  EXPECT_TRUE(launcher.TakeNotes().empty());  // nothing the user has to act on
}

TEST(StandbyTest, StandbysOfOtherProcessesAreEndedAndFreshOnesStarted) {
  StandbyPool pool;
  const std::string dir = TempDir();
  {
    LocalLauncher first(&pool);
    ASSERT_TRUE(first.PrepareNext(EchoSpecs(dir, "a")).ok());
    first.EndRun(/*keep=*/true);
  }
  EXPECT_EQ(pool.size(), 2u);
  LocalLauncher second(&pool);
  auto out = LaunchAndRead(second, EchoSpecs(dir, "b"));  // JT_X differs: another key
  for (const auto& o : out) EXPECT_EQ(o, "s3cret\nstandby=no attempt=3\n");
  EXPECT_EQ(pool.size(), 0u);
  EXPECT_EQ(Joined(second.TakeNotes()).find("standby"), std::string::npos);
}

TEST(StandbyTest, AKeptSetServesTheNextLauncherOfTheSameProcesses) {
  StandbyPool pool;
  const std::string dir = TempDir();
  {
    LocalLauncher first(&pool);
    ASSERT_TRUE(first.PrepareNext(EchoSpecs(dir, "a")).ok());
  }  // destroyed without EndRun: the set is kept all the same
  LocalLauncher second(&pool);
  auto specs = EchoSpecs(dir, "a");
  specs[0].env["JAXTRAIN_ATTEMPT"] = specs[1].env["JAXTRAIN_ATTEMPT"] = "0";
  auto out = LaunchAndRead(second, specs);
  for (const auto& o : out) EXPECT_NE(o.find(R"("JAXTRAIN_ATTEMPT":"0")"), std::string::npos) << o;
}

TEST(StandbyTest, TheKeyCoversTheSharedEnvironmentButNotTheActivationsVariables) {
  auto shared = std::make_shared<std::map<std::string, std::string>>(
      std::map<std::string, std::string>{{"JT_X", "a"}, {"JAXTRAIN_ATTEMPT", "0"}});
  ProcessSpec spec{{0}, {"/bin/true"}, {}, {}, ""};
  spec.shared_env = shared;
  const std::string key = StandbyKey(spec);
  (*shared)["JAXTRAIN_ATTEMPT"] = "1";  // given on activation: the same standby serves
  EXPECT_EQ(StandbyKey(spec), key);
  (*shared)["JT_X"] = "b";  // in the standby's environment: another process
  EXPECT_NE(StandbyKey(spec), key);
  ProcessSpec unshared{{0}, {"/bin/true"}, {{"JT_X", "b"}, {"JAXTRAIN_ATTEMPT", "7"}}, {}, ""};
  EXPECT_EQ(StandbyKey(unshared), StandbyKey(spec));  // shared or not, the same environment
}

TEST(StandbyTest, AStandbyThatDiedIsReplacedByAFreshProcessInTheSameGroup) {
  StandbyPool pool;
  LocalLauncher launcher(&pool);
  const std::string dir = TempDir();
  auto specs = EchoSpecs(dir, "a");
  ASSERT_TRUE(launcher.PrepareNext(specs).ok());
  const int pid = WaitForPidFile(dir + "/pid.1");
  ASSERT_GT(pid, 0);
  kill(pid, SIGKILL);
  siginfo_t info{};
  ASSERT_EQ(waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOWAIT), 0);  // not reaped
  auto out = LaunchAndRead(launcher, specs);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].substr(0, 1), "{");
  EXPECT_EQ(out[1], "s3cret\nstandby=no attempt=3\n");
  const std::string notes = Joined(launcher.TakeNotes());
  EXPECT_NE(notes.find("the standby worker of rank 1 killed by signal 9 (SIGKILL) before it was "
                       "used; starting a fresh process"),
            std::string::npos)
      << notes;
  const std::string details = Joined(launcher.TakeDetails());
  EXPECT_NE(details.find("rank 0 started from standby workers"), std::string::npos) << details;
}

TEST(StandbyTest, AStandbysChildrenEndWithIt) {
  StandbyPool pool;
  LocalLauncher launcher(&pool);
  const std::string dir = TempDir();
  ProcessSpec spec{{0},
                   {"/bin/sh", "-c",
                    "sleep 1000 & echo $! > " + dir + "/child.tmp && mv " + dir + "/child.tmp " +
                        dir + "/child; wait"},
                   {},
                   {},
                   ""};
  ASSERT_TRUE(launcher.PrepareNext({spec}).ok());
  const int child = WaitForPidFile(dir + "/child");
  ASSERT_GT(child, 0);
  launcher.EndRun(/*keep=*/false);
  const std::string state = testing::SettledState(child);
  EXPECT_TRUE(state.empty() || state == "Z") << "the standby's child is still there: " << state;
  if (!state.empty() && state != "Z") kill(child, SIGKILL);
}

TEST(StandbyTest, EndingARunWithoutKeepingEndsItsStandbys) {
  StandbyPool pool;
  LocalLauncher launcher(&pool);
  ASSERT_TRUE(launcher.PrepareNext(EchoSpecs(TempDir(), "a")).ok());
  launcher.EndRun(/*keep=*/false);
  EXPECT_EQ(pool.size(), 0u);
}

TEST(StandbyTest, EndFreeEndsTheKeptSetsButNotARunningLaunchersOwn) {
  StandbyPool pool;
  const std::string dir = TempDir();
  LocalLauncher done(&pool);
  ASSERT_TRUE(done.PrepareNext(EchoSpecs(dir, "a")).ok());
  done.EndRun(/*keep=*/true);
  LocalLauncher running(&pool);
  ASSERT_TRUE(running.PrepareNext(EchoSpecs(dir, "b")).ok());
  EXPECT_EQ(pool.size(), 4u);
  EXPECT_EQ(pool.EndFree(), 2u);  // the kept set only
  EXPECT_EQ(pool.size(), 2u);
  EXPECT_EQ(pool.EndFree(), 0u);
}

TEST(StandbyTest, WarmWorkersAreOnUnlessTurnedOffAndOtherValuesAreRefused) {
  unsetenv("JAXTRAIN_WARM_WORKERS");
  EXPECT_TRUE(*WarmWorkersRequested());
  setenv("JAXTRAIN_WARM_WORKERS", "0", 1);
  EXPECT_FALSE(*WarmWorkersRequested());
  setenv("JAXTRAIN_WARM_WORKERS", "on", 1);
  auto bad = WarmWorkersRequested();
  unsetenv("JAXTRAIN_WARM_WORKERS");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("JAXTRAIN_WARM_WORKERS='on' is not allowed: use 1"),
            std::string::npos);
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
