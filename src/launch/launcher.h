// Launcher: starts the processes of one worker group and signals them. It only starts processes;
// workers find the controller themselves over TCP, so every launcher shares the same control path.
//
// Implementations: LocalLauncher (this host, local_launcher.h). A launcher for a cluster engine
// (Slurm) implements the same interface; a launched process may then carry several ranks.
#pragma once

#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

#include "base/status.h"

namespace jaxtrain::launch {

struct ProcessSpec {
  std::vector<int> ranks;                  // the ranks this process runs
  std::vector<std::string> argv;           // argv[0] is an absolute path
  std::map<std::string, std::string> env;  // set on top of the launcher's own environment
  std::vector<std::string> unset_env;      // removed from it
  std::string cwd;                         // empty = the launcher's
  // The run's secret: handed to the process neither in its environment nor in its argv, where
  // /proc/PID/environ and ps would show it for the process's whole life. How is the launcher's
  // (LocalLauncher: an inherited pipe named by JAXTRAIN_RUN_SECRET_FD).
  std::string secret;
};

struct LaunchedProcess {
  std::vector<int> ranks;
  pid_t pid = -1;
  int pidfd = -1;      // readable once the process has exited
  int output_fd = -1;  // non-blocking read end of the process's stdout and stderr, merged
};

class Launcher {
 public:
  virtual ~Launcher() = default;

  // Starts every process or none: when one cannot be started, those already started are killed
  // and reaped before the error returns. The caller owns the returned descriptors.
  // Errors: kUnavailable when a process cannot be started (the message names it and why).
  virtual StatusOr<std::vector<LaunchedProcess>> Launch(const std::vector<ProcessSpec>& specs) = 0;

  // Sends `signal` to every process of the group started by the last Launch(), and to anything
  // they started in their process group.
  virtual void SignalGroup(int signal) = 0;
};

}  // namespace jaxtrain::launch
