// SlurmLauncher: the worker group as one Slurm job step. Launch() runs one `srun` in the run's
// allocation, in a new process group, with its stdout and stderr on one pipe: srun starts every
// rank (task r = rank r, SLURM_PROCID), labels each line of their output with "<rank>: "
// (--label; not for a single rank), and kills the whole step when one task fails
// (--kill-on-bad-exit). The one LaunchedProcess carries every rank; srun's own lines
// ("srun: error: node2: task 1: Killed") are unlabelled, and ParseSrunTaskEnd() reads them.
//
// The worker environment: what every ProcessSpec shares is exported to the tasks (--export=ALL,
// so secrets never appear on a command line); the per-rank placement variables (JAXTRAIN_RANK,
// _LOCAL_RANK, _LOCAL_WORLD_SIZE, _NODE_RANK) are left out, and each task derives them from
// Slurm's (python/jaxtrain/worker/entry.py). Any other per-rank difference is refused.
//
// Where the allocation comes from (SlurmAllocation): the one the driver runs inside
// (SLURM_JOB_ID: an sbatch script, salloc), or one requested with `salloc --no-shell` and
// released when the SlurmAllocation is destroyed. A retry runs a new step in the same allocation,
// except in an allocation of jaxtrain's own whose time-limit notice is due (its time left is at
// most the notice's seconds plus Slurm's 60 s of slack): that one is released and the same
// request made again, so that the run goes on past the time limit (docs/slurm.md).
//
// The mapping from ScalingConfig to Slurm options (SlurmShapeFor) is documented in docs/slurm.md.
//
// Elastic runs (ScalingConfig(num_workers=(min, max)), docs/elastic.md) resize by whole nodes of
// the allocation: the full plan puts the same number of ranks on each node (PlanForSlurmNodes),
// each attempt's step runs on the nodes of its plan (UsePlan: --nodelist, --nodes,
// --ntasks-per-node), and a node `scontrol show node` says is drained or down is left out
// (UnreachableHosts at a restart, LeavingHosts while the group trains on it).
//
// Thread-safety: SlurmLauncher is used by the controller's event loop only, but for
// UnreachableHosts, LeavingHosts and Interrupt. The free functions are thread-safe.
// SignalGroup(SIGKILL) blocks for the time of one squeue and one scancel.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "accelerators/discovery.h"
#include "base/clock.h"
#include "base/mutex.h"
#include "base/status.h"
#include "config/scaling_config.h"
#include "launch/launcher.h"
#include "launch/process.h"
#include "placement/plan.h"

namespace jaxtrain::launch {

// How long a Slurm client command (squeue, scancel, scontrol) may take before it is killed.
inline constexpr Duration kSlurmCommandTimeout = std::chrono::seconds(30);
// How much earlier than asked Slurm may send the time limit's signal (sbatch(1), --signal).
inline constexpr int kSlurmSignalSlackS = 60;

// Environment settings (docs/slurm.md).
inline constexpr char kSharedStorageEnv[] =
    "JAXTRAIN_SHARED_STORAGE";  // shared dirs, ':'-separated
inline constexpr char kSlurmNodesEnv[] = "JAXTRAIN_SLURM_NODES";
inline constexpr char kSlurmTasksPerNodeEnv[] = "JAXTRAIN_SLURM_TASKS_PER_NODE";
inline constexpr char kSlurmExclusiveEnv[] = "JAXTRAIN_SLURM_EXCLUSIVE";
// Node features the allocation and its steps need (--constraint): the user's, ANDed by the Python
// layer with ScalingConfig.label_selector's (docs/slurm.md).
inline constexpr char kSlurmConstraintEnv[] = "JAXTRAIN_SLURM_CONSTRAINT";
// How many seconds before the time limit Slurm sends the workers SIGUSR1, a preemption notice
// with that deadline (docs/slurm.md): jaxtrain's own allocations ask for --signal=USR1@<s>, and
// the steps' tasks get the setting (0: no signal is asked for).
inline constexpr char kSlurmSignalEnv[] = "JAXTRAIN_SLURM_SIGNAL_S";
inline constexpr int kDefaultSlurmSignalS = 90;

// The shape of the worker group in Slurm's terms.
struct SlurmShape {
  int tasks = 1;                      // --ntasks: one task per worker
  std::optional<int> nodes;           // --nodes
  std::optional<int> tasks_per_node;  // --ntasks-per-node
  int cpus_per_task = 1;              // --cpus-per-task
  int gpus_per_task = 0;              // --gpus-per-task (0: not passed)
  bool exclusive = false;             // --exclusive (whole nodes)
  std::string constraint;             // --constraint: node features (empty: not passed)
  bool spread = false;                // steps: --distribution=cyclic; allocations: --spread-job
  int signal_s = 0;                   // allocations: --signal=USR1@<signal_s> (0: not passed)
  // Elastic runs. Allocations: --nodes=<min_nodes>-<nodes> in place of --ntasks when below
  // nodes, and --no-kill (a node that fails leaves the allocation running). Steps: the nodes.
  std::optional<int> min_nodes;
  bool no_kill = false;
  std::vector<std::string> nodelist;  // steps: --nodelist (empty: not passed)

