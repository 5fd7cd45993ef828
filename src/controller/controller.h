// Controller: runs one training run's worker group, from spawn to the final outcome, restarting
// the whole group from the latest committed checkpoint when a worker fails.
//
// It owns one event-loop thread that touches all of its state: the control port (the listening
// socket and every worker connection), the worker group (every worker process, reaped through its
// pidfd, and its output pipe), and the run directory. Other threads only call Abort(), Wait() and
// outcome().
//
// The run and its attempts: the run (Controller::Loop, controller.cc) keeps what spans attempts,
// each concern an object of its own: the run directory's records (RunRecord, run_record.h), the
// rounds recorded (RoundRecorder), the failure budgets (FailurePolicy), the port and the group,
// where each attempt trains (RunPlacement, run_placement.h), the console, status line and logs
// (RunOutput, run_output.h), the metrics (MetricsBook, run_metrics.h) and the outcome so far;
// each attempt is a fresh Attempt (attempt.h),
// which owns that attempt's state, from the start of its group to its last process reaped, and
// draws its phases (kStarting, kRunning, kStopping, kDraining). The run's state machine:
//
//   StartAttempt ──> step the attempt until it is over (every process reaped, its output drained,
//   no commit in flight) ──> EndAttempt: succeeded (every rank returned, every process exited 0)
//   → the run is kSucceeded; aborted → kAborted; failed → FailurePolicy decides from the
//   failure's cause and codes (failure_policy.h): retry, a new Attempt (fresh coordinator port,
//   attempt number + 1, the latest committed checkpoint), or raise, kFailed.
//
// Elastic runs (ControllerOptions::elastic, docs/elastic.md): before each attempt the run
// chooses its hosts (RunPlacement::Choose): the units of the full plan the launcher can reach, at a
// restart a host that cannot be reached waited for up to host_wait first; min_workers at least,
// else the full plan (its launch then waits and fails as a fixed-size run's). A run below max
// watches the hosts it lacks (CapacityMonitor, through RunPlacement); once one answers, the attempt
// stops on purpose at its next committed checkpoint (Attempt::RequestResize) and ends RESIZED: a
// planned restart, not a failure, counted apart (run.json's "resizes"), on the hosts chosen again.
//
// Report rounds: a round is complete when every rank has reported it (ReportCollector); rank 0's
// metrics are recorded, and the ranks' checkpoints, if any, are committed as one checkpoint
// (storage/checkpoint.h) before the round is recorded (RoundRecorder, round_recorder.h). The
// commit runs on the CheckpointCommitter's thread (checkpoint_committer.h), never on the loop:
// rounds that complete meanwhile are recorded after it, in order, and the ranks that passed a
// part are told when it has ended, which their next report(checkpoint=) waits for (at most one
// commit in flight). An attempt ends only once its commit in flight has ended, so a restart
// never sweeps a commit's files and the outcome names the last committed checkpoint. Rounds
// continue across attempts and across runs that resume the same run directory.
//
// Stragglers: each rank's step time is read from the times its reports arrive, and a rank
// persistently slower than the others is named once when it starts and once when it stops being
// slow (stragglers.h): on the console, in the status line and in run.json's attempt
// ("stragglers"), which driver-side callbacks follow. metrics() returns them with the rest of
// the run's metrics.
//
// Worker processes: the worker group (worker_group.h) starts them through the Launcher, watches
// their pidfds and output pipes, and reports each exit; the loop decides what an exit means. A
// launched process runs one rank (local) or several (one Slurm step, srun), whose output is split
// per rank (rank_output.h). How each rank of a process with several ended is read from the
// launcher's own lines (Launcher::ParseTaskEnd: srun's reports, the Kubernetes supervisor's).
//
// Worker connections: the control port (control_port.h) accepts them, authenticates them by the
// run's secret and caps those that have not proven it; from then on a connection is its rank's,
// and a rank that ends before registering is a start-up failure. See docs/wire.md.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "base/clock.h"
#include "base/mutex.h"
#include "base/status.h"
#include "controller/control_port.h"
#include "controller/failure_policy.h"
#include "controller/run_metrics.h"
#include "controller/watchdog.h"
#include "controller/worker_group.h"
#include "launch/launcher.h"
#include "placement/plan.h"
#include "storage/checkpoint.h"

