// Launcher: starts the processes of one worker group and signals them. It only starts processes;
// workers find the controller themselves over TCP, so every launcher shares the same control path.
//
// Implementations: LocalLauncher (this host, local_launcher.h); SshLauncher (one process per
// rank on described hosts, over ssh, ssh_launcher.h); for a cluster engine, where one launched
// process carries several ranks and labels their output "<rank>: ", SlurmLauncher (one srun step,
// slurm_launcher.h) and KubernetesLauncher (one JobSet, kubernetes_launcher.h).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "base/clock.h"
#include "base/status.h"
#include "launch/process.h"
#include "placement/plan.h"

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
  // Set before `env` (whose entries win): the entries every process of a group shares, held once
  // for all of them, so 16,384 specs do not each copy a dozen long names and values. Launchers
  // read a process's environment with Env(), never `env` alone. Last, so that the fields above
  // keep their order in aggregate initialisers.
  std::shared_ptr<const std::map<std::string, std::string>> shared_env;

  // What the process's environment gets set: shared_env, then env on top.
  std::map<std::string, std::string> Env() const;
};

struct LaunchedProcess {
  std::vector<int> ranks;
  pid_t pid = -1;
  int pidfd = -1;      // readable once the process has exited
  int output_fd = -1;  // non-blocking read end of the process's stdout and stderr, merged
};

// How some ranks of a process that carries several ended, as the launcher's own output line says
// ("srun: error: node2: task 1: Killed").
struct TaskEnd {
  std::vector<int> tasks;  // the ranks
  std::string node;        // where they ran
  ExitStatus exit;
};

// Says `line` on the driver's stderr, as "jaxtrain: <line>": what a launcher is waiting for
// while Launch() blocks (an allocation, a host to come back).
void Say(const std::string& line);

class Launcher {
 public:
  virtual ~Launcher() = default;

  // Starts every process or none: when one cannot be started, those already started are killed
  // and reaped before the error returns. The caller owns the returned descriptors.
  // Errors: kUnavailable when a process cannot be started (the message names it and why).
  virtual StatusOr<std::vector<LaunchedProcess>> Launch(const std::vector<ProcessSpec>& specs) = 0;

  // Sends `signal` to every process of the group started by the last Launch(), and to anything
  // they started in their process group. A group that has already ended is not an error.
  // Errors: kUnavailable when the signal could not be delivered (the message says to whom and
  // why); the controller says so and goes on: SIGKILL follows after the grace period, and an
  // attempt ends only once every process is reaped.
  virtual Status SignalGroup(int signal) = 0;

  // A process of the last Launch() has exited with `status`: the controller reaped it, so its pid
  // is no longer the launcher's to signal. The default does nothing.
  virtual void Exited(pid_t pid, const ExitStatus& status) {}

  // A process of the last Launch() carries a rank whose control connection timed out: its host
  // stopped answering the controller (cut off, or frozen), so it may not hear a signal sent
  // through the network either. Called before the controller stops the group. The default does
  // nothing.
  virtual void Unreachable(pid_t pid) {}

  // Reads one unlabelled line of a multi-rank process's output: how some ranks ended, when the
  // line says so; nullopt for any other line.
  virtual std::optional<TaskEnd> ParseTaskEnd(std::string_view line) const { return std::nullopt; }

  // Starts ahead, where the launcher can, what the next Launch(specs) will start (LocalLauncher:
  // standby workers, standby_pool.h); the others start fresh processes on each Launch().
  // Errors: kUnavailable when they cannot be started; the next Launch() then starts afresh.
  virtual Status PrepareNext(const std::vector<ProcessSpec>& specs) { return OkStatus(); }

  // The run is over: what PrepareNext() started is kept for a later launcher of the same
  // processes (`keep`, a second fit() in the same driver) or ended.
  virtual void EndRun(bool keep) {}

  // What the last calls did that the run's log should say (standbys lost), once each.
  virtual std::vector<std::string> TakeNotes() { return {}; }

  // What the last calls did that only a verbose run says (ranks started from standbys), once
  // each: how jaxtrain went about it, nothing the user has to act on.
  virtual std::vector<std::string> TakeDetails() { return {}; }

  // Seconds the last Launch() waited in a queue before it started anything: Kueue's admission
  // of the JobSet, a new Slurm allocation after a time-limit notice. 0 when it waited for none.
  // Recorded as the attempt's queue_wait_s in run.json (docs/observability.md).
  virtual double QueueWait() const { return 0; }

  // Whether the next Launch() may wait in such a queue for a while (a Kueue LocalQueue): run.json
  // shows the attempt as queued until it returns.
  virtual bool MayQueue() const { return false; }

