// Attempt: one attempt of a run, from the start of its worker group to its last process reaped.
// The run (controller.cc) makes a fresh Attempt for each attempt and drops it when the attempt is
// over; nothing of one attempt leaks into the next.
//
//   kStarting ──all ranks authenticated and registered──> kRunning ──all ranks done──> (exits)
//       │                                                     │
//       └── a rank fails / Stop() / start-up timeout / ───────┴──> kStopping
//           watchdog / preemption                                  SIGTERM, then SIGKILL
//                                                                  after the grace period
//   A rank that fails while running, having reported rounds that the others have not all sent
//   yet, leaves the group running a little longer (still kRunning, failure() set): the rounds it
//   reported are completed first, so that they are recorded and their checkpoints committed, and
//   the group is stopped once they are complete, or when another rank fails or returns without
//   them, or at ControllerOptions::finish_rounds_timeout (AwaitRoundsOf()).
//   Once every process is reaped and its output drained (Drained(), kDraining), the attempt is
//   over. Its result: failure() (the first failure, refined by the exits that followed it, or
//   none), the rounds its ranks reported beyond the others' (TakeUnmatchedRounds()), and its
//   record in run.json (Record()).
//
// What it owns: the rank table (who registered from where, who returned, whose connection closed
// in which turn of the loop), the start message, the start-up, kill and drain deadlines, the
// signals sent, the first failure and whom it blames, the report collector (rounds continue from
// `first_round`), the collectives, the preemption notice, the progress watchdog and its ping, the
// step times and straggler changes.
//
// What it does not own: the control port and the worker group (the run's, made once; the run is
// their delegate and forwards each event here), the run directory, the rounds' records and
// commits (RoundRecorder), the failure budget (FailurePolicy), the console and the run's metrics.
// It asks the run for those through its Delegate.
//
// Threads: every method is called on the controller's event-loop thread.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "base/clock.h"
#include "base/status.h"
#include "controller/collective.h"
#include "controller/control_port.h"
#include "controller/controller.h"
#include "controller/preemption.h"
#include "controller/rank_stacks.h"
#include "controller/report_collector.h"
#include "controller/stragglers.h"
#include "controller/watchdog.h"
#include "controller/worker_group.h"
#include "launch/launcher.h"
#include "wire/messages.h"

namespace jaxtrain::controller {

class Attempt {
 public:
  enum class Phase { kStarting, kRunning, kStopping, kDraining };

  // What the attempt asks of its run. Called on the loop's thread, from within the attempt's
  // methods.
  class Delegate {
   public:
    virtual ~Delegate() = default;
    // One of jaxtrain's own lines for the console.
    virtual void Say(const std::string& line) = 0;
    // A rank's report arrived (counted in the run's metrics before its rounds are added).
    virtual void CountReport() = 0;
    // A round every rank has reported: recorded in order (RoundRecorder::Add()), which may call
    // back into OnRecorded() before it returns.
    virtual void AddRound(Round round) = 0;
    // run.json is rewritten with this attempt as RUNNING; with `if_stale`, only when it was last
    // written long enough ago (the step times it shows are refreshed now and then).
    virtual void RecordRunning(bool if_stale) = 0;
    // The registered ranks, the phase or the stragglers changed: the run's metrics (Publish) and
    // the status line (RefreshStatus) show them.
    virtual void Publish() = 0;
    virtual void RefreshStatus() = 0;
    // Rank 0 returned `value` (pickled; none: it returned nothing to keep). An error fails the
    // attempt as a record of the run's.
    virtual Status RecordReturnValue(const std::optional<std::string>& value) = 0;
    // Every rank has registered and was sent the start: training runs.
    virtual void OnTrainingStarted() = 0;
    // The committed checkpoints' directory names, oldest first (the start message names them).
    virtual nlohmann::json CommittedNames() const = 0;
  };

