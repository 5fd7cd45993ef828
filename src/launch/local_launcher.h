// LocalLauncher: worker processes on this host, all in one new process group (led by the first),
// with their stdout and stderr on one pipe each and stdin from /dev/null. A spec's secret reaches
// its process on an inherited pipe: JAXTRAIN_RUN_SECRET_FD names the descriptor, which holds the
// secret and then EOF (the worker reads and closes it). Signals go to the whole
// group, so whatever a worker starts is signalled too. The caller must not signal a group whose
// processes it has all reaped. Not thread-safe: used by the controller's event loop only.
#pragma once

#include "launch/launcher.h"

namespace jaxtrain::launch {

class LocalLauncher : public Launcher {
 public:
  StatusOr<std::vector<LaunchedProcess>> Launch(const std::vector<ProcessSpec>& specs) override;
  Status SignalGroup(int signal) override;

 private:
  pid_t pgid_ = 0;  // the group of the last Launch(); 0 when none
};

}  // namespace jaxtrain::launch