  std::vector<std::string> SrunArgs() const;
  std::vector<std::string> SallocArgs() const;
  std::string Describe() const;  // "4 tasks on 2 nodes, 1 CPU each"
};

// ScalingConfig -> SlurmShape, with JAXTRAIN_SLURM_NODES, _TASKS_PER_NODE and _EXCLUSIVE from
// `env` overriding what the ScalingConfig implies, JAXTRAIN_SLURM_CONSTRAINT's features and
// JAXTRAIN_SLURM_SIGNAL_S (default kDefaultSlurmSignalS).
// An elastic config whose tasks per node are known (JAXTRAIN_SLURM_TASKS_PER_NODE or _NODES,
// STRICT_SPREAD) asks for a node range, min/w to max/w nodes of w tasks; any elastic config asks
// for --no-kill.
// Errors: kInvalidArgument naming the field or setting: a fractional GPU count, a setting that is
// not a whole number >= 1 (JAXTRAIN_SLURM_SIGNAL_S: 0 to 65535), nodes x tasks per node !=
// num_workers; an elastic range that is not whole nodes of those tasks; an elastic TPU config.
StatusOr<SlurmShape> SlurmShapeFor(const config::ScalingConfig& config,
                                   const accelerators::HostView& env);

// The plan of a Slurm run: the world size and each rank's environment. The hosts, local ranks and
// devices are Slurm's to choose (GPUs through --gpus-per-task), so none is assigned here; the
// simulate switch runs any ScalingConfig as CPU processes, as for local runs.
StatusOr<placement::Plan> PlanForSlurm(const config::ScalingConfig& config,
                                       const accelerators::HostView& env);

// An elastic run's full plan on the allocation's `nodes` (in Slurm's order): the ranks of
// `uniform` (PlanForSlurm), the same number w on each node, rank blocks in node order as srun
// numbers its tasks. w is the shape's tasks per node, else max / the nodes; an allocation granted
// fewer nodes than max needs (a node range) holds that many nodes' workers at most.
// Errors: kInvalidArgument when max is not whole nodes of w workers, or the nodes hold fewer
// than min workers; those of placement::CheckElasticHosts.
StatusOr<placement::Plan> PlanForSlurmNodes(const config::ScalingConfig& config,
                                            const placement::Plan& uniform,
                                            const std::vector<std::string>& nodes,
                                            const SlurmShape& shape, const std::string& job_id);

// A node's state as `scontrol --oneliner show node` gives it.
struct SlurmNodeState {
  std::string state;   // State=, e.g. "IDLE", "MIXED+DRAIN", "DOWN+NOT_RESPONDING"
  std::string reason;  // Reason=, without its "[user@time]"; empty without one
};
// NodeName -> its state, for each line of `scontrol --oneliner show node` output.
std::map<std::string, SlurmNodeState> ParseSlurmNodes(std::string_view text);
// Whether steps can run on a node in `state`: not DRAIN (draining or drained), DOWN,
// NOT_RESPONDING, FAIL or FAILING, nor leaving or unknown (POWERING_DOWN, POWER_DOWN,
// POWERED_DOWN, REBOOT_ISSUED, REBOOT_REQUESTED, INVALID_REG, FUTURE, UNKNOWN), in any of its
// '+'-joined parts, nor '*'-marked.
bool SlurmNodeUsable(std::string_view state);

// A job's time left as squeue's %L gives it ("[days-][hours:]minutes:seconds"), in seconds;
// nullopt for anything else ("UNLIMITED", "NOT_SET", "INVALID", empty).
std::optional<int64_t> ParseSlurmTimeLeft(std::string_view text);

// One task's end as srun reports it: "srun: error: node2: task 1: Killed",
// "srun: error: node1: tasks 0-1,3: Exited with exit code 3". nullopt for any other line.
std::optional<TaskEnd> ParseSrunTaskEnd(std::string_view line);

// Storage check for multi-host runs: OK when `path` (or its nearest existing parent) is on a
// network filesystem (NFS, Lustre, GPFS, BeeGFS, CephFS, SMB, 9p, AFS, FUSE) or under one of the
// directories of JAXTRAIN_SHARED_STORAGE in `env`.
// Errors: kInvalidArgument naming the path and its filesystem, saying to use shared storage.
Status CheckSharedStorage(const std::string& path, const accelerators::HostView& env);

// A Slurm job allocation that the worker group's steps run in.
class SlurmAllocation {
 public:
  // The allocation the driver runs inside (SLURM_JOB_ID in `env`); never released by jaxtrain.
  // Errors: kFailedPrecondition when SLURM_JOB_ID is unset.
  static StatusOr<std::unique_ptr<SlurmAllocation>> Current(const accelerators::HostView& env);

