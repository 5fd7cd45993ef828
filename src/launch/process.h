// Reaping and describing the exit of a child process. Thread-safe (no shared state).
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>

namespace jaxtrain::launch {

struct ExitStatus {
  int exit_code = -1;  // when the process exited
  int signal = 0;      // when a signal ended it
  bool core_dumped = false;
  bool ok() const { return signal == 0 && exit_code == 0; }
  // "exited with status 1", "killed by signal 9 (SIGKILL)".
  std::string ToString() const;
};

// waitpid(pid, WNOHANG): the status if the process has exited, nullopt while it runs.
std::optional<ExitStatus> TryReap(pid_t pid);

// "SIGKILL" for 9, "signal 64" when unnamed.
std::string SignalName(int signal);

}  // namespace jaxtrain::launch
