// The ssh launcher without sshd: its pure parts as functions, and Launch() and SignalGroup()
// against a fake ssh (a shell script that drops ssh's options and runs the remote command here,
// with its stdin, as sshd would; the target "down" refuses like a host without sshd). The agent
// and the workers are real processes. tests/test_ssh.py runs the real thing on real sshd.
#include "launch/ssh_launcher.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <sstream>
#include <thread>

#include "launch/process.h"
#include "launch/slurm_launcher.h"
#include "launch/testing/process_state.h"

namespace jaxtrain::launch {
namespace {

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

int CountOf(const std::string& text, const std::string& part) {
  int n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

config::ScalingConfig Config(config::ScalingConfigInput input) {
  auto c = config::ScalingConfig::Create(std::move(input));
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return *c;
}

TEST(ParseSshHostsTest, ReadsHostListsWithAndWithoutSlots) {
  auto hosts = ParseSshHosts("h1, user@h2:4", "JAXTRAIN_SSH_HOSTS", false);
  ASSERT_TRUE(hosts.ok()) << hosts.status().ToString();
  ASSERT_EQ(hosts->size(), 2u);
  EXPECT_EQ((*hosts)[0].target, "h1");
  EXPECT_FALSE((*hosts)[0].slots);
  EXPECT_EQ((*hosts)[1].target, "user@h2");
  EXPECT_EQ((*hosts)[1].slots, 4);
}

TEST(ParseSshHostsTest, ReadsHostfilesAsMpiAndDeepSpeedWriteThem) {
  auto hosts = ParseSshHosts(
      "# workers\nworker-0 slots=4\n\nworker-1 slots=2 max_slots=8  # gpu\n"
      "worker-2 labels=zone=b,gpu=h100\n",  // for ScalingConfig.label_selector (hosts/join.py)
      "JAXTRAIN_HOSTFILE=hf", true);
  ASSERT_TRUE(hosts.ok()) << hosts.status().ToString();
  ASSERT_EQ(hosts->size(), 3u);
  EXPECT_EQ((*hosts)[0].slots, 4);
  EXPECT_EQ((*hosts)[1].target, "worker-1");
  EXPECT_EQ((*hosts)[1].slots, 2);
  EXPECT_FALSE((*hosts)[2].slots);
}

TEST(ParseSshHostsTest, RefusesBadEntriesNamingThem) {
  auto bad = ParseSshHosts("h1 slots=0\n", "JAXTRAIN_HOSTFILE=hf", true);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(bad.status().message(), "JAXTRAIN_HOSTFILE=hf line 1: 'slots=0'"));
  bad = ParseSshHosts("h1\nh2 cpus=3\n", "JAXTRAIN_HOSTFILE=hf", true);
  EXPECT_TRUE(Contains(bad.status().message(), "line 2: 'cpus=3' is not allowed"));
  bad = ParseSshHosts("h1,h1:2", "JAXTRAIN_SSH_HOSTS", false);
  EXPECT_TRUE(Contains(bad.status().message(), "host 'h1' is listed twice"));
  bad = ParseSshHosts("h1:x", "JAXTRAIN_SSH_HOSTS", false);
  EXPECT_TRUE(Contains(bad.status().message(), "entry 'h1:x': 'x' is not allowed"));
  bad = ParseSshHosts("h1,,h2", "JAXTRAIN_SSH_HOSTS", false);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  bad = ParseSshHosts("# nothing\n", "JAXTRAIN_HOSTFILE=hf", true);
  EXPECT_TRUE(Contains(bad.status().message(), "lists no host"));
}

TEST(ParseSshHostsTest, RefusesHostsThatSshWouldReadAsOptionsNamingThem) {
  auto bad = ParseSshHosts("h1,-oProxyCommand=touch%20/tmp/owned", "JAXTRAIN_SSH_HOSTS", false);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(bad.status().message(),
                       "JAXTRAIN_SSH_HOSTS entry '-oProxyCommand=touch%20/tmp/owned': host name "
                       "\"-oProxyCommand=touch%20/tmp/owned\" is not allowed: it begins with '-'"))
      << bad.status().ToString();
  EXPECT_TRUE(Contains(bad.status().message(), "optionally as user@host"));
  bad = ParseSshHosts("h1\n-oProxyCommand=sh slots=2\n", "JAXTRAIN_HOSTFILE=hf", true);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(bad.status().message(), "JAXTRAIN_HOSTFILE=hf line 2: host name"));
  EXPECT_TRUE(Contains(bad.status().message(), "begins with '-'"));
  bad = ParseSshHosts(
      "h1,a\x01"
      "b",
      "JAXTRAIN_SSH_HOSTS", false);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(bad.status().message(),
                       "\"a\\u0001b\" is not allowed: it holds "
                       "whitespace or a control character"))
      << bad.status().ToString();
  bad = ParseSshHosts("h1,a b", "JAXTRAIN_SSH_HOSTS", false);
  EXPECT_TRUE(Contains(bad.status().message(), "whitespace")) << bad.status().ToString();
  // A tab separates the words of a hostfile line as a space does.
  auto hosts = ParseSshHosts("worker-0\tslots=2\n", "JAXTRAIN_HOSTFILE=hf", true);
  ASSERT_TRUE(hosts.ok()) << hosts.status().ToString();
  EXPECT_EQ((*hosts)[0].target, "worker-0");
  EXPECT_EQ((*hosts)[0].slots, 2);
}

