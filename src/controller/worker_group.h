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

  // `echo`: whether console text is made (a console to write it to exists).
  // Errors: as ErrnoError when the epoll set cannot be created.
  static StatusOr<std::unique_ptr<WorkerGroup>> Create(launch::Launcher& launcher, bool echo,
                                                       Delegate& delegate);
  ~WorkerGroup();  // closes what is left open; signals nothing (the launcher owns the processes)
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  // Starts the processes of `specs`, replacing the previous attempt's, which must all be reaped.
  // Errors: as Launcher::Launch() (nothing was started); kUnavailable when the processes cannot
  // be watched (out of memory for the epoll set): they are then killed and reaped, so nothing is
  // left running.
  Status Start(const std::vector<launch::ProcessSpec>& specs);

  // For the owner's poll(): readable when a process has output or has exited.
  int ready_fd() const { return epoll_fd_; }

  // Reads the output that is ready, then reaps the processes that have exited: at most 256
  // events per call, the rest stay ready.
  void OnReady();

  // Sends `signal` to every process (Launcher::SignalGroup). After SIGTERM, what the launcher
  // says is taken as a consequence of the stop (RankOutput::Stopping()).
  // Errors: those of Launcher::SignalGroup.
  Status Signal(int signal);

  // Processes started and not yet reaped.
  size_t running() const { return running_; }
  // Processes whose output is still open (it may outlast the process: a child holds the pipe).
  size_t outputs_open() const { return outputs_open_; }
  // Processes of this attempt.
  size_t size() const { return procs_.size(); }

  // Ends every output still open, with what is left of its unended line.
  void CloseOutputs();

 private:
  struct Proc {
    launch::LaunchedProcess launched;
    bool reaped = false;
    std::unique_ptr<RankOutput> output;
  };

  WorkerGroup(launch::Launcher& launcher, bool echo, int epoll_fd, Delegate& delegate);

  Status Watch();
  void ReadOutput(Proc& p);
  void CloseOutput(Proc& p);
  void Reap(Proc& p);

  launch::Launcher& launcher_;
  const bool echo_;
  // Every process's output (data.u64: 2 x its index in procs_) and pidfd (2 x index + 1) until
  // it is closed.
  const int epoll_fd_;
  Delegate& delegate_;
  std::vector<Proc> procs_;
  size_t running_ = 0;
  size_t outputs_open_ = 0;
};

}  // namespace jaxtrain::controller
