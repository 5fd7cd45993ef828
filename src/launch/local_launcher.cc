#include "launch/local_launcher.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "launch/process.h"

namespace jaxtrain::launch {
namespace {

constexpr char kSecretFdEnv[] = "JAXTRAIN_RUN_SECRET_FD";

std::vector<std::string> BuildEnv(const ProcessSpec& spec) {
  std::map<std::string, std::string> env = CurrentEnvironment();
  // A driver that is itself a worker of another run must not hand that run's secret on.
  for (const char* name : {"JAXTRAIN_RUN_SECRET", "JAXTRAIN_RUN_SECRET_FILE", kSecretFdEnv}) {
    env.erase(name);
  }
  for (const auto& name : spec.unset_env) env.erase(name);
  for (const auto& [k, v] : spec.env) env[k] = v;
  std::vector<std::string> out;
  out.reserve(env.size());
  for (const auto& [k, v] : env) out.push_back(k + "=" + v);
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
    Status killed = SignalGroup(SIGKILL);
    if (!killed.ok()) s = Status(s.code(), s.message() + " (and " + killed.message() + ")");
    for (auto& p : launched) {
      waitpid(p.pid, nullptr, 0);
      close(p.pidfd);
      close(p.output_fd);
    }
    pgid_ = 0;
    return s;
  };

  for (const auto& spec : specs) {
    std::vector<std::string> env = BuildEnv(spec);
    int secret_fd = -1;
    if (!spec.secret.empty()) {
      auto fd = PipeHolding(spec.secret);
      if (!fd.ok()) {
        return fail(UnavailableError("cannot start the process of rank " + RanksText(spec.ranks) +
                                     ": " + fd.status().message()));
      }
      secret_fd = *fd;
      env.push_back(std::string(kSecretFdEnv) + "=" + std::to_string(secret_fd));
    }
    auto spawned = SpawnWithOutputPipe({.argv = spec.argv,
                                        .env = &env,
                                        .cwd = spec.cwd,
                                        .process_group = pgid_,
                                        .inherit_fd = secret_fd});
    if (secret_fd >= 0) close(secret_fd);
    if (!spawned.ok()) {
      return fail(UnavailableError("cannot start the process of rank " + RanksText(spec.ranks) +
                                   " (" + spec.argv[0] + "): " + spawned.status().message()));
    }
    const pid_t pid = spawned->pid;
    const int output_fd = spawned->output_fd;
    if (pgid_ == 0) pgid_ = pid;
    int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
    if (pidfd < 0) {
      int err = errno;
      close(output_fd);
      launched.push_back({spec.ranks, pid, -1, -1});
      return fail(ErrnoError("pidfd_open", err));
    }
    fcntl(pidfd, F_SETFD, FD_CLOEXEC);
    fcntl(output_fd, F_SETFL, fcntl(output_fd, F_GETFL) | O_NONBLOCK);
    launched.push_back({spec.ranks, pid, pidfd, output_fd});
  }
  return launched;
}

Status LocalLauncher::SignalGroup(int signal) {
  return pgid_ > 0 ? SignalProcessGroup(pgid_, signal) : OkStatus();
}

}  // namespace jaxtrain::launch