TEST(AgentCommandTest, IsOneLineThatCarriesTheAgentAsBase64) {
  EXPECT_EQ(Base64(""), "");
  EXPECT_EQ(Base64("f"), "Zg==");
  EXPECT_EQ(Base64("fo"), "Zm8=");
  EXPECT_EQ(Base64("foo"), "Zm9v");
  EXPECT_EQ(Base64(std::string_view("\xff\xfe\x00", 3)), "//4A");
  const std::string command = AgentCommand("/opt/py/bin/python", "user@h1");
  EXPECT_EQ(command.find('\n'), std::string::npos);
  EXPECT_EQ(
      command.rfind("exec '/opt/py/bin/python' '-c' 'import base64; exec(base64.b64decode(\"", 0),
      0u)
      << command;
  EXPECT_TRUE(command.ends_with("\"))' 'user@h1'")) << command;
}

TEST(PlanForSshTest, HostsWithoutSlotsShareTheWorkersAndRanksAreContiguousPerHost) {
  accelerators::FakeHost env;
  env.env[kSshHostsEnv] = "h1,h2";
  auto plan = PlanForSsh(Config({.num_workers = 4}), env);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  std::vector<std::string> hosts;
  for (const auto& w : plan->workers) hosts.push_back(w.host + "/" + std::to_string(w.local_rank));
  EXPECT_EQ(hosts, (std::vector<std::string>{"h1/0", "h1/1", "h2/0", "h2/1"}));
  EXPECT_EQ(plan->workers[2].node_rank, 1);
}

TEST(PlanForSshTest, SlotsLimitAHostAndTooFewAreRefused) {
  accelerators::FakeHost env;
  env.env[kHostfileEnv] = "/hf";
  env.files["/hf"] = "a slots=1\nb slots=3\n";
  auto plan = PlanForSsh(Config({.num_workers = 4}), env);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->workers[0].host, "a");
  EXPECT_EQ(plan->workers[3].host, "b");
  auto refused = PlanForSsh(Config({.num_workers = 5}), env);
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(refused.status().message(), "JAXTRAIN_HOSTFILE=/hf"));
}

TEST(PlanForSshTest, NoHostsSaysHowToGiveThem) {
  accelerators::FakeHost env;
  auto plan = PlanForSsh(Config({.num_workers = 2}), env);
  EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(plan.status().message(), "JAXTRAIN_SSH_HOSTS=h1,h2"));
  env.env[kHostfileEnv] = "/missing";
  EXPECT_EQ(PlanForSsh(Config({.num_workers = 2}), env).status().code(), StatusCode::kNotFound);
}

TEST(ShellQuoteTest, QuotesEverythingAsOneWord) {
  EXPECT_EQ(ShellQuote("a b"), "'a b'");
  EXPECT_EQ(ShellQuote("it's"), "'it'\\''s'");
}

TEST(SshCommandTest, SplitsTheUsersCommand) {
  accelerators::FakeHost env;
  EXPECT_EQ(SshCommand(env), std::vector<std::string>{"ssh"});
  env.env[kSshCommandEnv] = "ssh  -F /x/config";
  EXPECT_EQ(SshCommand(env), (std::vector<std::string>{"ssh", "-F", "/x/config"}));
}

// --- Launch() against a fake ssh --------------------------------------------------------------

class FakeSshTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("ssh-launcher-test-" + std::to_string(getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
    ssh_ = (dir_ / "ssh").string();
    WriteFakeSsh(ssh_, "sh");
  }
  void TearDown() override {
    EndDeafWorkers();
    std::filesystem::remove_all(dir_);
  }

  // A worker that exits 3 on SIGTERM.
  static ProcessSpec HearsTerm(int rank) {
    return Python(rank,
                  "import signal, sys, time\n"
                  "signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))\n"
                  "print('ready', flush=True)\n"
                  "while True: time.sleep(1)\n");
  }
  // A worker that cannot hear the stop, as one behind a cut link cannot. Its fake ssh ended, it
  // would linger, so it notes its pid for EndDeafWorkers() (a real agent would end it).
  ProcessSpec Deaf(int rank) const {
    return Python(rank,
                  "import os, signal, time\n"
                  "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                  "open('" +
                      (dir_ / "deaf-").string() +
                      "' + str(os.getpid()), 'w').close()\n"
                      "print('ready', flush=True)\n"
                      "time.sleep(30)\n");
  }
  void EndDeafWorkers() {
    std::error_code error;
    for (const auto& entry : std::filesystem::directory_iterator(dir_, error)) {
      const std::string name = entry.path().filename().string();
      if (name.rfind("deaf-", 0) == 0) kill(std::stoi(name.substr(5)), SIGKILL);
    }
  }

  // A fake ssh at `path` whose "login shell" on every host is `shell`: sshd runs the remote
  // command as `<shell> -c <command>`.
  void WriteFakeSsh(const std::string& path, const std::string& shell) {
    std::ofstream(path) << "#!/bin/sh\n"
                           "echo \"$@\" >> " +
                               (dir_ / "argv.log").string() +
                               "\n"
                               "while [ $# -gt 0 ]; do case \"$1\" in -o|-F) shift 2;; -*) shift;; "
                               "*) break;; esac; done\n"
                               "target=$1; shift\n"
                               "if [ \"$target\" = down ]; then echo \"ssh: connect to host down "
                               "port 22: Connection refused\" >&2; exit 255; fi\n"
                               "if [ \"$target\" = back ] && [ ! -e " +
                               (dir_ / "back").string() +
                               " ]; then echo \"ssh: connect to host back port 22: Connection "
                               "timed out\" >&2; exit 255; fi\n"
                               "if [ \"$target\" = silent ]; then echo $$ > " +
                               (dir_ / "silent").string() +
                               "; exec sleep 300; fi\n"
                               "exec " +
                               shell + " -c \"$*\"\n";
    chmod(path.c_str(), 0755);
  }

  SshLauncherOptions Options(std::vector<std::string> targets) {
    return {.ssh = {ssh_}, .targets = std::move(targets)};
  }

  static ProcessSpec Python(int rank, const std::string& code,
                            std::map<std::string, std::string> env = {}) {
    return {.ranks = {rank}, .argv = {PythonPath(), "-c", code}, .env = std::move(env)};
  }

  static std::string PythonPath() {
    for (const char* p : {"/usr/bin/python3", "/usr/local/bin/python3"}) {
      if (access(p, X_OK) == 0) return p;
    }
    return "python3";
  }

  // Output of `p` until it ends, or until `until` appears when given. Wait for a whole line
  // ("ready\n"), not for its text: an unbuffered worker (PYTHONUNBUFFERED=1, as in many shells and
  // CI runners) writes a print()'s text and its newline apart, and a test that closes the pipe
  // between the two (Finish) fails that print with EPIPE, so the worker exits 1, not as it should.
  static std::string ReadOutput(const LaunchedProcess& p, const std::string& until = "") {
    std::string out;
    for (;;) {
      pollfd pfd{p.output_fd, POLLIN, 0};
      poll(&pfd, 1, 60000);
      char buf[4096];
      ssize_t n = read(p.output_fd, buf, sizeof(buf));
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      if (n <= 0) return out;
      out.append(buf, static_cast<size_t>(n));
      if (!until.empty() && Contains(out, until)) return out;
    }
  }

  static ExitStatus Finish(const LaunchedProcess& p) {
    close(p.output_fd);
    close(p.pidfd);
    return WaitForExit(p.pid);
  }

  std::string ArgvLog() {
    std::ifstream in(dir_ / "argv.log");
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

  std::filesystem::path dir_;
  std::string ssh_;
};

TEST_F(FakeSshTest, EveryRankGetsItsEnvironmentOnStdinAndNeverOnACommandLine) {
  SshLauncher launcher(Options({"h1", "h2"}));
  std::vector<ProcessSpec> specs;
  for (int r = 0; r < 2; ++r) {
    specs.push_back(Python(r,
                           "import os\n"
                           "secret = os.read(int(os.environ['JAXTRAIN_RUN_SECRET_FD']), 100)\n"
                           "print('rank', os.environ['JAXTRAIN_RANK'], secret.decode(),\n"
                           "      'JAXTRAIN_RUN_SECRET' in os.environ)\n",
                           {{"JAXTRAIN_RANK", std::to_string(r)}}));
    specs.back().secret = "s3cr3t-value";
  }
  auto launched = launcher.Launch(specs);
  ASSERT_TRUE(launched.ok()) << launched.status().ToString();
  ASSERT_EQ(launched->size(), 2u);
  for (int r = 0; r < 2; ++r) {
    const auto& p = (*launched)[static_cast<size_t>(r)];
    EXPECT_EQ(p.ranks, std::vector<int>{r});
    // On an inherited pipe, not in the worker's environment.
    EXPECT_TRUE(Contains(ReadOutput(p), "rank " + std::to_string(r) + " s3cr3t-value False"));
    EXPECT_TRUE(Finish(p).ok());
  }
  std::string argv = ArgvLog();
  EXPECT_TRUE(Contains(argv, "BatchMode=yes"));
  EXPECT_TRUE(Contains(argv, " h1 ")) << argv;
  EXPECT_FALSE(Contains(argv, "s3cr3t")) << argv;
}

TEST_F(FakeSshTest, TheHostFollowsDoubleDashOnEverySshCommandLine) {
  SshLauncher launcher(Options({"h1"}));
  auto launched = launcher.Launch({Python(0, "print('ran')")});
  ASSERT_TRUE(launched.ok()) << launched.status().ToString();
  EXPECT_TRUE(Contains(ReadOutput((*launched)[0]), "ran"));
  EXPECT_TRUE(Finish((*launched)[0]).ok());
  std::istringstream lines(ArgvLog());
  int count = 0;
  for (std::string line; std::getline(lines, line); ++count) {
    EXPECT_TRUE(Contains(line, " -- h1 ")) << line;  // the probe's and the agent's
  }
  EXPECT_EQ(count, 2);
}

TEST_F(FakeSshTest, AWorkerStartsOnAHostWhoseLoginShellIsTcsh) {
  if (access("/bin/tcsh", X_OK) != 0)
    GTEST_SKIP() << "tcsh is not installed (apt-get install tcsh)";
  WriteFakeSsh(ssh_, "/bin/tcsh");
  SshLauncher launcher(Options({"h1"}));
  auto launched = launcher.Launch({Python(
      0, "import os\nprint('rank', os.environ['JAXTRAIN_RANK'])\n", {{"JAXTRAIN_RANK", "0"}})});
  ASSERT_TRUE(launched.ok()) << launched.status().ToString();
  EXPECT_TRUE(Contains(ReadOutput((*launched)[0]), "rank 0"));
  EXPECT_TRUE(Finish((*launched)[0]).ok());
}

TEST_F(FakeSshTest, ARefusedHostFailsTheLaunchNamingItAndQuotingSsh) {
  SshLauncher launcher(Options({"h1", "down"}));
  auto launched = launcher.Launch({Python(0, "pass"), Python(1, "pass")});
  ASSERT_EQ(launched.status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(Contains(launched.status().message(), "cannot reach host down over ssh"));
  EXPECT_TRUE(Contains(launched.status().message(), "Connection refused"));
}

// A restart waits for a host that cannot be reached, probing with backoff, and starts once it
// answers; a first launch does not wait, nor does a restart past host_wait.
TEST_F(FakeSshTest, ARestartWaitsForAnUnreachableHostToComeBack) {
  SshLauncherOptions options = Options({"back"});
  options.host_wait = std::chrono::seconds(30);
  options.first_retry = std::chrono::milliseconds(100);
  options.max_retry = std::chrono::milliseconds(200);
  SshLauncher launcher(options);
  auto first = launcher.Launch({Python(0, "pass")});
  ASSERT_EQ(first.status().code(), StatusCode::kUnavailable) << "a first launch does not wait";
  std::ofstream(dir_ / "back");  // the host is up
  first = launcher.Launch({Python(0, "pass")});
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_TRUE(Finish((*first)[0]).ok());

  std::filesystem::remove(dir_ / "back");  // down again, and back while the restart waits
  std::thread comes_back([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(700));
    std::ofstream(dir_ / "back");
  });
  auto restarted = launcher.Launch({Python(0, "print('ran')")});
  comes_back.join();
  ASSERT_TRUE(restarted.ok()) << restarted.status().ToString();
  EXPECT_TRUE(Contains(ReadOutput((*restarted)[0]), "ran"));
  EXPECT_TRUE(Finish((*restarted)[0]).ok());
  std::istringstream lines(ArgvLog());
  int probes = 0;
  for (std::string line; std::getline(lines, line);) probes += Contains(line, "test -x") ? 1 : 0;
  EXPECT_GE(probes, 5) << "the restart probed again: 1 + 1 + at least 3 while waiting";
}

TEST_F(FakeSshTest, ARestartGivesUpOnAnUnreachableHostAfterHostWait) {
  SshLauncherOptions options = Options({"h1", "back"});
  options.host_wait = std::chrono::milliseconds(500);
  options.first_retry = std::chrono::milliseconds(100);
  std::ofstream(dir_ / "back");
  SshLauncher launcher(options);
  auto first = launcher.Launch({Python(0, "pass"), Python(1, "pass")});
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  for (const auto& p : *first) EXPECT_TRUE(Finish(p).ok());
  std::filesystem::remove(dir_ / "back");
  auto restarted = launcher.Launch({Python(0, "pass"), Python(1, "pass")});
  ASSERT_EQ(restarted.status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(Contains(restarted.status().message(), "cannot reach host back over ssh"));
  EXPECT_TRUE(Contains(restarted.status().message(), "Connection timed out"));
  EXPECT_TRUE(Contains(restarted.status().message(),
                       "for it to come back, the most that 0.5 s (FailureConfig."
                       "unreachable_host_timeout_s) allows"))
      << restarted.status().message();
}

TEST_F(FakeSshTest, ARestartDoesNotWaitForAHostThatRefusesItsKeyOrLacksPython) {
  SshLauncherOptions options = Options({"h1"});
  options.host_wait = std::chrono::seconds(60);
  SshLauncher launcher(options);
  auto first = launcher.Launch({Python(0, "pass")});
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_TRUE(Finish((*first)[0]).ok());
  auto restarted = launcher.Launch({{.ranks = {0}, .argv = {"/nonexistent/python3", "-c", ""}}});
  EXPECT_EQ(restarted.status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(Contains(restarted.status().message(), "has no executable /nonexistent"));
  std::istringstream lines(ArgvLog());
  int probes = 0;
  for (std::string line; std::getline(lines, line);) probes += Contains(line, "test -x") ? 1 : 0;
  EXPECT_EQ(probes, 2) << "the restart probed once: a missing Python does not come back";
}

TEST_F(FakeSshTest, AHostWithoutTheWorkersPythonIsNamed) {
  SshLauncher launcher(Options({"h1"}));
  ProcessSpec spec{.ranks = {0}, .argv = {"/nonexistent/python3", "-c", "pass"}};
  auto launched = launcher.Launch({spec});
  ASSERT_EQ(launched.status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(Contains(launched.status().message(), "host h1 has no executable /nonexistent"));
}

TEST_F(FakeSshTest, SigtermReachesTheWorkerThroughItsAgent) {
  SshLauncher launcher(Options({"h1"}));
  auto launched = launcher.Launch({Python(0,
                                          "import signal, sys, time\n"
                                          "def on_term(*_):\n"
                                          "    print('got TERM', flush=True); sys.exit(3)\n"
                                          "signal.signal(signal.SIGTERM, on_term)\n"
                                          "print('ready', flush=True)\n"
                                          "while True: time.sleep(1)\n")});
  ASSERT_TRUE(launched.ok()) << launched.status().ToString();
  const auto& p = launched->front();
  ReadOutput(p, "ready\n");
  ASSERT_TRUE(launcher.SignalGroup(SIGTERM).ok());
  EXPECT_TRUE(Contains(ReadOutput(p), "got TERM"));
  EXPECT_EQ(Finish(p).exit_code, 3);
}

TEST_F(FakeSshTest, TheOtherSshOfACutOffHostIsEndedAtOnceInsteadOfWaitingForTheGrace) {
  SshLauncher launcher(Options({"h1", "h2", "h2"}));
  auto launched = launcher.Launch({HearsTerm(0),
                                   // Exits as an ssh whose connection dropped does.
                                   Python(1, "import sys; sys.exit(255)"), Deaf(2)});
  ASSERT_TRUE(launched.ok()) << launched.status().ToString();
  const auto& ps = *launched;
  ReadOutput(ps[0], "ready\n");
  ReadOutput(ps[2], "ready\n");
  const ExitStatus lost = Finish(ps[1]);
  ASSERT_EQ(lost.exit_code, 255);
  launcher.Exited(ps[1].pid, lost);

  ASSERT_TRUE(launcher.SignalGroup(SIGTERM).ok());
  EXPECT_EQ(Finish(ps[0]).exit_code, 3);     // its host is there: it heard SIGTERM
  EXPECT_EQ(Finish(ps[2]).signal, SIGKILL);  // its host is cut off: its ssh ended at once
  bool said = false;
  for (const auto& note : launcher.TakeNotes()) said = said || Contains(note, "to h2 was ended");
  EXPECT_TRUE(said);
}

// The controller's keepalive notices a silent host (about 10 s) before ssh's own does (15 s): the
// ssh processes to that host, none of which has exited yet, are ended at the stop at once.
TEST_F(FakeSshTest, TheSshOfAHostTheControllerFoundSilentIsEndedAtOnce) {
  SshLauncher launcher(Options({"h1", "h2", "h2"}));
  auto launched = launcher.Launch({HearsTerm(0), Deaf(1), Deaf(2)});
  ASSERT_TRUE(launched.ok()) << launched.status().ToString();
  const auto& ps = *launched;
  for (const auto& p : ps) ReadOutput(p, "ready\n");
  launcher.Unreachable(ps[1].pid);  // rank 1's connection timed out; rank 2's has not yet

  ASSERT_TRUE(launcher.SignalGroup(SIGTERM).ok());
  EXPECT_EQ(Finish(ps[0]).exit_code, 3);     // h1 heard SIGTERM
  EXPECT_EQ(Finish(ps[1]).signal, SIGKILL);  // h2 is silent: both its ssh ended at once
  EXPECT_EQ(Finish(ps[2]).signal, SIGKILL);
  int said = 0;
  for (const auto& note : launcher.TakeNotes()) {
    said += Contains(note,
                     "to h2 was ended at once: a rank's control connection from that host "
                     "timed out")
                ? 1
                : 0;
  }
  EXPECT_EQ(said, 2);
}

// A host found silent once the stop has begun (another rank failed first): its ssh is ended then,
// not after the grace period.
TEST_F(FakeSshTest, AHostFoundSilentDuringTheStopHasItsSshEndedThen) {
  SshLauncher launcher(Options({"h1", "h2"}));
  auto launched = launcher.Launch({HearsTerm(0), Deaf(1)});
  ASSERT_TRUE(launched.ok()) << launched.status().ToString();
  const auto& ps = *launched;
  for (const auto& p : ps) ReadOutput(p, "ready\n");
  ASSERT_TRUE(launcher.SignalGroup(SIGTERM).ok());
  EXPECT_EQ(Finish(ps[0]).exit_code, 3);
  launcher.Unreachable(ps[1].pid);
  EXPECT_EQ(Finish(ps[1]).signal, SIGKILL);
  bool said = false;
  for (const auto& note : launcher.TakeNotes()) {
    said = said || Contains(note,
                            "to h2 was ended at once: a rank's control connection from "
                            "that host timed out (it is cut off), so its worker cannot "
                            "hear SIGTERM");
  }
  EXPECT_TRUE(said);
}

TEST_F(FakeSshTest, AWorkerKilledBySignalIsReportedAs128PlusTheSignal) {
  SshLauncher launcher(Options({"h1"}));
  auto launched = launcher.Launch({Python(0, "import os, signal; os.kill(os.getpid(), 9)")});
  ASSERT_TRUE(launched.ok()) << launched.status().ToString();
  const auto& p = launched->front();
  EXPECT_TRUE(Contains(ReadOutput(p), "the worker on h1 was killed by signal 9 (SIGKILL)"));
  EXPECT_EQ(Finish(p).exit_code, 128 + 9);
}

TEST_F(FakeSshTest, AnInterruptCutsAProbeShortAndLeavesNoSshBehind) {
  // "silent" is a host that never answers; the fake ssh tells its pid through a FIFO.
  const std::string fifo = (dir_ / "silent").string();
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const int said = open(fifo.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(said, 0);
  SshLauncher launcher(
      {.ssh = {ssh_}, .targets = {"h1", "silent"}, .probe_timeout = std::chrono::seconds(300)});
  StatusOr<std::vector<LaunchedProcess>> launched = InternalError("Launch() did not return");
  std::thread launching([&] {
    launched = launcher.Launch({Python(0, "pass"), Python(1, "pass")});
  });
  pollfd p{said, POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 60'000), 1) << "the probe of the silent host did not start";
  char pid_text[32] = {};
  ASSERT_GT(read(said, pid_text, sizeof(pid_text) - 1), 0);
  launcher.Interrupt();
  launching.join();
  close(said);

  EXPECT_EQ(launched.status().code(), StatusCode::kCancelled) << launched.status().ToString();
  const std::string state = testing::SettledState(std::atoi(pid_text));
  EXPECT_TRUE(state.empty()) << "the probe's ssh is still there: " << state;
  // And from then on, nothing is started.
  EXPECT_EQ(launcher.Launch({Python(0, "pass")}).status().code(), StatusCode::kCancelled);
}

TEST_F(FakeSshTest, AnElasticProbeOfASilentHostEndsWithItsWait) {
  // An elastic restart's probe waits for what is left of its deadline, not for ssh to give up
  // (here the fake ssh of "silent" would hang for 300 s; the probe_timeout is as long).
  SshLauncher launcher(
      {.ssh = {ssh_}, .targets = {"h1", "silent"}, .probe_timeout = std::chrono::seconds(300)});
  auto probing = std::async(std::launch::async, [&] {
    return launcher.UnreachableHosts({"h1", "silent"}, std::chrono::seconds(1), -1);
  });
  ASSERT_EQ(probing.wait_for(std::chrono::seconds(120)), std::future_status::ready)
      << "the probe of a silent host outlasted its wait by minutes";
  auto down = probing.get();
  ASSERT_TRUE(down.ok()) << down.status().ToString();
  EXPECT_EQ(*down, std::vector<std::string>{"silent"});
  std::ifstream said(dir_ / "silent");
  int pid = 0;
  ASSERT_TRUE(said >> pid) << "the silent host was not probed";
  const std::string state = testing::SettledState(pid);
  EXPECT_TRUE(state.empty()) << "the probe's ssh is still there: " << state;
}

TEST_F(FakeSshTest, WhenTheLauncherGoesItsWorkersAndTheirChildrenGoToo) {
  auto launcher = std::make_unique<SshLauncher>(Options({"h1"}));
  // The worker starts a child in its own process group and waits forever.
  auto launched = launcher->Launch({Python(0,
                                           "import subprocess, time\n"
                                           "c = subprocess.Popen(['sleep', '1000'])\n"
                                           "print('pids', c.pid, flush=True)\n"
                                           "time.sleep(1000)\n")});
  ASSERT_TRUE(launched.ok()) << launched.status().ToString();
  const auto p = launched->front();
  std::string out = ReadOutput(p, "\n");
  const pid_t child = std::stoi(out.substr(out.find("pids ") + 5));
  launcher.reset();  // stdin of the agent ends, as when the driver dies
  ReadOutput(p);
  EXPECT_EQ(Finish(p).exit_code, 128 + 9);
  // Killed with the worker's process group: gone, or a zombie until init reaps it.
  const std::string state = testing::SettledState(child);
  EXPECT_TRUE(state.empty() || state == "Z") << "the worker's child is still there: " << state;
}

// --- standby workers (warm restarts) -------------------------------------------------------------

// A worker that tells how it was started: its rank, the secret it got, its attempt, whether it
// was a standby, and its pid. A standby reads its activation as python/jaxtrain/worker.py does;
// with DIE_AS_STANDBY naming its rank it exits before any activation instead.
constexpr char kTellingWorker[] =
    "import json, os, sys\n"
    "standby = os.environ.get('JAXTRAIN_STANDBY') == '1'\n"
    "fd = int(os.environ['JAXTRAIN_RUN_SECRET_FD'])\n"
    "if standby and os.environ.get('DIE_AS_STANDBY') == os.environ['JAXTRAIN_RANK']:\n"
    "    sys.exit(3)\n"
    "if standby and os.environ.get('MARK_DIR'):\n"
    "    open(os.path.join(os.environ['MARK_DIR'], 'standby-' + os.environ['JAXTRAIN_RANK']),\n"
    "         'w').close()\n"
    "data = b''\n"
    "while chunk := os.read(fd, 65536):\n"
    "    data += chunk\n"
    "if standby:\n"
    "    a = json.loads(data)\n"
    "    os.environ.update(a['env'])\n"
    "    secret = a['secret']\n"
    "else:\n"
    "    secret = data.decode()\n"
    "path = os.environ.get('JAXTRAIN_PRELOAD_FILE')\n"
    "preload = open(path).read() + ' at ' + path if path else '-'\n"
    "print('rank', os.environ['JAXTRAIN_RANK'], secret, os.environ.get('JAXTRAIN_ATTEMPT'),\n"
    "      'standby' if standby else 'fresh', 'preload=' + preload, flush=True)\n";

class WarmSshTest : public FakeSshTest {
 protected:
  std::vector<ProcessSpec> Specs(int attempt, const std::string& secret,
                                 std::map<std::string, std::string> extra = {}) {
    std::vector<ProcessSpec> specs;
    for (int r = 0; r < 2; ++r) {
      std::map<std::string, std::string> env = extra;
      env["JAXTRAIN_RANK"] = std::to_string(r);
      env["JAXTRAIN_ATTEMPT"] = std::to_string(attempt);
      specs.push_back(Python(r, kTellingWorker, env));
      specs.back().secret = secret;
    }
    return specs;
  }
  SshLauncherOptions WarmOptions() {
    SshLauncherOptions o = Options({"h1", "h2"});
    o.warm = true;
    return o;
  }
  // Runs each process to its end: its output.
  static std::vector<std::string> RunAll(const std::vector<LaunchedProcess>& launched) {
    std::vector<std::string> out;
    for (const auto& p : launched) {
      out.push_back(ReadOutput(p));
      EXPECT_TRUE(Finish(p).ok()) << out.back();
    }
    return out;
  }
  static std::string Joined(const std::vector<std::string>& notes) {
    std::string all;
    for (const auto& n : notes) all += n + "\n";
    return all;
  }
};

TEST_F(WarmSshTest, ARestartActivatesStandbysWithTheNewAttemptsSecretAndNoNewAgent) {
  SshLauncher launcher(WarmOptions());
  auto first = launcher.Launch(Specs(0, "secret-0"));
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  std::vector<std::string> out = RunAll(*first);
  EXPECT_TRUE(Contains(out[1], "rank 1 secret-0 0 fresh")) << out[1];

  ASSERT_TRUE(launcher.PrepareNext(Specs(0, "secret-0")).ok());
  ASSERT_EQ(launcher.standby_pids().size(), 2u);
  auto restart = launcher.Launch(Specs(1, "secret-1"));
  ASSERT_TRUE(restart.ok()) << restart.status().ToString();
  out = RunAll(*restart);
  EXPECT_TRUE(Contains(out[0], "rank 0 secret-1 1 standby")) << out[0];
  EXPECT_TRUE(Contains(out[1], "rank 1 secret-1 1 standby")) << out[1];
  // No new agent: the standbys' connections carried the activation. The ssh commands are those
  // of the first launch (a probe and an agent per host), the standbys' (one per host, each of
  // which has run its worker by now) and the restart's probes (one per host).
  std::string log = ArgvLog();
  EXPECT_EQ(std::count(log.begin(), log.end(), '\n'), 8) << log;
  EXPECT_EQ(CountOf(log, "exec '"), 4) << log;  // the agents'; a probe runs `test -x ...`
  EXPECT_FALSE(Contains(log, "secret-1")) << log;
  EXPECT_TRUE(Contains(Joined(launcher.TakeDetails()), "ranks 0,1 started from standby workers"));
  EXPECT_TRUE(launcher.standby_pids().empty());
}

TEST_F(WarmSshTest, AStandbyThatIsGoneStartsAfreshAndTheNoteSaysWhy) {
  SshLauncher launcher(WarmOptions());
  auto first = launcher.Launch(Specs(0, "s0", {{"DIE_AS_STANDBY", "1"}}));
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  RunAll(*first);
  ASSERT_TRUE(launcher.PrepareNext(Specs(0, "s0", {{"DIE_AS_STANDBY", "1"}})).ok());
  // Rank 1's standby exits at once: wait for its ssh to end (not reaped: the launcher does).
  siginfo_t info{};
  ASSERT_EQ(waitid(P_PID, static_cast<id_t>(launcher.standby_pids()[1]), &info, WEXITED | WNOWAIT),
            0);
  auto restart = launcher.Launch(Specs(1, "s1", {{"DIE_AS_STANDBY", "1"}}));
  ASSERT_TRUE(restart.ok()) << restart.status().ToString();
  std::vector<std::string> out = RunAll(*restart);
  EXPECT_TRUE(Contains(out[0], "rank 0 s1 1 standby")) << out[0];
  EXPECT_TRUE(Contains(out[1], "rank 1 s1 1 fresh")) << out[1];
  const std::string notes = Joined(launcher.TakeNotes());
  EXPECT_TRUE(Contains(notes,
                       "the standby worker of rank 1 on h2 is gone (its ssh exited with "
                       "status 3); starting it afresh"))
      << notes;
  const std::string details = Joined(launcher.TakeDetails());
  EXPECT_TRUE(Contains(details, "rank 0 started from standby workers")) << details;
}

TEST_F(WarmSshTest, AHostThatDidNotAnswerTheRestartsProbeGetsAFreshWorker) {
  // "back" refuses ssh while dir_/back is missing; the standby's connection, made before, stays
  // up, as a cut-off host's does until ssh's keepalive notices.
  std::ofstream(dir_ / "back");
  SshLauncherOptions options = WarmOptions();
  options.targets = {"h1", "back"};
  options.host_wait = std::chrono::seconds(30);
  options.first_retry = std::chrono::milliseconds(100);
  options.max_retry = std::chrono::milliseconds(200);
  SshLauncher launcher(options);
  const std::map<std::string, std::string> mark = {{"MARK_DIR", dir_.string()}};
  auto first = launcher.Launch(Specs(0, "s0", mark));
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  RunAll(*first);
  ASSERT_TRUE(launcher.PrepareNext(Specs(0, "s0", mark)).ok());
  // Cut off only once its standby runs there (its ssh connected).
  for (int i = 0; i < 600 && !std::filesystem::exists(dir_ / "standby-1"); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(std::filesystem::exists(dir_ / "standby-1"));
  std::filesystem::remove(dir_ / "back");
  std::thread comes_back([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    std::ofstream(dir_ / "back");
  });
  auto restart = launcher.Launch(Specs(1, "s1", mark));
  comes_back.join();
  ASSERT_TRUE(restart.ok()) << restart.status().ToString();
  std::vector<std::string> out = RunAll(*restart);
  EXPECT_TRUE(Contains(out[0], "rank 0 s1 1 standby")) << out[0];
  EXPECT_TRUE(Contains(out[1], "rank 1 s1 1 fresh")) << out[1];
  EXPECT_TRUE(Contains(Joined(launcher.TakeNotes()),
                       "the standby worker of rank 1 on back is not used: its host did not "
                       "answer; starting it afresh"));
}

TEST_F(WarmSshTest, StandbysOfAnotherPlacementAreEndedAndTheRestartIsCold) {
  SshLauncher launcher(WarmOptions());
  ASSERT_TRUE(launcher.PrepareNext(Specs(0, "s0", {{"SHAPE", "a"}})).ok());
  const std::vector<pid_t> pids = launcher.standby_pids();
  auto launched = launcher.Launch(Specs(1, "s1", {{"SHAPE", "b"}}));
  ASSERT_TRUE(launched.ok()) << launched.status().ToString();
  std::vector<std::string> out = RunAll(*launched);
  EXPECT_TRUE(Contains(out[0], "rank 0 s1 1 fresh")) << out[0];
  EXPECT_TRUE(Contains(Joined(launcher.TakeNotes()), "started for another placement"));
  for (pid_t pid : pids) EXPECT_TRUE(testing::SettledState(pid).empty()) << pid;
}

TEST_F(WarmSshTest, EndRunEndsTheStandbysAndTheirWorkers) {
  SshLauncher launcher(WarmOptions());
  // Each standby worker writes its pid to a file of its rank before it waits.
  std::map<std::string, std::string> env = {{"PID_DIR", dir_.string()}};
  std::vector<ProcessSpec> specs;
  for (int r = 0; r < 2; ++r) {
    specs.push_back(Python(r,
                           "import os\n"
                           "open(os.path.join(os.environ['PID_DIR'], 'pid' + "
                           "os.environ['JAXTRAIN_RANK']), 'w').write(str(os.getpid()))\n"
                           "os.read(int(os.environ['JAXTRAIN_RUN_SECRET_FD']), 100)\n",
                           {{"PID_DIR", dir_.string()}, {"JAXTRAIN_RANK", std::to_string(r)}}));
  }
  ASSERT_TRUE(launcher.PrepareNext(specs).ok());
  std::vector<pid_t> workers;
  for (int r = 0; r < 2; ++r) {
    const auto path = dir_ / ("pid" + std::to_string(r));
    auto written = [&] {
      std::error_code ec;
      const auto size = std::filesystem::file_size(path, ec);
      return !ec && size > 0;
    };
    for (int i = 0; i < 600 && !written(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    std::ifstream in(path);
    pid_t pid = 0;
    in >> pid;
    ASSERT_GT(pid, 0);
    workers.push_back(pid);
  }
  launcher.EndRun(false);
  EXPECT_TRUE(launcher.standby_pids().empty());
  for (pid_t pid : workers) {
    const std::string state = testing::SettledState(pid);
    EXPECT_TRUE(state.empty() || state == "Z") << "standby worker " << pid << ": " << state;
  }
}

TEST_F(WarmSshTest, APreloadFileOfThisHostIsShippedToTheStandbys) {
  SshLauncher launcher(WarmOptions());
  const std::string preload = (dir_ / "task.pkl").string();
  std::ofstream(preload) << "pickled bytes";
  ASSERT_TRUE(launcher.PrepareNext(Specs(0, "s0", {{"JAXTRAIN_PRELOAD_FILE", preload}})).ok());
  auto launched = launcher.Launch(Specs(1, "s1", {{"JAXTRAIN_PRELOAD_FILE", preload}}));
  ASSERT_TRUE(launched.ok()) << launched.status().ToString();
  std::vector<std::string> out = RunAll(*launched);
  // The standby got the bytes in a file of its own host, not this host's path.
  EXPECT_TRUE(Contains(out[0], "rank 0 s1 1 standby preload=pickled bytes at ")) << out[0];
  EXPECT_FALSE(Contains(out[0], preload)) << out[0];
  EXPECT_FALSE(Contains(ArgvLog(), "pickled")) << ArgvLog();
}

}  // namespace
}  // namespace jaxtrain::launch
