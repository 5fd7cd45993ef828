// Reaping and describing the exit of a child process. Thread-safe (no shared state).
#pragma once

#include <sys/types.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "base/clock.h"
#include "base/status.h"

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

// waitpid(pid) until it has exited (EINTR retried).
ExitStatus WaitForExit(pid_t pid);

// This process's environment: name -> value.
std::map<std::string, std::string> CurrentEnvironment();

// "SIGKILL" for 9, "signal 64" when unnamed (and every signal on glibc before 2.32).
std::string SignalName(int signal);

// killpg(pgid, signal). A group with no process left (ESRCH) is not an error: it has ended.
// Errors: kUnavailable naming the signal, the group and errno's text (EPERM: the group is not
// ours any more).
Status SignalProcessGroup(pid_t pgid, int signal);

struct SpawnOptions {
  std::vector<std::string> argv;                  // argv[0]: a path, or a name when search_path
  const std::vector<std::string>* env = nullptr;  // "NAME=value" entries; null: this process's
  std::string cwd;                                // empty: this process's
  std::optional<pid_t> process_group;             // join it (0: a new group led by the child)
  bool search_path = false;                       // look argv[0] up in PATH
  // A descriptor (>= 3) the child inherits under the same number; it stays close-on-exec here.
  int inherit_fd = -1;
  int stdin_fd = -1;  // the child's stdin (the caller keeps and closes it); -1: /dev/null
};

struct Spawned {
  pid_t pid = -1;
  int output_fd = -1;  // the read end of the child's stdout and stderr, blocking, close-on-exec
};

// Starts a child with stdin from /dev/null (or options.stdin_fd), stdout and stderr on one pipe, no
// blocked signals and every signal's default action. The caller owns the pid and the descriptor.
// Errors: kNotFound when argv[0] does not exist, kUnavailable when it cannot be started
// otherwise (the message is the system's reason; callers add what they were starting).
// On glibc before 2.29, which cannot change a spawned child's directory, a child with a cwd runs
// through ChdirThroughShell: then a missing argv[0] is the shell's exit status 127, not kNotFound.
StatusOr<Spawned> SpawnWithOutputPipe(const SpawnOptions& options);

// The read end (>= 3, close-on-exec) of a pipe that holds `data` and then ends: a child that
// inherits it (SpawnOptions::inherit_fd or stdin_fd) reads `data` to EOF. `data` must fit a
// pipe's buffer (4 KiB at least; the run secret is 64 bytes), so writing it never blocks.
// Errors: kInternal when the pipe cannot be made or written.
StatusOr<int> PipeHolding(std::string_view data);

// Runs a short command to its end (in a new process group, stdin from /dev/null), its stdout and
// stderr collected: killed, with its group, after `timeout`, or as soon as `cancel_fd` (>= 0)
// becomes readable.
// Errors: kNotFound or kUnavailable ("cannot start 'X': ...") as SpawnWithOutputPipe;
// kUnavailable with its output when it exits non-zero; kDeadlineExceeded naming it when it
// outlives `timeout`; kCancelled when cancelled.
StatusOr<std::string> RunToEnd(SpawnOptions options, Duration timeout, int cancel_fd = -1);

// The same child started as /bin/sh, which changes to options.cwd and then execs options.argv.
SpawnOptions ChdirThroughShell(const SpawnOptions& options);

}  // namespace jaxtrain::launch