  struct Setup {
    int number = 0;            // the attempt's number, counted across runs of the run directory
    uint64_t first_round = 1;  // the run's number of this attempt's first report round
    std::string restore_from;  // the checkpoint the ranks restore from; "" for none
    // restore_from was checked by sizes only: its parts are in host memory (RestoreVerifier).
    bool restore_checksums_skipped = false;
    std::string run_dir;
    std::function<std::string(int)> log_path;  // a rank's log file (RunStore::LogPath)
    wire::SharedFrame payload;  // the kPayload frame, shared by every connection's queue
    // The placement of this attempt's ranks: an elastic run's plan for the hosts at hand
    // (docs/elastic.md); null: the run's (ControllerOptions::plan).
    std::shared_ptr<const placement::Plan> plan;
    // run.json's "resize" of an attempt that starts the run on another number of workers than
    // the attempt before it ({"from", "to", "reason", ...}); null otherwise.
    nlohmann::json resize;
  };

  // Opens the attempt on `port` (ControlPort::BeginAttempt); the group is started by Start().
  // `opts` gives the plan, the timeouts and the experiment's name, and outlives the attempt.
  Attempt(Setup setup, const ControllerOptions& opts, ControlPort& port, WorkerGroup& group,
          const Clock& clock, Delegate& delegate);
  Attempt(const Attempt&) = delete;
  Attempt& operator=(const Attempt&) = delete;

  // Starts the worker group; from now on the start-up timeout runs. Errors: as WorkerGroup::Start.
  Status Start(const std::vector<launch::ProcessSpec>& specs);

  // --- events, forwarded by the run ---------------------------------------------------------
  void OnClosed(int rank, bool timed_out);
  void OnBadFrame(int rank, const std::string& what);
  // A body of the wrong shape from an authenticated worker fails that rank (a protocol error).
  void OnFrame(int rank, const wire::FrameView& frame);
  // A process has exited: a failure unless its rank had returned (or the group is being stopped).
  void OnExit(const std::vector<int>& ranks, const launch::ExitStatus& exit,
              const RankOutput& output);
  // Round `round` was recorded; `committed` names its checkpoint, "" when it had none.
  void OnRecorded(uint64_t round, const std::string& committed);
  // The commit ahead of `rank`'s next report(checkpoint=) has ended: it may go on, unless the
  // round was reported after an agreed preemption (its commit stops the group instead).
  void OnSettled(int rank, uint64_t round);

  // A new turn of the loop: connections closing in one turn count as closing together.
  void NewTurn() { ++turn_; }
  // Fails the attempt (the first failure is kept) and stops it; a training failure of a rank
  // that reported rounds the others have not all sent yet stops it once they are complete (see
  // above).
  void Fail(RankFailure f);
  // Stops the group (Abort()): SIGTERM, then SIGKILL after the grace period.
  void Stop();
  // An elastic run can grow (docs/elastic.md): the group is stopped on purpose once a checkpoint
  // reported from now on is committed, and the ranks that reported it are not let past it
  // meanwhile (their next report(checkpoint=) waits). The attempt then ends resized(), without a
  // failure. Training that returns first ends the attempt as usual.
  void RequestResize(std::string why);
  // Whether the attempt was stopped for a resize (RequestResize()).
  bool resized() const { return resized_; }
  // The launcher may wait in a queue (Launcher::MayQueue()) before Start() returns: run.json
  // shows the attempt with phase "queued" meanwhile (the loop is blocked in Start(), so no status
  // line is drawn; the launcher's own lines say it).
  void SetQueued(bool queued) { queued_ = queued; }
  // What the launch waited in a queue (Launcher::QueueWait()), recorded as queue_wait_s.
  void SetQueueWait(double seconds) { queue_wait_s_ = seconds; }
  // A failure of the driver's that ended the attempt before its group could start.
  void SetStartFailure(RankFailure f) { failure_ = std::move(f); }
  // The start-up timeout, the watchdog, the preemption deadline, the grace period.
  void CheckTimers();
  // Asks every rank for its Python stacks now, without stopping anything (Controller::
  // TakeStacks()); a request while one is under way shares its answer. TakeLiveStacks() then
  // gives the folder they were written to (stacks/attempt-<N>/live-<K>, every rank's file, a rank
  // that did not answer within 2 s says so), once they are; or kFailedPrecondition at once when
  // the attempt is not training.
  void RequestStacks();
  std::optional<StatusOr<std::string>> TakeLiveStacks();
  // Asks every rank to trace its next `steps` steps with jax.profiler (Controller::
  // StartProfile()): from its next report() to `steps` reports later, into <folder>/rank-<R>.
  // Returns the folder, profiles/attempt-<N>/profile-<K> under the run directory. Errors:
  // kFailedPrecondition when the attempt is not training; as storage::MakeDirs.
  StatusOr<std::string> StartProfile(int steps);
  // The earliest of the attempt's deadlines (the finish of a failed rank's rounds among them);
  // past the drain deadline only a commit in flight
  // (`commit_in_flight`) holds the attempt open, and its descriptor wakes the loop.
  std::optional<TimePoint> NextDeadline(bool commit_in_flight) const;
  // True once every process is reaped and its output drained (or the drain deadline passed).
  bool Drained();