  // Asks Slurm for an allocation of `shape` (salloc --no-shell) and waits until it is granted,
  // saying on stderr that it waits and why (the job's state and pending reason, when they change).
  // `cancelled` is polled about every 200 ms; when it returns true, the request is withdrawn.
  // Errors: kUnavailable when salloc cannot be started or Slurm refuses (the message quotes it),
  // kAborted when cancelled.
  static StatusOr<std::unique_ptr<SlurmAllocation>> Request(const SlurmShape& shape,
                                                            const std::string& job_name,
                                                            const std::function<bool()>& cancelled);

  ~SlurmAllocation();  // releases (scancel) an allocation that Request() obtained
  SlurmAllocation(const SlurmAllocation&) = delete;
  SlurmAllocation& operator=(const SlurmAllocation&) = delete;

  const std::string& job_id() const { return job_id_; }
  bool owned() const { return owned_; }

  // The allocation's nodes, in Slurm's order. Errors: kUnavailable when Slurm cannot say.
  StatusOr<std::vector<std::string>> Nodes() const;
  // The address of a node (its NodeAddr). Errors: kUnavailable when Slurm cannot say.
  StatusOr<std::string> NodeAddress(const std::string& node) const;

 private:
  SlurmAllocation(std::string job_id, bool owned) : job_id_(std::move(job_id)), owned_(owned) {}
  std::string job_id_;
  bool owned_ = false;
};

struct SlurmLauncherOptions {
  std::string job_id;         // the allocation the steps run in
  SlurmShape shape;           // the step's shape
  std::string step_name;      // every step gets this name and a serial number
  std::string srun = "srun";  // found through PATH unless absolute; tests pass a fake
  std::string scancel = "scancel";
  std::string squeue = "squeue";
  std::string scontrol = "scontrol";
  // squeue and scancel are killed after this long (their error then names them).
  Duration command_timeout = kSlurmCommandTimeout;
  bool warm = false;  // a standby step for a restart (JAXTRAIN_WARM_WORKERS)
};

class SlurmLauncher : public Launcher {
 public:
  // `allocation`, when given, is kept until the launcher is destroyed.
  explicit SlurmLauncher(SlurmLauncherOptions options,
                         std::unique_ptr<SlurmAllocation> allocation = nullptr);
  ~SlurmLauncher() override;

