#include "launch/local_launcher.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

extern char** environ;

namespace jaxtrain::launch {
namespace {

std::vector<std::string> BuildEnv(const ProcessSpec& spec) {
  std::map<std::string, std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry(*e);
    size_t eq = entry.find('=');
    if (eq != std::string::npos) env[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  for (const auto& name : spec.unset_env) env.erase(name);
  for (const auto& [k, v] : spec.env) env[k] = v;
  std::vector<std::string> out;
  out.reserve(env.size());
  for (const auto& [k, v] : env) out.push_back(k + "=" + v);
  return out;
}

std::vector<char*> CStrings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

std::string RanksText(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ",") + std::to_string(r);
  return out;
}

}  // namespace

StatusOr<std::vector<LaunchedProcess>> LocalLauncher::Launch(
    const std::vector<ProcessSpec>& specs) {
  pgid_ = 0;
  std::vector<LaunchedProcess> launched;
  auto fail = [&](Status s) -> Status {
    SignalGroup(SIGKILL);
    for (auto& p : launched) {
      waitpid(p.pid, nullptr, 0);
      close(p.pidfd);
      close(p.output_fd);
    }
    pgid_ = 0;
    return s;
  };

  for (const auto& spec : specs) {
    int pipefd[2];
    if (pipe2(pipefd, O_CLOEXEC) != 0) return fail(ErrnoError("pipe2", errno));

    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_adddup2(&actions, pipefd[1], 1);
    posix_spawn_file_actions_adddup2(&actions, pipefd[1], 2);
    if (!spec.cwd.empty()) posix_spawn_file_actions_addchdir_np(&actions, spec.cwd.c_str());

    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    sigset_t empty, all;
    sigemptyset(&empty);
    sigfillset(&all);
    posix_spawnattr_setsigmask(&attr, &empty);
    posix_spawnattr_setsigdefault(&attr, &all);
    posix_spawnattr_setpgroup(&attr, pgid_);  // 0 = a new group led by the first worker
    posix_spawnattr_setflags(
        &attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);

    std::vector<std::string> argv_strings = spec.argv;
    std::vector<std::string> env_strings = BuildEnv(spec);
    std::vector<char*> argv = CStrings(argv_strings);
    std::vector<char*> envp = CStrings(env_strings);
    pid_t pid = -1;
    int rc = posix_spawn(&pid, argv[0], &actions, &attr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attr);
    close(pipefd[1]);
    if (rc != 0) {
      close(pipefd[0]);
      return fail(UnavailableError("cannot start the process of rank " + RanksText(spec.ranks) +
                                   " (" + spec.argv[0] + "): " + std::strerror(rc)));
    }
    if (pgid_ == 0) pgid_ = pid;
    int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
    if (pidfd < 0) {
      int err = errno;
      close(pipefd[0]);
      launched.push_back({spec.ranks, pid, -1, -1});
      return fail(ErrnoError("pidfd_open", err));
    }
    fcntl(pidfd, F_SETFD, FD_CLOEXEC);
    fcntl(pipefd[0], F_SETFL, fcntl(pipefd[0], F_GETFL) | O_NONBLOCK);
    launched.push_back({spec.ranks, pid, pidfd, pipefd[0]});
  }
  return launched;
}

void LocalLauncher::SignalGroup(int signal) {
  if (pgid_ > 0) killpg(pgid_, signal);
}

}  // namespace jaxtrain::launch