  // --- the result ------------------------------------------------------------------------------
  // The first failure; the run completes it (the policy's decision, the log's tail).
  std::optional<RankFailure>& failure() { return failure_; }
  // When the first failure was noticed; none when there was none.
  std::optional<TimePoint> failed_at() const { return failed_at_; }
  // Rank 0's reports beyond the others' (recorded without checkpoints) and the warning naming the
  // ranks whose report() count differs; for an attempt that succeeded.
  std::vector<Round> TakeUnmatchedRounds() { return collector_.TakeUnmatchedRank0(); }
  std::string CountMismatchWarning() const { return collector_.CountMismatchWarning(); }
  // The number the next round gets (the next attempt's first_round).
  uint64_t next_round() const { return collector_.next_round(); }
  // run.json's record of the attempt, as `status` (RUNNING, FINISHED, ERRORED, ABORTED).
  nlohmann::json Record(std::string_view status) const;

  // --- what the run shows ------------------------------------------------------------------------
  int number() const { return setup_.number; }
  Phase phase() const { return phase_; }
  int world_size() const { return static_cast<int>(ranks_.size()); }
  int registered() const { return static_cast<int>(registered_); }
  const StragglerDetector& stragglers() const { return stragglers_; }
  // When the group was started (Start()).
  TimePoint started() const { return started_; }
  // Rounds per second over the attempt's recorded rounds; 0 while not known.
  double RoundsPerSecond() const;

 private:
  using StacksAsked = std::map<int, std::optional<wire::Pong>>;
  struct RankState {
    bool registered = false;
    bool done = false;
    bool refused = false;      // the controller closed its connection (a protocol error)
    uint64_t closed_turn = 0;  // the turn of the loop (NewTurn()) that saw its connection close
    std::string host;
    std::string coordinator;
  };
  // The ping of the ranks the watchdog found stale, until it fails the attempt: a rank waiting in
  // a collective for a stuck peer answers (its connection's thread does), a stopped process or a
  // cut-off host does not. The ping asks for the rank's stacks; once a rank answers with them,
  // every other rank is asked too (a worker that cannot take stacks answers with none, and then
  // only the stale ranks are asked, as before), so that the failure has every rank's stacks.
  struct WatchdogPing {
    std::vector<int> ranks;      // pinged, in the order they were found stale
    std::vector<bool> answered;  // by position in `ranks`
    TimePoint deadline;          // the last rank pinged has until then to answer
    // Every rank asked for its stacks, and its answer once it came.
    StacksAsked asked;
  };
  // Stacks asked for on demand (RequestStacks()).
  struct LiveStacks {
    StacksAsked asked;
    TimePoint deadline;
  };