  // Starts one srun step for every spec (one task per rank, in rank order). A retry in an
  // allocation of jaxtrain's own whose time-limit notice is due first releases it and waits for
  // a new one of the same request (said on stderr).
  // Errors: kUnavailable when srun cannot be started, or Slurm does not grant the new allocation;
  // kCancelled when Interrupt() withdrew that request; kFailedPrecondition when the allocation is
  // no longer running (Slurm ended it: a node failed, its time ran out, it was cancelled);
  // kUnavailable when squeue does not answer within command_timeout;
  // kInvalidArgument when the specs differ in their command, working directory or an environment
  // variable other than the per-rank ones.
  StatusOr<std::vector<LaunchedProcess>> Launch(const std::vector<ProcessSpec>& specs) override;

  // Sends `signal` to srun, which forwards it to every task. SIGKILL also cancels the step in
  // Slurm (scancel), since a killed srun leaves its tasks running; a step that cannot be found
  // or cancelled is a note (TakeNotes), and the SIGKILL is not an error for it.
  Status SignalGroup(int signal) override;

  std::optional<TaskEnd> ParseTaskEnd(std::string_view line) const override {
    return ParseSrunTaskEnd(line);
  }

  // Withdraws a request for a new allocation that Launch() waits for. Thread-safe.
  void Interrupt() override { interrupted_.store(true); }

  // The last Launch()'s wait for a new allocation at a time-limit notice (asking salloc and
  // waiting in Slurm's queue); 0 when it ran in the allocation it had. The driver's wait for its
  // first allocation is the run's queue_wait_s (SlurmStart), not an attempt's.
  double QueueWait() const override { return queue_wait_s_; }

  // With options.warm: starts the next attempt's step ahead, as standbys (docs/warm-workers.md,
  // "On Slurm"): `srun --overlap` in the allocation, every task a standby worker that imports jax
  // and waits for its activation on its stdin. The next Launch() of the same step (same command,
  // environment but for kActivationEnv, shape) in the same allocation activates it by writing the
  // activation to srun's stdin, which srun hands to every task; otherwise it is ended and a new
  // step started, and a note says why. Does nothing while a standby step is held.
  // Errors: kUnavailable when srun cannot be started; as Launch() for specs it cannot merge.
  Status PrepareNext(const std::vector<ProcessSpec>& specs) override;
  void EndRun(bool keep) override;  // ends the standby step
  std::vector<std::string> TakeNotes() override;
  std::vector<std::string> TakeDetails() override;

  // Elastic runs. The nodes of `hosts` that are not usable now (SlurmNodeUsable after
  // `scontrol show node`; a node Slurm does not show, or every node when scontrol fails), asked
  // again with backoff up to `wait`. A node's change of state is said on stderr once.
  StatusOr<std::vector<std::string>> UnreachableHosts(const std::vector<std::string>& hosts,
                                                      Duration wait, int cancel_fd) override;
  // The nodes of `hosts` that are not usable now; none when scontrol fails.
  StatusOr<std::vector<std::string>> LeavingHosts(const std::vector<std::string>& hosts,
                                                  int cancel_fd) override;
  // The next steps run the plan's ranks on its nodes: --nodelist, --nodes and
  // --ntasks-per-node of the plan. Errors: kInvalidArgument for a plan without nodes, or with
  // another number of ranks on some node.
  Status UsePlan(const placement::Plan& plan) override;