namespace jaxtrain::controller {

// An elastic run (ScalingConfig(num_workers=(min, max)), docs/elastic.md): ControllerOptions::plan
// is the plan for max; each attempt trains on the hosts of it the launcher can reach
// (Launcher::UnreachableHosts), min_workers at least, re-planned by `plan_on`.
struct ElasticOptions {
  int min_workers = 1;
  // How often a run below max looks for the hosts it lacks (CapacityMonitor).
  Duration monitor_interval = std::chrono::seconds(60);
  // How long a restart waits for a host it cannot reach before it goes on without it.
  Duration host_wait = std::chrono::seconds(60);
  // The plan with `workers` workers on `hosts` only (whole units of the full plan, in its
  // order): every rank's placement and environment computed anew. Errors: as the launcher's
  // planning (PlanForSshOn).
  std::function<StatusOr<placement::Plan>(const std::vector<std::string>& hosts, int workers)>
      plan_on;
};

struct ControllerOptions {
  std::string run_dir;
  std::string experiment_name;
  std::string listen_host = "127.0.0.1";
  placement::Plan plan;
  std::vector<std::string> worker_argv;  // e.g. {"/usr/bin/python3", "-m", "jaxtrain.worker"}
  std::string worker_cwd;                // empty = the driver's
  std::map<std::string, std::string> worker_env;  // for every rank, on top of the plan's
  std::string payload;                            // sent to every rank after kStart
  nlohmann::json run_config;                      // recorded in run.json
  // Seconds the driver waited for the cluster before this controller was made (a Slurm
  // allocation it requested); recorded in run.json as "queue_wait_s".
  double queue_wait_s = 0;
  Duration terminate_grace = std::chrono::seconds(5);
  // After a rank fails, how long the group goes on at most for the other ranks to report the
  // rounds that the failed rank had reported, so that those rounds are recorded and their
  // checkpoints committed before the group is stopped (docs/checkpoints.md).
  Duration finish_rounds_timeout = std::chrono::seconds(30);
  Duration handshake_timeout = std::chrono::seconds(10);
  Duration start_timeout = std::chrono::seconds(300);  // spawn to every rank registered
  // A rank that sends no report for this long while training is treated as failed; 0 = off,
  // unless progress_auto is set: then the limit is automatic (watchdog.h).
  Duration progress_timeout = Duration::zero();
  std::optional<AutoLimit> progress_auto;
  int max_failures = 0;        // training failures restarted; -1 = without limit
  int max_start_failures = 3;  // start-up failures restarted; -1 = without limit
  int max_preemptions = -1;    // preemptions restarted (docs/preemption.md); -1 = without limit
  // How long a preempted group goes on after a notice that names no earlier deadline.
  Duration preemption_grace = std::chrono::seconds(30);
  storage::RetentionPolicy retention;
  bool verify_checksums = true;  // on restore: CRC-32C of every file; false: sizes only
  // Also say how jaxtrain went about the run (Launcher::TakeDetails), and a failure's status
  // code where retrying cannot help (JAXTRAIN_VERBOSE=1, `jaxtrain run --verbose`).
  bool verbose = false;
  // Where every rank runs on this host and keeps copies of its checkpoints in this host's memory
  // (python/jaxtrain/worker/checkpoint_memory.py): the store. A restart within the run then checks
  // a checkpoint whose every part has its copy there by sizes only (storage/memory_copies.h): its
  // ranks restore from the copies and need not wait for the whole checkpoint to be read from
  // storage first. "" = every restart checks checksums (verify_checksums).
  std::string memory_store;
  int console_fd = 1;  // rank output is copied here with a "(rank=N) " prefix; -1 = nowhere
  // Keep a live status line (status_line.h) below the rank output on console_fd: for a terminal.
  bool status_line = false;
  std::optional<ElasticOptions> elastic;  // none: every attempt runs `plan`
};

// Where the controller meets the network and processes, besides its launcher and clock: how it
// opens its control port and how it watches its workers' processes. An empty function means the
// real one: TCP on ControllerOptions::listen_host (ControlPort::Create), and the processes' pidfds
// and pipes (WorkerGroup::Create). Tests give fakes (controller/testing/) to drive the run's state
// machine without sockets or processes.
struct ControllerSeams {
  // Opens the port, whose hellos must be made with `secret`, and sets *port_number.
  // Errors: kUnavailable when it cannot listen; as ControlPort::Create.
  std::function<StatusOr<std::unique_ptr<ControlPort>>(
      std::string secret, ControlPort::Delegate& delegate, int* port_number)>
      open_port;
  std::function<StatusOr<std::unique_ptr<WorkerGroup>>(launch::Launcher& launcher, bool echo,
                                                       WorkerGroup::Delegate& delegate)>
      make_group;
};

struct RankFailure {
  int rank = -1;
  std::string host;
  int attempt = 0;
  FailureCause cause = FailureCause::kException;  // its name: FailureCauseName()
  int exit_code = -1;  // kExit (and kStartUp when the process exited): its exit status
  int signal = 0;      // kSignal, kOom (and kStartUp when a signal ended it): the signal
  // kStorage, kCheckpoint: the code of the error behind it, which FailurePolicy decides from.
  StatusCode status_code = StatusCode::kOk;
  // What FailurePolicy decided for it, once the attempt ended: retried, and why (its reason).
  bool retried = false;
  std::string decision;
  std::string message;    // one line: what happened
  std::string traceback;  // the worker's Python traceback, when it sent one
  std::string log_path;
  std::string log_tail;
  // kWatchdog: where every rank's stacks were written, relative to the run directory
  // ("stacks/attempt-0"); "" when no rank could give them.
  std::string stacks_dir;
  // kPreemption: {"deadline_ms", "preempted_node_to_ranks", "drain_timed_out"} (preemption.h);
  // null otherwise.
  nlohmann::json preemption;
};

struct Outcome {
  enum class State { kSucceeded, kFailed, kAborted };
  State state = State::kAborted;
  std::optional<RankFailure> failure;  // the first failure of the run
  std::vector<RankFailure> failures;   // one per failed attempt, in order
  int attempts = 0;                    // attempts of this Start(), restarts included
  uint64_t rounds = 0;                 // the last report round recorded (rounds start at 1)
  std::string last_metrics_json;       // rank 0's metrics of the last round, "" if none
  std::vector<std::string> warnings;
  std::string abort_reason;
  // The run directory's records as the run left them, for fit()'s Result
  // (python/jaxtrain/result.py), which need not read them back: run.json as last written (null
  // if it never was), and rank 0's pickled return value as return_value.pkl holds it (none when
  // the last attempt's rank 0 returned nothing to keep).
  nlohmann::json run_state;
  std::optional<std::string> return_value;
};

std::string_view OutcomeStateName(Outcome::State state);

class Controller {
 public:
  // Deadlines are kept on `clock`; a FakeClock wakes the loop when advanced (Clock::wake_fd()).
  Controller(ControllerOptions options, std::unique_ptr<launch::Launcher> launcher,
             const Clock& clock = RealClock(), ControllerSeams seams = {});
  ~Controller();  // aborts a run still in progress and waits for it to end
  Controller(const Controller&) = delete;
  Controller& operator=(const Controller&) = delete;