  TimePoint Now() const { return clock_.Now(); }
  const placement::Plan& plan() const { return setup_.plan ? *setup_.plan : opts_.plan; }
  bool ResizeAfter(uint64_t round) const { return resize_after_ && round >= *resize_after_; }
  bool Stopping() const { return phase_ == Phase::kStopping || phase_ == Phase::kDraining; }
  bool FinishingRounds() const { return owed_ && !Stopping(); }
  void OnMessage(int rank, const wire::Registration& m);
  void OnMessage(int rank, const wire::Report& m);
  void OnMessage(int rank, wire::CheckpointReport& m);
  void OnMessage(int rank, wire::WorkerError& m);
  void OnMessage(int rank, const wire::Done& m);
  void OnMessage(int rank, const wire::Preemption& m);
  void OnMessage(int rank, const wire::Pong& m);
  void OnMessage(int rank, const wire::Collective& m);
  void AddReport(int rank, std::string_view metrics_json, std::optional<CheckpointPart> part);
  void ApplyStragglerRule();
  void Reply(int rank, std::string_view kind, const std::string& source = "");
  void StopForPreemption(const std::string& why, bool drain_timed_out);
  void ProtocolError(int rank, const std::string& what);
  void MaybeStartTraining();
  void OnStepExit(const std::vector<int>& proc_ranks, const launch::ExitStatus& exit,
                  const RankOutput& output);
  void Reblame(RankFailure killed);
  void Signal(int signal);
  std::string FloodNote() const;
  std::string RanksOn(const std::vector<int>& rs) const;
  std::string HostOf(size_t rank) const;
  std::string PlannedHost(size_t rank) const;
  void CheckProgress();
  void AskForStacks(int rank);
  std::string LimitDescription() const;
  // Writes every rank's stacks under the run directory (stacks/attempt-<N>/rank-<R>.txt) and
  // returns what the failure adds: whom the others wait for (rank_stacks.h) and where the
  // stacks are; `blamed` becomes the rank behind when one is singled out.
  std::string KeepStacks(const WatchdogPing& ping, bool may_reblame, int* blamed,
                         std::string* stacks_dir);
  std::vector<RankStacks> GivenStacks(const StacksAsked& asked) const;
  Status WriteStacks(const StacksAsked& asked, const std::vector<RankStacks>& given,
                     const std::string& dir) const;
  void CheckLiveStacks();
  bool AwaitRoundsOf(int failed, FailureCause cause);
  void StopIfRoundsFinished();

  const Setup setup_;
  const ControllerOptions& opts_;
  ControlPort& port_;
  WorkerGroup& group_;
  const Clock& clock_;
  Delegate& delegate_;

  Phase phase_ = Phase::kStarting;
  std::vector<RankState> ranks_;
  size_t registered_ = 0;
  uint64_t turn_ = 0;
  double start_time_ = 0;      // Unix seconds: the attempt's, as run.json records it
  double ready_time_ = 0;      // when every rank had registered and the start was sent; 0 = not yet
  bool queued_ = false;        // Start() may be waiting in the launcher's queue (SetQueued())
  double queue_wait_s_ = 0;    // what Start() waited in the launcher's queue
  size_t ranks_returned_ = 0;  // ranks whose training function returned (wire::Done)
  double returned_time_ = 0;   // when the last of them returned; 0 = not every rank yet
  TimePoint started_{};        // when the group was started
  TimePoint start_deadline_{};
  std::optional<TimePoint> kill_deadline_;
  std::optional<TimePoint> drain_deadline_;
  bool sent_sigterm_ = false;
  bool sent_sigkill_ = false;
  // Hosts (the plan's) of which a rank's control connection timed out: the launcher may end
  // their processes with SIGKILL at the stop (Launcher::Unreachable).
  std::set<std::string> silent_hosts_;
  uint64_t oom_kills_before_ = 0;
  std::optional<RankFailure> failure_;
  double failure_time_ = 0;  // Unix seconds the first failure was noticed, whoever is blamed
  std::optional<TimePoint> failed_at_;
  // The rounds a failed rank had reported, which the group completes before it is stopped:
  // `reports` counts them from this attempt's first round.
  struct OwedRounds {
    int rank = -1;
    uint64_t reports = 0;
    TimePoint deadline;
  };
  std::optional<OwedRounds> owed_;
  bool checkpoints_released_ = false;  // the ranks were told no commit is ahead
  ReportCollector collector_;
  Collectives collectives_;  // barrier() and broadcast_from_rank_zero() calls
  PreemptionNotice preemption_;
  Watchdog watchdog_;
  std::optional<WatchdogPing> watchdog_ping_;
  std::optional<LiveStacks> live_stacks_;
  std::optional<StatusOr<std::string>> live_result_;
  int live_taken_ = 0;  // the stacks taken on demand so far (their folders' numbers)
  int profiles_ = 0;    // the profiles asked for so far (their folders' numbers)
  StragglerDetector stragglers_;
  nlohmann::json straggler_events_ = nlohmann::json::array();  // as run.json records them
  std::optional<uint64_t> resize_after_;  // RequestResize(): the first round it stops at
  std::string resize_why_;
  bool resized_ = false;
  uint64_t rounds_ = 0;  // recorded in this attempt
  std::optional<TimePoint> first_round_at_;
};

}  // namespace jaxtrain::controller
