// WorkerGroup: one attempt's worker processes, from launch to reaped.
//
// It starts them through the Launcher, watches every process's pidfd and output pipe in one epoll
// set (a wake costs O(ready processes), not O(processes)), splits each process's output into its
// ranks' logs and console text (RankOutput, rank_output.h), signals them as a group, and reaps
// them. What a process's exit means for the run (a failure, whose, and why) is the owner's to
// decide: the group reports each exit with what the launcher said about its ranks.
//
// A process's state, as the group sees it:
//
//   Start() ──> running ──pidfd readable, reaped──> exited (Delegate::OnExit)
//                  │ output pipe: Delegate::OnLog, OnConsole, until EOF or CloseOutputs()
//
// Output is handled before exits within one OnReady(): a process's last lines are logged before
// its exit is reported.
//
// Threads: not thread-safe; one owner (the controller's loop) calls every method. The Delegate
// is called from within OnReady() and CloseOutputs(), and may call Signal() from there.
//
// An interface, because it is where the controller meets processes: Create() makes the group of
// real ones; tests of the controller's state machine use FakeWorkerGroup (testing/).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "controller/rank_output.h"
#include "launch/launcher.h"
#include "launch/process.h"

namespace jaxtrain::controller {

class WorkerGroup {
 public:
  class Delegate {
   public:
    virtual ~Delegate() = default;
    // Output of `rank` for its log, as it arrives.
    virtual void OnLog(int rank, std::string_view text) = 0;
    // Text for the console: whole lines, each with its rank's prefix (RankOutput).
    virtual void OnConsole(std::string text) = 0;
    // A process has exited and is reaped: its ranks, its exit status, and its output's record of
    // what the launcher said (RankOutput::task_ends(), launcher_error()).
    virtual void OnExit(const std::vector<int>& ranks, const launch::ExitStatus& status,
                        const RankOutput& output) = 0;
  };

  // The group of real processes, started by `launcher`. `echo`: whether console text is made (a
  // console to write it to exists).
  // Errors: as ErrnoError when the epoll set cannot be created.
  static StatusOr<std::unique_ptr<WorkerGroup>> Create(launch::Launcher& launcher, bool echo,
                                                       Delegate& delegate);
  // Closes what is left open; signals nothing (the launcher owns the processes).
  virtual ~WorkerGroup() = default;

  // Starts the processes of `specs`, replacing the previous attempt's, which must all be reaped.
  // Errors: as Launcher::Launch() (nothing was started); kUnavailable when the processes cannot
  // be watched (out of memory for the epoll set): they are then killed and reaped, so nothing is
  // left running.
  virtual Status Start(const std::vector<launch::ProcessSpec>& specs) = 0;

  // For the owner's poll(): readable when a process has output or has exited.
  virtual int ready_fd() const = 0;

  // Reads the output that is ready, then reaps the processes that have exited: at most 256
  // events per call, the rest stay ready.
  virtual void OnReady() = 0;

  // Sends `signal` to every process (Launcher::SignalGroup). After SIGTERM, what the launcher
  // says is taken as a consequence of the stop (RankOutput::Stopping()).
  // Errors: those of Launcher::SignalGroup.
  virtual Status Signal(int signal) = 0;

  // `rank`'s control connection timed out: tells the launcher which of its processes carries the
  // rank (Launcher::Unreachable), unless that process is already reaped.
  virtual void Unreachable(int rank) = 0;

  // Processes started and not yet reaped.
  virtual size_t running() const = 0;
  // Processes whose output is still open (it may outlast the process: a child holds the pipe).
  virtual size_t outputs_open() const = 0;
  // Processes of this attempt.
  virtual size_t size() const = 0;

  // Ends every output still open, with what is left of its unended line.
  virtual void CloseOutputs() = 0;
};

}  // namespace jaxtrain::controller
