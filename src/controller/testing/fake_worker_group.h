// FakeProcesses: worker processes without processes, for tests of the controller's state machine
// (ControllerSeams::make_group = processes.Maker()). One process per spec, as the local launcher
// starts them.
//
// The test plays the processes: Exit() ends a rank's process with a status; and reads what the
// controller did to them (WaitForStarts(), WaitForSignal(), signals()).
// What the test posts reaches the controller's loop in the order posted, on the loop's thread:
// the group it made (FakeWorkerGroup) becomes ready and hands the events to its delegate in
// OnReady(), as a real group does once it has reaped a process.
//
// Signals: SIGKILL ends every running process; SIGTERM too, unless IgnoreSigterm() (a worker that
// hangs in its handler); the exit is reported as the signal's, except for a process that had
// died already (Die()). A start fails when FailStarts()
// said so. Posts for processes of an earlier start are dropped, as their processes are gone.
//
// Threads: the test's methods from any thread; the group's from the controller's loop.
// Must outlive the controller whose group it serves.
#pragma once

#include <signal.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/mutex.h"
#include "controller/worker_group.h"

namespace jaxtrain::controller {

class FakeProcesses {
 public:
  FakeProcesses() : ready_fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}
  ~FakeProcesses() { close(ready_fd_); }
  FakeProcesses(const FakeProcesses&) = delete;
  FakeProcesses& operator=(const FakeProcesses&) = delete;

  // For ControllerSeams::make_group.
  std::function<StatusOr<std::unique_ptr<WorkerGroup>>(launch::Launcher&, bool,
                                                       WorkerGroup::Delegate&)>
  Maker();

  // The process of `rank` (of the latest start) exits.
  void Exit(int rank, launch::ExitStatus status) EXCLUDES(mu_) {
    MutexLock lock(mu_);
    PostLocked({.start = starts_, .rank = rank, .exit = status});
  }
  void Exit(int rank, int exit_code) { Exit(rank, launch::ExitStatus{.exit_code = exit_code}); }
  void Kill(int rank, int signal) { Exit(rank, launch::ExitStatus{.signal = signal}); }
  // The process of `rank` has ended with `status`, but the controller sees its exit only after
  // the next signal to the group, which the dead process ignores: the order in which a crash is
  // often seen, its connection's close first.
  void Die(int rank, launch::ExitStatus status) EXCLUDES(mu_) {
    MutexLock lock(mu_);
    dead_.push_back({.start = starts_, .rank = rank, .exit = status});
  }
  // The process of `rank` (of the latest start) prints `text`.

  // The next `count` starts fail with `why` (as a launcher that cannot start the group).
  void FailStarts(int count, Status why) EXCLUDES(mu_) {
    MutexLock lock(mu_);
    failing_starts_ = count;
    start_error_ = std::move(why);
  }
  // The next start runs `hook` on the controller's loop thread, where a launcher's Launch()
  // runs, and fails with what it returns unless that is OK.
  void OnNextStart(std::function<Status()> hook) EXCLUDES(mu_) {
    MutexLock lock(mu_);
    next_start_ = std::move(hook);
  }
  // SIGTERM leaves the processes running; only SIGKILL ends them.
  void IgnoreSigterm() EXCLUDES(mu_) {
    MutexLock lock(mu_);
    ignore_sigterm_ = true;
  }

  // Waits up to `timeout` until the group has been started `count` times, in all.
  bool WaitForStarts(int count, std::chrono::seconds timeout) EXCLUDES(mu_) {
    MutexLock lock(mu_);
    return cv_.WaitFor(mu_, timeout, [&]() REQUIRES(mu_) { return starts_ >= count; });
  }
  // Waits up to `timeout` until `signal` has been sent to the group `count` times, in all.
  bool WaitForSignal(int signal, int count, std::chrono::seconds timeout) EXCLUDES(mu_) {
    MutexLock lock(mu_);
    return cv_.WaitFor(mu_, timeout, [&]() REQUIRES(mu_) { return CountLocked(signal) >= count; });
  }
  int signals(int signal) const EXCLUDES(mu_) {
    MutexLock lock(mu_);
    return CountLocked(signal);
  }
  // The ranks the group was told had timed out (WorkerGroup::Unreachable), in order, and how
  // many signals the group had been sent before each.
  std::vector<int> unreachable() const EXCLUDES(mu_) {
    MutexLock lock(mu_);
    return unreachable_;
  }
  std::vector<size_t> signals_before_unreachable() const EXCLUDES(mu_) {
    MutexLock lock(mu_);
    return signals_before_unreachable_;
  }
  int starts() const EXCLUDES(mu_) {
    MutexLock lock(mu_);
    return starts_;
  }

 private:
  friend class FakeWorkerGroup;

  struct Event {
    int start = 0;
    int rank = -1;
    launch::ExitStatus exit;
  };

  void PostLocked(Event e) REQUIRES(mu_) {
    events_.push_back(std::move(e));
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(ready_fd_, &one, sizeof(one));
  }

  int CountLocked(int signal) const REQUIRES(mu_) {
    int n = 0;
    for (int s : signals_) n += s == signal ? 1 : 0;
    return n;
  }