  // --- elastic runs (docs/elastic.md) ----------------------------------------------------------

  // Which of `hosts` (WorkerPlacement::host) cannot be reached now: probed once, and those that
  // do not answer probed again with backoff for up to `wait` (zero: once). Only hosts that may
  // come back (no answer, connection refused or timed out, no route) are named; a host that
  // answers but refuses (a host key, a login) is left to Launch() to report. Empty for a
  // launcher that cannot tell (the default: every host is taken as there). Thread-safe: the
  // controller probes missing hosts from a thread of its own while the group runs.
  // Errors: kCancelled when Interrupt() was called, or `cancel_fd` (when >= 0) became readable.
  virtual StatusOr<std::vector<std::string>> UnreachableHosts(const std::vector<std::string>& hosts,
                                                              Duration wait, int cancel_fd) {
    return std::vector<std::string>{};
  }

  // Which of `hosts`, where the group trains now, the cluster is taking away from the run while
  // it trains (a Slurm node an administrator drains, or one that stops responding): an elastic
  // run leaves them at its next committed checkpoint, a planned resize. Asked by the capacity
  // monitor every interval, from its thread. Empty for a launcher that cannot tell (the default,
  // which asks nothing). Thread-safe. Errors: kCancelled as UnreachableHosts.
  virtual StatusOr<std::vector<std::string>> LeavingHosts(const std::vector<std::string>& hosts,
                                                          int cancel_fd) {
    return std::vector<std::string>{};
  }

  // The next Launch() starts the ranks of `plan`, an elastic run's new world (re-planned on the
  // hosts at hand): the launcher forgets where ranks ran before. Called between attempts only.
  // Errors: kFailedPrecondition for a launcher that cannot resize a run (the default).
  virtual Status UsePlan(const placement::Plan& plan) {
    return FailedPreconditionError("this launcher does not resize a run");
  }

  // The run is being stopped: a Launch() in progress on another thread ends soon with kCancelled,
  // as does every later one, leaving nothing running. Thread-safe. The default does nothing: a
  // launcher whose Launch() only spawns processes ends soon anyway (SshLauncher's probe waits for
  // the hosts, up to its timeout, and is cut short).
  virtual void Interrupt() {}
};

// Asks `probe` which hosts are down until none is or `wait` has passed, waiting 1, 2, 4, ... (at
// most 10) s between asks: how a launcher's UnreachableHosts waits for its hosts.
// Errors: what `probe` returns; kCancelled as soon as `cancel_fd` (>= 0) becomes readable or
// `interrupted` is set while it waits (Interrupt() sets a flag: the waits are short slices).
StatusOr<std::vector<std::string>> ProbeUntil(
    const std::function<StatusOr<std::vector<std::string>>()>& probe, Duration wait, int cancel_fd,
    const std::atomic<bool>& interrupted);

// One command for a whole group (a launcher for a cluster engine starts every rank the same way):
// the ranks in order, and what every spec shares.
struct UniformGroup {
  std::vector<int> ranks;
  std::vector<std::string> argv;
  std::string cwd;
  std::map<std::string, std::string> env;  // shared, without the per-rank names
  std::set<std::string> unset_env;
  std::string secret;  // ProcessSpec::secret, the same for every rank
};

// The variable that carries, in a group's shared environment, what the placement gives each rank
// of its own (MergeUniform's `passed`): a JSON object from rank to {name: value}. The worker sets
// its rank's entry once it knows its rank (python/jaxtrain/worker/entry.py).
inline constexpr char kRankEnvVariable[] = "JAXTRAIN_RANK_ENV";

// The address the workers reach the controller at, when the driver's environment sets it.
inline constexpr char kListenHostEnv[] = "JAXTRAIN_LISTEN_HOST";

// The address of this host on the interface that routes to `host` (an address or a name): what
// `host` and its neighbours can reach this host at. No packet is sent.
// Errors: kUnavailable when `host` cannot be resolved or there is no route to it.
StatusOr<std::string> AddressTowards(const std::string& host);

// Merges `specs` into one command. `per_rank` names the variables each rank derives itself from
// the engine's (they may differ and are left out); `passed` those that may differ between ranks
// and are passed to each rank in kRankEnvVariable (left out of env, and unset); `engine` names
// the launcher in messages.
// Errors: kInvalidArgument when there is no spec, or when the specs differ in their command,
// working directory or any other environment variable.
StatusOr<UniformGroup> MergeUniform(const std::vector<ProcessSpec>& specs,
                                    const std::set<std::string>& per_rank, std::string_view engine,
                                    const std::set<std::string>& passed = {});

}  // namespace jaxtrain::launch