  // The most of a pickled training function (kPreloadFileEnv) a standby step gets on its stdin
  // to preload; a larger one is unpickled at activation.
  static constexpr size_t kMaxPreloadBytes = 1 << 20;

 private:
  // One step's srun arguments after --jobid and --job-name, its environment and its key.
  struct Step {
    std::vector<int> ranks;
    std::vector<std::string> args;
    std::map<std::string, std::string> env;
    std::string secret;
    std::string key;   // the arguments and the environment but for kActivationEnv
    std::string name;  // --job-name
  };
  struct StandbyStep {
    std::string key;
    std::string name;
    LaunchedProcess process;
    int input = -1;  // the write end of srun's stdin
  };
  StatusOr<Step> StepFor(const std::vector<ProcessSpec>& specs) const;
  // Starts `step` (as standbys: *input is the write end of srun's stdin).
  StatusOr<LaunchedProcess> StartStep(Step step, bool standby, int* input);
  // The standby step activated for `step`, or nullopt (it was ended; a note says why).
  std::optional<LaunchedProcess> ActivateStandby(const Step& step);
  // Closes its stdin (the tasks read EOF and exit 0) and waits a moment for srun; else kills
  // srun and cancels the step.
  void EndStandby();
  void CancelStep(const std::string& name);  // notes what it cannot do
  // Before a retry: an allocation of jaxtrain's own whose time-limit notice is due (time left <=
  // signal_s + kSlurmSignalSlackS) is released and requested again. Errors: as Request(), with
  // kCancelled for a withdrawn request.
  Status RenewAtTimeLimit();
  // The nodes of `hosts` that are not usable; `if_unknown` when scontrol cannot say.
  StatusOr<std::vector<std::string>> UnusableNodes(const std::vector<std::string>& hosts,
                                                   int cancel_fd, bool if_unknown);
  const SlurmShape& StepShape() const { return step_shape_ ? *step_shape_ : options_.shape; }

  SlurmLauncherOptions options_;
  std::unique_ptr<SlurmAllocation> allocation_;
  pid_t pgid_ = 0;
  int steps_ = 0;
  std::string step_name_;    // of the last Launch()
  double queue_wait_s_ = 0;  // of the last Launch()
  std::atomic<bool> interrupted_{false};
  std::optional<StandbyStep> standby_;
  std::vector<std::string> notes_;        // for TakeNotes()
  std::vector<std::string> details_;      // for TakeDetails()
  std::optional<SlurmShape> step_shape_;  // UsePlan()'s
  Mutex states_mu_;
  std::map<std::string, std::string> said_states_ GUARDED_BY(states_mu_);  // node -> State=
};

// What a Slurm run starts with: its launcher and the address the nodes reach the controller at.
struct SlurmStart {
  std::unique_ptr<SlurmLauncher> launcher;
  std::string listen_host;
  // An elastic config's: the allocation's nodes, its job and the shape asked for.
  std::vector<std::string> nodes;
  std::string job_id;
  SlurmShape shape;
};

// Readies a Slurm run of `config`: in the allocation the driver runs inside (SLURM_JOB_ID in
// `env`), or in one requested and waited for (SlurmAllocation::Request, with `cancelled`), which
// the launcher releases when it is destroyed. The listen host is JAXTRAIN_LISTEN_HOST, else this
// host's address on the route to the allocation's first node. Steps are named `step_name`.
// Blocks for salloc's wait and one scontrol per node asked about.
// Errors: those of SlurmShapeFor, Current and Request; kUnavailable when no listen host can be
// chosen (the message says to set JAXTRAIN_LISTEN_HOST).
StatusOr<SlurmStart> StartSlurm(const config::ScalingConfig& config,
                                const accelerators::HostView& env, const std::string& step_name,
                                const std::function<bool()>& cancelled);

}  // namespace jaxtrain::launch