  // Opens the run directory, listens, starts the workers and the event loop.
  // Errors: kPermissionDenied / kFailedPrecondition / kInternal for the run directory (the message
  // names the path), kUnavailable when the port cannot be bound or a worker cannot be started.
  // On error nothing is left running.
  Status Start();

  // Waits up to `timeout` for the outcome; true once it is final.
  bool Wait(Duration timeout);

  // Waits up to `timeout` until more than `seen` checkpoints have been committed by this run
  // (every attempt), or the outcome is final; returns the number committed so far. The driver's
  // mirror of a run on object storage uploads a checkpoint's manifest as soon as its commit ends,
  // not at its next poll (python/jaxtrain/storage.py, Mirror).
  uint64_t WaitForCommits(uint64_t seen, Duration timeout);

  // Ends the run: every worker is terminated; a restart whose group is being started is cut short
  // (Launcher::Interrupt). Thread-safe; the outcome becomes kAborted unless the run had already
  // ended.
  void Abort(std::string reason);

  // Every rank's Python stacks now, without stopping the run (`jaxtrain stack`,
  // docs/failure-detection.md): the folder they were written to (Attempt::RequestStacks()).
  // Blocks up to `timeout`. Thread-safe. Errors: kFailedPrecondition when the run is not
  // training (its workers starting or stopping, or the run over); kDeadlineExceeded when no
  // answer came within `timeout` (a restart under way); kInternal when they could not be
  // written.
  StatusOr<std::string> TakeStacks(Duration timeout);
  // Every rank traces its next `steps` steps with jax.profiler (`jaxtrain profile`), from its
  // next report() to `steps` reports later: the folder the traces go to (Attempt::
  // StartProfile()). Thread-safe. Errors: as TakeStacks(), and kInvalidArgument for `steps` < 1.
  StatusOr<std::string> StartProfile(int steps, Duration timeout);

  // The final outcome; call only after Wait() returned true.
  const Outcome& outcome() const { return outcome_; }

  // The control port (after Start()).
  int port() const { return port_; }

  // The run's metrics as the loop last published them (run_metrics.h). Thread-safe.
  RunMetrics metrics() const;

 private:
  struct Loop;
  void RunLoop();

  ControllerOptions options_;
  std::unique_ptr<launch::Launcher> launcher_;
  const Clock& clock_;
  ControllerSeams seams_;
  std::unique_ptr<Loop> loop_;
  std::thread thread_;
  int port_ = 0;
  int wake_fd_ = -1;

  std::mutex mu_;
  std::condition_variable done_cv_;
  bool done_ = false;         // guarded by mu_
  uint64_t commits_ = 0;      // guarded by mu_; checkpoints committed, counted by the loop thread
  std::string abort_reason_;  // guarded by mu_
  std::atomic<bool> abort_requested_{false};
  // A request of another thread's to the loop (TakeStacks(), StartProfile()), one at a time, and
  // its answer.
  StatusOr<std::string> AskLoop(Duration timeout);
  std::mutex request_call_mu_;
  std::atomic<bool> stacks_requested_{false};
  std::atomic<int> profile_steps_{0};
  std::optional<StatusOr<std::string>> request_result_;  // guarded by mu_
  uint64_t request_number_ = 0;                          // of the request awaited; guarded by mu_
  Outcome outcome_;  // written by the loop thread before done_ is set; read-only afterwards
  mutable Mutex metrics_mu_;
  RunMetrics metrics_ GUARDED_BY(metrics_mu_);  // published by the loop thread
};

}  // namespace jaxtrain::controller
