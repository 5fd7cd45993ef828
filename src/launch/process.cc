#include "launch/process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "base/strings.h"

extern char** environ;

// Both are newer than glibc 2.28, the oldest the wheels run on (docs/packaging.md): weak, so the
// module loads there too, and each use first checks that the running glibc has it.
#pragma weak sigabbrev_np                          // glibc 2.32
#pragma weak posix_spawn_file_actions_addchdir_np  // glibc 2.29

namespace jaxtrain::launch {

std::string SignalName(int signal) {
  const char* abbrev = sigabbrev_np ? sigabbrev_np(signal) : nullptr;
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(signal);
}

std::string ExitStatus::ToString() const {
  if (signal != 0) {
    return "killed by signal " + std::to_string(signal) + " (" + SignalName(signal) + ")" +
           (core_dumped ? ", core dumped" : "");
  }
  return "exited with status " + std::to_string(exit_code);
}

std::optional<ExitStatus> TryReap(pid_t pid) {
  int status = 0;
  pid_t r;
  do {
    r = waitpid(pid, &status, WNOHANG);
  } while (r < 0 && errno == EINTR);
  if (r == 0) return std::nullopt;
  ExitStatus s;
  if (r < 0) {
    // Already reaped elsewhere (e.g. SIGCHLD ignored): the status is lost.
    s.exit_code = -1;
    return s;
  }
  if (WIFEXITED(status)) {
    s.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    s.signal = WTERMSIG(status);
    s.core_dumped = WCOREDUMP(status);
  }
  return s;
}

ExitStatus WaitForExit(pid_t pid) {
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  ExitStatus s;
  if (WIFEXITED(status)) s.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) {
    s.signal = WTERMSIG(status);
    s.core_dumped = WCOREDUMP(status);
  }
  return s;
}

Status SignalProcessGroup(pid_t pgid, int signal) {
  if (killpg(pgid, signal) == 0 || errno == ESRCH) return OkStatus();
  return UnavailableError("cannot send " + SignalName(signal) + " to process group " +
                          std::to_string(pgid) + ": " + std::strerror(errno));
}

std::map<std::string, std::string> CurrentEnvironment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry(*e);
    size_t eq = entry.find('=');
    if (eq != std::string::npos) env[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  return env;
}

SpawnOptions ChdirThroughShell(const SpawnOptions& options) {
  SpawnOptions shell = options;
  shell.argv = {"/bin/sh", "-c", R"(cd -- "$0" && exec "$@")", options.cwd};
  shell.argv.insert(shell.argv.end(), options.argv.begin(), options.argv.end());
  shell.cwd.clear();
  shell.search_path = false;
  return shell;
}

StatusOr<int> PipeHolding(std::string_view data) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return ErrnoError("pipe2", errno);
  ssize_t n = write(fds[1], data.data(), data.size());
  const int err = errno;
  close(fds[1]);
  if (n != static_cast<ssize_t>(data.size())) {
    close(fds[0]);
    return ErrnoError("writing to a pipe", n < 0 ? err : EPIPE);
  }
  if (fds[0] >= 3) return fds[0];
  // 0-2 are a child's stdio: move the pipe above them (a driver started with stdin closed).
  int moved = fcntl(fds[0], F_DUPFD_CLOEXEC, 3);
  const int dup_err = errno;
  close(fds[0]);
  if (moved < 0) return ErrnoError("fcntl(F_DUPFD_CLOEXEC)", dup_err);
  return moved;
}

StatusOr<Spawned> SpawnWithOutputPipe(const SpawnOptions& options) {
  if (!options.cwd.empty() && !posix_spawn_file_actions_addchdir_np) {
    return SpawnWithOutputPipe(ChdirThroughShell(options));
  }
  int pipefd[2];
  if (pipe2(pipefd, O_CLOEXEC) != 0) return ErrnoError("pipe2", errno);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (options.stdin_fd >= 0) {
    posix_spawn_file_actions_adddup2(&actions, options.stdin_fd, 0);
  } else {
    posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  }
  posix_spawn_file_actions_adddup2(&actions, pipefd[1], 1);
  posix_spawn_file_actions_adddup2(&actions, pipefd[1], 2);
  if (!options.cwd.empty()) posix_spawn_file_actions_addchdir_np(&actions, options.cwd.c_str());
  // dup2 onto itself clears close-on-exec in the child only (POSIX.1-2024; glibc >= 2.29).
  if (options.inherit_fd >= 3) {
    posix_spawn_file_actions_adddup2(&actions, options.inherit_fd, options.inherit_fd);
  }

  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t empty, all;
  sigemptyset(&empty);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&attr, &empty);
  posix_spawnattr_setsigdefault(&attr, &all);
  short flags = POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF;
  if (options.process_group) {
    posix_spawnattr_setpgroup(&attr, *options.process_group);
    flags |= POSIX_SPAWN_SETPGROUP;
  }
  posix_spawnattr_setflags(&attr, flags);

  std::vector<std::string> args = options.argv;
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_strings = options.env ? *options.env : std::vector<std::string>{};
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  char** child_env = options.env ? envp.data() : environ;

  pid_t pid = -1;
  int rc = options.search_path
               ? posix_spawnp(&pid, argv[0], &actions, &attr, argv.data(), child_env)
               : posix_spawn(&pid, argv[0], &actions, &attr, argv.data(), child_env);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  close(pipefd[1]);
  if (rc != 0) {
    close(pipefd[0]);
    return Status(rc == ENOENT ? StatusCode::kNotFound : StatusCode::kUnavailable,
                  std::strerror(rc));
  }
  return Spawned{pid, pipefd[0]};
}

StatusOr<std::string> RunToEnd(SpawnOptions options, Duration timeout, int cancel_fd) {
  options.process_group = 0;
  StatusOr<Spawned> spawned = SpawnWithOutputPipe(options);
  if (!spawned.ok()) {
    return Status(spawned.status().code(),
                  "cannot start '" + options.argv[0] + "': " + spawned.status().message());
  }
  const Spawned p = *spawned;
  std::string out;
  char buf[4096];
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  bool timed_out = false;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                    deadline - std::chrono::steady_clock::now())
                    .count();
    pollfd ready[] = {{p.output_fd, POLLIN, 0}, {cancel_fd, POLLIN, 0}};  // -1 is ignored
    int r = left > 0 ? poll(ready, 2, static_cast<int>(std::min<int64_t>(left, 1 << 30))) : 0;
    if (r < 0 && errno == EINTR) continue;
    if (r > 0 && ready[1].revents != 0) {
      killpg(p.pid, SIGKILL);
      close(p.output_fd);
      WaitForExit(p.pid);
      return CancelledError("'" + options.argv[0] + "' was stopped: the run is being stopped");
    }
    if (r == 0) {
      timed_out = true;
      killpg(p.pid, SIGKILL);
      break;
    }
    ssize_t n = read(p.output_fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  close(p.output_fd);
  ExitStatus exit = WaitForExit(p.pid);
  const std::string command = Join(options.argv, " ");
  if (timed_out) {
    return DeadlineExceededError("'" + command + "' did not finish within " +
                                 FormatNumber(std::chrono::duration<double>(timeout).count()) +
                                 " s and was killed");
  }
  if (!exit.ok())
    return UnavailableError("'" + command + "' " + exit.ToString() + ": " + Trim(out));
  return out;
}

}  // namespace jaxtrain::launch
