#include "launch/process.h"

#include <signal.h>
#include <string.h>
#include <sys/wait.h>

#include <cerrno>

namespace jaxtrain::launch {

std::string SignalName(int signal) {
  const char* abbrev = sigabbrev_np(signal);
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

}  // namespace jaxtrain::launch