  // A start: fails as told, or counts.
  Status Start() EXCLUDES(mu_) {
    std::function<Status()> hook;
    {
      MutexLock lock(mu_);
      hook = std::move(next_start_);
      next_start_ = nullptr;
    }
    if (hook) JT_RETURN_IF_ERROR(hook());  // without the lock: it may call into the controller
    MutexLock lock(mu_);
    if (failing_starts_ > 0) {
      --failing_starts_;
      return start_error_;
    }
    ++starts_;
    cv_.NotifyAll();
    return OkStatus();
  }

  // `rank` told unreachable, after as many signals as were sent so far.
  void Unreachable(int rank) EXCLUDES(mu_) {
    MutexLock lock(mu_);
    unreachable_.push_back(rank);
    signals_before_unreachable_.push_back(signals_.size());
  }

  // `signal` sent to the group: the exits of the dead are posted, and those it causes among the
  // other `running` ranks.
  void Signal(int signal, const std::vector<int>& running) EXCLUDES(mu_) {
    MutexLock lock(mu_);
    signals_.push_back(signal);
    cv_.NotifyAll();
    std::vector<int> dead;
    for (Event& e : dead_) {
      dead.push_back(e.rank);
      PostLocked(std::move(e));
    }
    dead_.clear();
    if (signal != SIGKILL && (signal != SIGTERM || ignore_sigterm_)) return;
    for (int rank : running) {
      if (std::find(dead.begin(), dead.end(), rank) == dead.end()) {
        PostLocked({.start = starts_, .rank = rank, .exit = {.signal = signal}});
      }
    }
  }

  std::deque<Event> Take() EXCLUDES(mu_) {
    MutexLock lock(mu_);
    std::deque<Event> taken;
    taken.swap(events_);
    uint64_t count;
    [[maybe_unused]] ssize_t n = read(ready_fd_, &count, sizeof(count));
    std::erase_if(taken, [start = starts_](const Event& e) { return e.start != start; });
    return taken;
  }

  const int ready_fd_;  // an eventfd: readable while events wait
  mutable Mutex mu_;
  CondVar cv_;
  std::deque<Event> events_ GUARDED_BY(mu_);
  std::vector<Event> dead_ GUARDED_BY(mu_);  // Die(): posted with the next signal
  int starts_ GUARDED_BY(mu_) = 0;
  std::vector<int> signals_ GUARDED_BY(mu_);
  int failing_starts_ GUARDED_BY(mu_) = 0;
  Status start_error_ GUARDED_BY(mu_);
  bool ignore_sigterm_ GUARDED_BY(mu_) = false;
  std::vector<int> unreachable_ GUARDED_BY(mu_);
  std::vector<size_t> signals_before_unreachable_ GUARDED_BY(mu_);
  std::function<Status()> next_start_ GUARDED_BY(mu_);
};

// The group the controller owns: which ranks' processes run is the loop's state.
class FakeWorkerGroup final : public WorkerGroup {
 public:
  FakeWorkerGroup(FakeProcesses& processes, Delegate& delegate)
      : processes_(processes), delegate_(delegate) {}

  Status Start(const std::vector<launch::ProcessSpec>& specs) override {
    JT_RETURN_IF_ERROR(processes_.Start());
    procs_.clear();
    for (const auto& spec : specs) {
      procs_.push_back(
          {.ranks = spec.ranks,
           .output = std::make_unique<RankOutput>(
               spec.ranks, /*echo=*/false,
               [this](int rank, std::string_view text) { delegate_.OnLog(rank, text); },
               [](std::string_view) { return std::nullopt; })});
    }
    return OkStatus();
  }
  int ready_fd() const override { return processes_.ready_fd_; }
  void OnReady() override {
    for (auto& e : processes_.Take()) {
      Proc* p = Find(e.rank);
      if (p == nullptr || !p->running) continue;
      p->running = false;
      delegate_.OnExit(p->ranks, e.exit, *p->output);
    }
  }
  void Unreachable(int rank) override { processes_.Unreachable(rank); }
  Status Signal(int signal) override {
    if (signal == SIGTERM) {
      for (Proc& p : procs_) p.output->Stopping();
    }
    std::vector<int> running;
    for (const Proc& p : procs_) {
      if (p.running) running.push_back(p.ranks.front());
    }
    processes_.Signal(signal, running);
    return OkStatus();
  }
  size_t running() const override {
    size_t n = 0;
    for (const Proc& p : procs_) n += p.running ? 1 : 0;
    return n;
  }
  size_t outputs_open() const override { return 0; }
  size_t size() const override { return procs_.size(); }
  void CloseOutputs() override {
    for (Proc& p : procs_) (void)p.output->Close();
  }

 private:
  struct Proc {
    std::vector<int> ranks;
    std::unique_ptr<RankOutput> output;
    bool running = true;
  };

  Proc* Find(int rank) {
    for (Proc& p : procs_) {
      for (int r : p.ranks) {
        if (r == rank) return &p;
      }
    }
    return nullptr;
  }

  FakeProcesses& processes_;
  Delegate& delegate_;
  std::vector<Proc> procs_;
};

inline std::function<StatusOr<std::unique_ptr<WorkerGroup>>(launch::Launcher&, bool,
                                                            WorkerGroup::Delegate&)>
FakeProcesses::Maker() {
  return [this](launch::Launcher&, bool,
                WorkerGroup::Delegate& delegate) -> StatusOr<std::unique_ptr<WorkerGroup>> {
    return std::unique_ptr<WorkerGroup>(new FakeWorkerGroup(*this, delegate));
  };
}

}  // namespace jaxtrain::controller
