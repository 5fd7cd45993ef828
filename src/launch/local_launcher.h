// LocalLauncher: worker processes on this host, all in one new process group (led by the first),
// with their stdout and stderr on one pipe each and stdin from /dev/null. A spec's secret reaches
// its process on an inherited pipe: JAXTRAIN_RUN_SECRET_FD names the descriptor, which holds the
// secret and then EOF (the worker reads and closes it). Signals go to the whole
// group, so whatever a worker starts is signalled too. The caller must not signal a group whose
// processes it has all reaped. Not thread-safe: used by the controller's event loop only.
//
// Warm workers (docs/warm-workers.md): with a StandbyPool, PrepareNext() starts the next
// attempt's processes ahead as standbys, and Launch() activates those whose key matches its specs
// (the group is then the standbys' group), starting the others fresh in it; EndRun(true) and the
// destructor leave unused standbys in the pool for the next LocalLauncher of the same processes.
#pragma once

#include <string>
#include <vector>

#include "launch/launcher.h"
#include "launch/standby_pool.h"

namespace jaxtrain::launch {

class LocalLauncher : public Launcher {
 public:
  // `standbys`: where standby workers are kept (StandbyPool::Driver() in a driver); nullptr:
  // every process starts fresh (JAXTRAIN_WARM_WORKERS=0).
  explicit LocalLauncher(StandbyPool* standbys = nullptr) : standbys_(standbys) {}
  ~LocalLauncher() override;

  StatusOr<std::vector<LaunchedProcess>> Launch(const std::vector<ProcessSpec>& specs) override;
  Status SignalGroup(int signal) override;
  Status PrepareNext(const std::vector<ProcessSpec>& specs) override;
  void EndRun(bool keep) override;
  std::vector<std::string> TakeNotes() override;
  std::vector<std::string> TakeDetails() override;

 private:
  StandbyPool* const standbys_;
  pid_t pgid_ = 0;  // the group of the last Launch(); 0 when none
  bool said_off_ = false;
  std::vector<std::string> notes_;
  std::vector<std::string> details_;  // for TakeDetails()
};

}  // namespace jaxtrain::launch
