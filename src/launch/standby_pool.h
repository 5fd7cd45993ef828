// StandbyPool: worker processes started ahead of the attempt that uses them ("warm workers",
// docs/warm-workers.md). A standby is the process a LocalLauncher would start for a spec, started
// early: it imports jax and then blocks reading its activation from an inherited pipe (named by
// JAXTRAIN_RUN_SECRET_FD, with JAXTRAIN_STANDBY=1 in its environment). The activation is one JSON
// object, {"secret": ..., "env": {name: value}}, the run's secret and the variables that change
// from one attempt or fit() to the next (kActivationEnv), which the standby's own environment
// lacks; the worker sets them and goes on as a freshly started one would. A standby that reads EOF
// instead (its pool ended it, or the driver is gone) exits 0: no standby outlives its driver.
//
// No process forks after importing jax, so nothing depends on which threads an import started.
//
// Standbys are kept in sets, one per owner (a LocalLauncher, for its next attempt), each set in a
// process group of its own led by its first member, so that signals to the running group do not
// reach them. When its owner ends, a set becomes free: the next owner whose specs have the same
// keys, slot for slot, takes it (a second fit() in the same driver); free sets of other keys are
// ended when an owner takes one. A key is everything that shapes a process before activation:
// argv, cwd, the ranks, the environment but for kActivationEnv.
//
// Thread-safe: every method takes the pool's lock.
#pragma once

#include <sys/types.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "base/mutex.h"
#include "base/status.h"
#include "launch/launcher.h"

namespace jaxtrain::launch {

// Set on each activation, never in a standby's environment.
inline constexpr const char* kActivationEnv[] = {"JAXTRAIN_ATTEMPT", "JAXTRAIN_CONTROLLER_ADDR",
                                                 "JAXTRAIN_RUN_DIR", "JAXTRAIN_EXPERIMENT_NAME"};

// Whether `name` is one of kActivationEnv.
bool IsActivationName(const std::string& name);

// Names the file of the pickled task a standby preloads (python/jaxtrain/worker.py).
inline constexpr char kPreloadFileEnv[] = "JAXTRAIN_PRELOAD_FILE";

// Names the inherited pipe a local process reads the run's secret from.
inline constexpr char kSecretFdEnv[] = "JAXTRAIN_RUN_SECRET_FD";

// The environment a local process of `spec` gets: this process's, less any run secret it was
// handed, less spec.unset_env, plus spec.Env().
std::map<std::string, std::string> LocalEnvironment(const ProcessSpec& spec);

// `env` as "NAME=value" entries, for execve.
std::vector<std::string> EnvironmentEntries(const std::map<std::string, std::string>& env);

// "0,1,2": the ranks a process runs, for messages.
std::string RanksText(const std::vector<int>& ranks);

// JAXTRAIN_WARM_WORKERS: "1" or unset = on, "0" = off.
// Errors: kInvalidArgument for any other value (the message names the variable and the value).
StatusOr<bool> WarmWorkersRequested();

// A started standby: a LaunchedProcess whose ranks are its spec's, once activated.
struct Standby {
  std::string key;
  LaunchedProcess process;
  int activation_fd = -1;  // the write end of its activation pipe, close-on-exec
};

class StandbyPool {
 public:
  StandbyPool() = default;
  ~StandbyPool();  // ends every standby (SIGKILL, reaped)
  StandbyPool(const StandbyPool&) = delete;
  StandbyPool& operator=(const StandbyPool&) = delete;

  // The pool of this driver process, never destroyed: at exit its standbys see EOF and end.
  static StandbyPool& Driver();

  // Starts a set of standbys for `specs`, owned by `owner`, at a lower CPU priority while they
  // import (the worker's). Does nothing when `owner` holds a set already.
  // Errors: kUnavailable when a process cannot be started (the others are ended first).
  Status Prepare(const void* owner, const std::vector<ProcessSpec>& specs) EXCLUDES(mu_);

  struct Taken {
    pid_t pgid = 0;                             // the set's process group
    std::vector<std::optional<Standby>> slots;  // by spec; nullopt: start this one afresh
  };
  // The set `owner` holds, or else a free one, when its keys are those of `specs`. A member that
  // has exited is reaped and its slot left empty (a line in `notes` says so); a set none of whose
  // members is alive is ended and nullopt returned. Free sets of other keys are ended.
  std::optional<Taken> Take(const void* owner, const std::vector<ProcessSpec>& specs,
                            std::vector<std::string>* notes) EXCLUDES(mu_);

  // The set `owner` holds becomes free (kept for the next owner), or is ended.
  void Release(const void* owner) EXCLUDES(mu_);
  void End(const void* owner) EXCLUDES(mu_);

  // Ends every free set (those no owner holds: kept after their run for a later one), and
  // returns how many standbys it ended. The driver calls it once no fit() has followed for a
  // while (python/jaxtrain/driver/trainer.py, docs/warm-workers.md).
  size_t EndFree() EXCLUDES(mu_);

  size_t size() const EXCLUDES(mu_);  // standbys held, in every set

 private:
  struct Set {
    const void* owner = nullptr;  // nullptr: free
    pid_t pgid = 0;
    std::vector<Standby> members;  // in the order of the specs it was started for
  };
  static void EndSet(Set& set);

  mutable Mutex mu_;
  std::vector<Set> sets_ GUARDED_BY(mu_);
};

// A standby's activation (python/jaxtrain/worker/entry.py): one JSON object with the run's
// secret and the kActivationEnv variables `env` sets. The local, ssh and Slurm launchers send it.
std::string ActivationMessage(const std::string& secret,
                              const std::map<std::string, std::string>& env);

// Activates `standby` for `spec`: writes its activation and closes the pipe.
// Errors: kUnavailable when the pipe cannot be written (the standby has exited).
Status Activate(Standby& standby, const ProcessSpec& spec);

// The pickled task in the file `path` names (kPreloadFileEnv), to ship to standbys on other hosts.
// Errors: kUnavailable when it cannot be read; kResourceExhausted when it holds more than `limit`.
StatusOr<std::string> ReadPreloadFile(const std::string& path, size_t limit);

// The key of `spec` (what shapes its process before activation).
std::string StandbyKey(const ProcessSpec& spec);

// Starts `argv` as a process of `ranks` with environment `env`, in process group `pgid` (0: a
// new one it leads), inheriting `inherit_fd` (-1: none): its pidfd, and its output non-blocking.
// Errors: as SpawnWithOutputPipe; kUnavailable when no pidfd can be opened (it is then killed
// and reaped).
StatusOr<LaunchedProcess> StartLocalProcess(const ProcessSpec& spec,
                                            const std::vector<std::string>& env, pid_t pgid,
                                            int inherit_fd);

}  // namespace jaxtrain::launch
