#include "controller/controller.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "base/fd_io.h"
#include "base/open_files.h"
#include "base/strings.h"
#include "controller/attempt.h"
#include "controller/checkpoint_committer.h"
#include "controller/collective.h"
#include "controller/console.h"
#include "controller/control_port.h"
#include "controller/failure_policy.h"
#include "controller/preemption.h"
#include "controller/rank_output.h"
#include "controller/report_collector.h"
#include "controller/restore_verifier.h"
#include "controller/round_recorder.h"
#include "controller/run_output.h"
#include "controller/run_placement.h"
#include "controller/run_record.h"
#include "controller/status_line.h"
#include "controller/stragglers.h"
#include "controller/watchdog.h"
#include "controller/worker_group.h"
#include "launch/process.h"
#include "storage/files.h"
#include "storage/run_store.h"
#include "wire/frame.h"
#include "wire/handshake.h"
#include "wire/messages.h"
#include "wire/socket.h"

namespace jaxtrain::controller {
namespace {

constexpr size_t kLogTailBytes = 4096;
// How often, at most, reports rewrite run.json to refresh the ranks' step times in it.
constexpr Duration kStepTimesRefresh = std::chrono::seconds(10);
// How long the end of a run waits for a console that does not read (the output is in the logs).
constexpr Duration kConsoleFlushTimeout = std::chrono::seconds(10);
constexpr uint64_t kSpareFiles = 256;  // descriptors left for the driver's own files
constexpr uint64_t kMinOpenLogs = 16;  // logs held open however low the limit is
}  // namespace

std::string_view OutcomeStateName(Outcome::State state) {
  switch (state) {
    case Outcome::State::kSucceeded: return "FINISHED";
    case Outcome::State::kFailed: return "ERRORED";
    case Outcome::State::kAborted: return "ABORTED";
  }
  return "ABORTED";
}

// The run: what spans its attempts, touched only by the event-loop thread. Each attempt is an
// Attempt (attempt.h), made fresh by StartAttempt() and ended by EndAttempt(); the loop forwards
// the control port's and the worker group's events to it. RunLoop() reads as the run's state
// machine: step the attempt until it is over and no commit is in flight, then record it, ask
// FailurePolicy, and start the next attempt or finish.
struct Controller::Loop : ControlPort::Delegate,
                          WorkerGroup::Delegate,
                          RoundRecorder::Delegate,
                          Attempt::Delegate {
  Loop(Controller& c, storage::RunStore s, std::unique_ptr<CheckpointCommitter> committer)
      : ctl(c),
        store(std::move(s)),
        record(store, c.options_, c.clock_),
        recorder(store, std::move(committer), c.clock_, *this),
        policy(c.options_.max_failures, c.options_.max_start_failures,
               FailurePolicy::kMaxStorageFailures, c.options_.max_preemptions),
        placement(c.options_, *c.launcher_, [this](const std::string& line) { Say(line); }),
        output(
            c.options_.console_fd, c.options_.status_line,
            [this](int r) { return store.LogPath(r); },
            static_cast<int>(c.options_.plan.workers.size())) {}

  Controller& ctl;
  storage::RunStore store;
  RunRecord record;  // run.json, error.txt and return_value.pkl (run_record.h)
  // Records completed rounds in order, committing their checkpoints off this thread, one at a
  // time (round_recorder.h).
  RoundRecorder recorder;
  std::unique_ptr<RestoreVerifier> verifier;  // set by Start()
  FailurePolicy policy;
  // The listener and the ranks' connections, through the handshake (control_port.h), and the
  // workers' processes (worker_group.h): the run's, made once by Start(); each attempt uses them.
  std::unique_ptr<ControlPort> port;
  std::unique_ptr<WorkerGroup> group;
  std::unique_ptr<Attempt> attempt;  // the attempt in progress, or the last one
  // The plan of the attempt in progress (or of the next one) and its processes; an elastic
  // run's choice of hosts and its resizes (run_placement.h).
  RunPlacement placement;
  MetricsBook metrics;    // what Publish() copies to the Controller (run_metrics.h)
  int first_attempt = 0;  // attempts of earlier runs of this run directory
  // The payload's frame, sealed once for every rank of every attempt (its key is fresh for the
  // run, its body the run's; each connection gets the key under its own session).
  wire::SharedFrame payload;
  RunOutput output;  // the console, its status line and the ranks' logs (run_output.h)
  std::optional<std::string> abort_reason;  // set once Abort() counts: the run is aborted
  uint64_t stacks_request = 0;  // the request (Controller::AskLoop()) the stacks asked for answer
  // The run's outcome so far: its failures (one per failed attempt) and warnings, the last round
  // recorded and rank 0's metrics of it; Finish() completes it.
  Outcome outcome;

  TimePoint Now() const { return ctl.clock_.Now(); }

  // --- the console and its status line -------------------------------------------------------

  void Say(const std::string& line) override { output.Say(line); }

  // The launcher's notes; its details only in a verbose run.
  void SayLauncherNotes() {
    for (const std::string& note : ctl.launcher_->TakeNotes()) Say(note);
    for (const std::string& detail : ctl.launcher_->TakeDetails()) {
      if (ctl.options_.verbose) Say(detail);
    }
  }

  void RefreshStatus() override {
    if (attempt->phase() == Attempt::Phase::kDraining) return;
    output.ShowStatus({.attempt = attempt->number(),
                       .ranks_up = attempt->registered(),
                       .world_size = attempt->world_size(),
                       .round = outcome.rounds,
                       .metrics_json = outcome.last_metrics_json,
                       .rounds_per_s = attempt->RoundsPerSecond(),
                       .stragglers = attempt->stragglers().Stragglers()});
  }

  // Rank output to its log; a log that cannot be written is a warning of the run's, once.
  void WriteLog(int rank, std::string_view text) { Warn(output.WriteLog(rank, text)); }
  void Warn(std::string warning) {
    if (!warning.empty()) outcome.warnings.push_back(std::move(warning));
  }

  // --- the run's metrics (run_metrics.h) ------------------------------------------------------

  // Copies the run's metrics where Controller::metrics() reads them, in the attempt's phase.
  void Publish() override {
    switch (attempt->phase()) {
      case Attempt::Phase::kStarting:
        return PublishAs(attempt->number() > first_attempt ? "RESTARTING" : "STARTING");
      case Attempt::Phase::kRunning: return PublishAs("RUNNING");
      case Attempt::Phase::kStopping:
      case Attempt::Phase::kDraining: return PublishAs("STOPPING");
    }
  }

  void PublishAs(std::string state) {
    const RunMetrics& now =
        metrics.Update(std::move(state), attempt->number(), attempt->world_size(),
                       attempt->registered(), attempt->stragglers());
    MutexLock lock(ctl.metrics_mu_);
    ctl.metrics_ = now;
  }

  // --- the attempt's events --------------------------------------------------------------------

  void OnClosed(int rank, bool timed_out) override { attempt->OnClosed(rank, timed_out); }
  void OnBadFrame(int rank, const std::string& what) override { attempt->OnBadFrame(rank, what); }
  void OnFrame(int rank, const wire::FrameView& f) override { attempt->OnFrame(rank, f); }
  void OnExit(const std::vector<int>& proc_ranks, const launch::ExitStatus& exit,
              const RankOutput& split) override {
    attempt->OnExit(proc_ranks, exit, split);
  }
  void OnLog(int rank, std::string_view text) override { WriteLog(rank, text); }
  void OnConsole(std::string text) override { output.ToConsole(std::move(text)); }

  void CountReport() override { metrics.CountReport(); }
  void AddRound(Round round) override { recorder.Add(std::move(round)); }
  void RecordRunning(bool if_stale) override {
    if (if_stale && record.SinceWritten() < kStepTimesRefresh) return;
    Status written = WriteRunState("RUNNING");
    if (!written.ok()) Say("cannot write run.json: " + written.message());
  }

  Status RecordReturnValue(const std::optional<std::string>& value) override {
    return record.WriteReturnValue(value);
  }

  nlohmann::json CommittedNames() const override {
    nlohmann::json names = nlohmann::json::array();
    for (const auto& r : recorder.records()) names.push_back(r.dir_name);
    return names;
  }

  void OnTrainingStarted() override {
    const TimePoint now = Now();
    metrics.TrainingStarted(now - attempt->started(), now);
    // The group is ready: the next attempt's processes can start ahead (standby workers), at
    // low priority, so that a restart or a later fit() finds them past import jax.
    Status prepared = ctl.launcher_->PrepareNext(placement.workers().specs);
    if (!prepared.ok()) Say("warning: " + prepared.message() + "; a restart starts afresh");
    SayLauncherNotes();
  }

  // --- rounds (round_recorder.h) ---------------------------------------------------------

  void OnRecorded(const Round& round, const std::string& committed) override {
    outcome.rounds = round.round;
    outcome.last_metrics_json = round.metrics_json;
    attempt->OnRecorded(round.round, committed);
    metrics.CountRound(round.round);
    if (!committed.empty()) {
      metrics.CountCommit(recorder.last_commit().took, recorder.last_commit().bytes);
      {
        std::lock_guard<std::mutex> lock(ctl.mu_);
        ++ctl.commits_;
      }
      ctl.done_cv_.notify_all();
    }
    RefreshStatus();
    Publish();
  }

  void OnSettled(int rank, uint64_t round) override { attempt->OnSettled(rank, round); }

  // The attempt names the host of a rank's failure; one of the run directory's is this host's.
  void OnFailed(RoundFailure f) override {
    attempt->Fail({.rank = f.rank,
                   .host = f.rank < 0 ? HostName() : "",
                   .cause = f.cause,
                   .status_code = f.code,
                   .message = std::move(f.message)});
  }

  // --- the loop ------------------------------------------------------------------------------

  // True when Abort() was called since the last look; the run is then marked aborted, with
  // Abort()'s reason, unless `counts` is false (a failure or a drain already ends the attempt).
  bool TakeAbortRequest(bool counts) {
    if (!ctl.abort_requested_.exchange(false)) return false;
    std::lock_guard<std::mutex> lock(ctl.mu_);
    if (counts && !abort_reason) {
      abort_reason = ctl.abort_reason_;
      Say("stopping the run: " + *abort_reason);
    }
    return true;
  }

  // The answer to a request of another thread's (Controller::AskLoop()).
  // The number of the request of another thread's that the loop takes now.
  uint64_t Taken() {
    std::lock_guard<std::mutex> lock(ctl.mu_);
    return ctl.request_number_;
  }

  // A request that timed out is answered to nobody: `request` is the number of the request
  // taken (Taken()), and an answer goes only to the request now awaited.
  void Answer(uint64_t request, StatusOr<std::string> answer) {
    std::lock_guard<std::mutex> lock(ctl.mu_);
    if (request != ctl.request_number_) return;
    ctl.request_result_ = std::move(answer);
    ctl.done_cv_.notify_all();
  }

  // Resets the wake-up eventfd (non-blocking: nothing happens when it was not readable).
  void DrainWake() {
    uint64_t v;
    [[maybe_unused]] ssize_t n = read(ctl.wake_fd_, &v, sizeof(v));
  }

  // One turn of the loop; true once the attempt is over: every process reaped, its output
  // drained and no commit in flight (an attempt ends only once its commit has ended and its
  // round is recorded).
  bool Step() {
    attempt->NewTurn();
    const bool counts = !attempt->failure() && attempt->phase() != Attempt::Phase::kDraining;
    if (TakeAbortRequest(counts)) attempt->Stop();
    if (ctl.stacks_requested_.exchange(false)) {
      stacks_request = Taken();
      attempt->RequestStacks();
    }
    if (const int steps = ctl.profile_steps_.exchange(0)) {
      Answer(Taken(), attempt->StartProfile(steps));
    }
    if (attempt->Drained() && !recorder.busy()) return true;

    // Connections before the listener: a hello that has arrived is handled before new
    // connections can push its connection out (Accept()). Connections before processes: a
    // worker's last frames are handled before its exit.
    // A descriptor of -1 (a port without a listener, a clock that moves by itself) is ignored.
    pollfd fds[] = {{ctl.wake_fd_, POLLIN, 0},        {port->ready_fd(), POLLIN, 0},
                    {recorder.ready_fd(), POLLIN, 0}, {port->listen_fd(), POLLIN, 0},
                    {group->ready_fd(), POLLIN, 0},   {ctl.clock_.wake_fd(), POLLIN, 0},
                    {placement.ready_fd(), POLLIN, 0}};
    std::optional<TimePoint> next = attempt->NextDeadline(recorder.busy());
    if (auto t = port->NextDeadline()) next = next ? std::min(*next, *t) : *t;
    if (poll(fds, std::size(fds), PollTimeoutMs(ctl.clock_, next)) > 0) {
      if (fds[0].revents != 0) DrainWake();
      if (fds[1].revents != 0) port->OnConnsReady();
      if (fds[2].revents != 0) recorder.OnCommitReady();
      if (fds[3].revents != 0) port->Accept();
      if (fds[4].revents != 0) group->OnReady();
      if (fds[5].revents != 0) ClearWake(ctl.clock_);
      if (fds[6].revents != 0) OnCapacityChange();
    }
    port->ExpireHandshakes();
    attempt->CheckTimers();
    if (std::optional<StatusOr<std::string>> stacks = attempt->TakeLiveStacks()) {
      Answer(stacks_request, *std::move(stacks));
    }
    port->Sweep();
    return false;
  }

  // --- attempts ------------------------------------------------------------------------------

  // The checkpoint the first attempt restores from (RestoreVerifier), chosen on the thread that
  // calls Start(), before the loop runs.
  RestoreVerifier::Result CheckpointToRestore() {
    return Chosen(
        RestoreVerifier::Choose(store.dir(), recorder.records(), ctl.options_.verify_checksums));
  }

  // `chosen`, its warnings said.
  RestoreVerifier::Result Chosen(RestoreVerifier::Result chosen) {
    for (const auto& w : chosen.warnings) Say("warning: " + w);
    return chosen;
  }

  // The checkpoint a restart restores from, verified on the verifier's thread while the loop
  // keeps honouring Abort() (no worker is alive and no commit in flight by then); nullopt when
  // the run was aborted meanwhile, the verification cancelled.
  std::optional<RestoreVerifier::Result> CheckpointToRestoreServingAbort() {
    Status started = verifier->Start(store.dir(), recorder.records(), ctl.options_.verify_checksums,
                                     ctl.options_.memory_store);
    if (!started.ok()) return CheckpointToRestore();
    RestoreVerifier::Result chosen = verifier->Wait(ctl.wake_fd_, [this] {
      DrainWake();
      return TakeAbortRequest(/*counts=*/true);
    });
    if (chosen.cancelled) return std::nullopt;
    return Chosen(std::move(chosen));
  }

  // Starts attempt `number`, a fresh Attempt, restoring from `restore` (its dir "" for none), on
  // `plan`; `resized`: the attempt before it ended RESIZED (its cause in the metrics).
  // Errors: as Launcher::Launch().
  Status StartAttempt(int number, const RestoreVerifier::Result& restore, bool resized = false) {
    metrics.CountAttempt(resized ? "resize"
                         : number == first_attempt || outcome.failures.empty()
                             ? "start"
                             : std::string(FailureCauseName(outcome.failures.back().cause)));
    const uint64_t first_round = attempt ? attempt->next_round() : store.LastRound() + 1;
    // The payload's size was checked by Start(): its frame always seals.
    if (!payload.frame) {
      payload = *wire::SealShared(wire::MessageType::kPayload, ctl.options_.payload);
    }
    attempt = std::make_unique<Attempt>(
        Attempt::Setup{.number = number,
                       .first_round = first_round,
                       .restore_from = restore.dir,
                       .restore_checksums_skipped = restore.checksums_skipped,
                       .run_dir = store.dir(),
                       .log_path = [this](int r) { return store.LogPath(r); },
                       .payload = payload,
                       .plan = placement.plan(),
                       .resize = placement.TakeResize()},
        ctl.options_, *port, *group, ctl.clock_, *this);
    JT_RETURN_IF_ERROR(SweepStaging());
    if (number > first_attempt) {
      Say("restarting the worker group: attempt " + std::to_string(number) +
          (restore.dir.empty() ? ", from the start" : ", from checkpoint " + restore.dir));
    }
    output.BeginAttempt(number);  // each log gets the attempt's header before its first output
    (*placement.workers().shared_env)["JAXTRAIN_ATTEMPT"] = std::to_string(number);
    // An attempt that run.json does not show must not run: its rounds would be lost with it.
    // One whose launch may wait in a queue (Kueue) shows as queued until the launch returns:
    // the loop is blocked meanwhile, so `jaxtrain show` says it, not the status line.
    const bool may_queue = ctl.launcher_->MayQueue();
    attempt->SetQueued(may_queue);
    JT_RETURN_IF_ERROR(WriteRunState("RUNNING"));
    PublishAs(may_queue ? "QUEUED" : number > first_attempt ? "RESTARTING" : "STARTING");
    Status started = attempt->Start(placement.workers().specs);
    attempt->SetQueued(false);
    attempt->SetQueueWait(ctl.launcher_->QueueWait());
    SayLauncherNotes();
    if (started.ok() && (may_queue || ctl.launcher_->QueueWait() > 0)) {
      RecordRunning(/*if_stale=*/false);  // no longer queued; the wait it had
    }
    JT_RETURN_IF_ERROR(started);
    // The descriptors left beside a connection per rank and the processes' pidfds and pipes are
    // the logs' to keep open; the others are opened again when written to.
    rlimit files{};
    getrlimit(RLIMIT_NOFILE, &files);
    const uint64_t taken =
        static_cast<uint64_t>(attempt->world_size()) + 2 * group->size() + kSpareFiles;
    output.set_max_open_logs(files.rlim_cur > taken + kMinOpenLogs ? files.rlim_cur - taken
                                                                   : kMinOpenLogs);
    RefreshStatus();
    placement.WatchMissingHosts();
    return OkStatus();
  }

  // Elastic runs: the next attempt's plan (RunPlacement::Choose), its resizes recorded.
  Status ChoosePlan(bool restart) {
    Status chosen = placement.Choose(restart);
    record.set_resizes(placement.resizes());
    return chosen;
  }

  // The run lacks hosts that answer again, or hosts are leaving it: it resizes at its next
  // committed checkpoint.
  void OnCapacityChange() {
    if (std::optional<std::string> why = placement.TakeCapacityChange()) {
      attempt->RequestResize(*why);
    }
  }

  // Ends the attempt whose processes are all reaped; true when a new attempt has started.
  bool EndAttempt() {
    group->CloseOutputs();
    placement.StopWatching();
    std::optional<RankFailure>& failure = attempt->failure();
    const bool aborted = abort_reason.has_value();
    // Stopped on purpose to grow (Attempt::RequestResize): a planned restart, not a failure.
    const bool resized = attempt->resized() && !failure && !aborted;
    // The failed rank's log exists now, with this attempt's header, even if it printed nothing:
    // its tail goes into the failure. The other silent ranks' headers wait for their next text
    // or the end of the run (rank_logs.h): a restart creates no file per silent rank.
    if (failure && failure->rank >= 0) WriteLog(failure->rank, "");
    if (!failure && !aborted && !resized) {
      for (Round& r : attempt->TakeUnmatchedRounds()) recorder.Add(std::move(r));
      std::string mismatch = attempt->CountMismatchWarning();
      if (!mismatch.empty()) {
        Say("warning: " + mismatch);
        outcome.warnings.push_back(mismatch);
      }
    }
    std::string_view status = failure   ? "ERRORED"
                              : aborted ? "ABORTED"
                              : resized ? "RESIZED"
                                        : "FINISHED";
    if (failure && !aborted) {
      FailureDecision d = policy.Decide(failure->cause, failure->status_code);
      failure->retried = d.retry();
      failure->decision = std::move(d.reason);
    }
    record.AddAttempt(attempt->Record(status));
    metrics.NoticeFailure(attempt->failed_at());
    if (resized) {
      std::optional<RestoreVerifier::Result> restore = CheckpointToRestoreServingAbort();
      return restore && Restart(*restore, /*resized=*/true);
    }
    if (!failure || aborted) return false;
    // Said now rather than when first noticed: by now the exit status has refined the cause.
    // Without a rank: the driver's own work, or the ranks' checkpoint parts that disagree.
    const std::string who = failure->rank >= 0 ? "rank " + std::to_string(failure->rank)
                            : failure->cause == FailureCause::kCheckpoint ? "the checkpoint commit"
                                                                          : "the driver";
    Say("attempt " + std::to_string(attempt->number()) + " failed: " + who + " (host " +
        (failure->host.empty() ? "?" : failure->host) + "): " + failure->message);
    failure->log_tail = storage::TailOfFile(failure->log_path, kLogTailBytes);
    outcome.failures.push_back(*failure);
    if (!failure->retried) {
      Say("not restarting: " + failure->decision +
          (ctl.options_.verbose && failure->status_code != StatusCode::kOk
               ? " [" + std::string(StatusCodeName(failure->status_code)) + "]"
               : ""));
      return false;
    }
    std::optional<RestoreVerifier::Result> restore = CheckpointToRestoreServingAbort();
    return restore && Restart(*restore, /*resized=*/false);
  }

  // Starts the next attempt from `restore`, on the hosts an elastic run chooses again; true when
  // it started. An abort meanwhile ends the run aborted; an attempt that cannot start, failed.
  bool Restart(const RestoreVerifier::Result& restore, bool resized) {
    // A planned resize waits for no host: the monitor has just asked about them.
    Status s = ctl.options_.elastic ? ChoosePlan(/*restart=*/!resized) : OkStatus();
    // Whether the next attempt was made (StartAttempt makes it first): until then `attempt` is
    // the one that ended, already recorded.
    const bool made = s.ok();
    if (made) s = StartAttempt(attempt->number() + 1, restore, resized);
    if (!s.ok() && TakeAbortRequest(/*counts=*/true)) {
      // Stopped while the group started (Abort() interrupts the launcher): the run is aborted,
      // not failed, and this attempt never ran.
      if (made) record.AddAttempt(attempt->Record("ABORTED"));
      return false;
    }
    if (!s.ok()) {
      Say("cannot restart the worker group: " + s.message());
      outcome.failures.push_back(
          {.rank = -1,
           .attempt = attempt->number() + (made ? 0 : 1),
           .cause = FailureCause::kStartUp,
           .message = "the worker group could not be started: " + s.message()});
      if (made) record.AddAttempt(attempt->Record("ERRORED"));
      return false;
    }
    return true;
  }

  // Staged files of rounds that never completed, and interrupted commits: never checkpoints.
  // Called only while no worker process is alive.
  Status SweepStaging() {
    return storage::RemoveTree(storage::JoinPath(store.dir(), storage::kStagingDir));
  }

  Outcome Finish() {
    placement.StopWatching();
    // Standby workers serve a later fit() of the same processes, but not past an abort.
    ctl.launcher_->EndRun(/*keep=*/!abort_reason);
    // What the last stop could not do (a Slurm step it could not cancel), said before the end.
    SayLauncherNotes();
    Status swept = SweepStaging();
    if (!swept.ok()) Say("cannot clean up: " + swept.message());
    Warn(output.CloseLogs());  // every log numbers every attempt (rank_logs.h)
    port.reset();              // every connection closed, and the listener

    Outcome& out = outcome;
    out.attempts = attempt->number() - first_attempt + 1;
    if (abort_reason) {
      out.state = Outcome::State::kAborted;
      out.abort_reason = *abort_reason;
    } else if (!out.failures.empty() && (attempt->failure() || out.failures.back().rank < 0)) {
      out.state = Outcome::State::kFailed;
      out.failure = out.failures.front();
      Status s = record.WriteError(out.failures);
      if (!s.ok()) Say("cannot write error.txt: " + s.message());
    } else {
      out.state = Outcome::State::kSucceeded;
    }
    Status written = WriteRunState(OutcomeStateName(out.state));
    if (!written.ok()) {
      // The run's record says RUNNING, not how it ended: never report that as a success.
      Say("cannot write run.json: " + written.message());
      if (out.state == Outcome::State::kFailed) {
        out.warnings.push_back("run.json could not be written: " + written.message());
      } else {
        RankFailure f = StorageFailure(
            written, "the run ended (" + std::string(OutcomeStateName(out.state)) +
                         "), but its record could not be written: " + written.message());
        f.attempt = attempt->number();
        out.failures.push_back(f);
        out.failure = f;
        out.state = Outcome::State::kFailed;
      }
    }
    out.run_state = record.state();
    out.return_value = record.return_value();
    PublishAs(std::string(OutcomeStateName(out.state)));
    store.Unlock();         // the run is over: another driver may resume it
    return std::move(out);  // the loop ends with it
  }

  // run.json as `status`, with the attempt in progress while the run is RUNNING.
  Status WriteRunState(std::string_view status) {
    return record.Write(status, outcome.rounds,
                        status == "RUNNING" ? attempt->Record(status) : nlohmann::json());
  }
};

Controller::Controller(ControllerOptions options, std::unique_ptr<launch::Launcher> launcher,
                       const Clock& clock, ControllerSeams seams)
    : options_(std::move(options)),
      launcher_(std::move(launcher)),
      clock_(clock),
      seams_(std::move(seams)) {
  if (!seams_.open_port) {
    seams_.open_port = [this](std::string secret, ControlPort::Delegate& delegate,
                              int* port_number) -> StatusOr<std::unique_ptr<ControlPort>> {
      JT_ASSIGN_OR_RETURN(int listen_fd, wire::Listen(options_.listen_host, 0, port_number));
      return ControlPort::Create(listen_fd, std::move(secret), clock_, options_.handshake_timeout,
                                 delegate);
    };
  }
  if (!seams_.make_group) seams_.make_group = WorkerGroup::Create;
}

Controller::~Controller() {
  if (thread_.joinable()) {
    Abort("the controller was destroyed while the run was in progress");
    thread_.join();
  }
  if (wake_fd_ >= 0) close(wake_fd_);
}

Status Controller::Start() {
  const int world_size = static_cast<int>(options_.plan.workers.size());
  if (world_size == 0) return InvalidArgumentError("the plan has no workers");
  if (options_.payload.size() > wire::kMaxControllerFrameBody) {
    return InvalidArgumentError("the pickled training function and its train_loop_config are " +
                                std::to_string(options_.payload.size()) +
                                " bytes, more than the limit of " +
                                std::to_string(wire::kMaxControllerFrameBody) +
                                "; pass large data as files, not in train_loop_config");
  }
  // A control connection per rank is needed; a pidfd and an output pipe per process (one process
  // per rank at most) and a log file per rank that prints are wanted, beside the driver's own
  // files. Logs beyond what the limit leaves are opened when written to (rank_logs.h).
  const auto ranks = static_cast<uint64_t>(world_size);
  JT_RETURN_IF_ERROR(RaiseOpenFileLimit(ranks + kSpareFiles, 4 * ranks + kSpareFiles));
  JT_ASSIGN_OR_RETURN(storage::RunStore store, storage::RunStore::Open(options_.run_dir));
  std::vector<std::string> warnings;
  JT_ASSIGN_OR_RETURN(storage::CheckpointIndex index,
                      storage::CheckpointIndex::Load(store.dir(), &warnings));
  // An index that disagreed with the directory is rewritten now, so that readers of the run
  // (Result.from_path, the CLI) see what the controller restores from.
  Status reindexed = warnings.empty() ? OkStatus() : index.Save();
  JT_ASSIGN_OR_RETURN(
      std::unique_ptr<CheckpointCommitter> committer,
      CheckpointCommitter::Create(store.dir(), std::move(index), options_.retention, clock_));
  JT_ASSIGN_OR_RETURN(std::unique_ptr<RestoreVerifier> verifier, RestoreVerifier::Create());
  auto loop = std::make_unique<Loop>(*this, std::move(store), std::move(committer));
  loop->verifier = std::move(verifier);
  JT_ASSIGN_OR_RETURN(loop->group, seams_.make_group(*launcher_, options_.console_fd >= 0, *loop));
  // Abort() wakes the loop through it; without it an abort would wait for the next event.
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) return ErrnoError("cannot create the controller's wake-up eventfd", errno);
  for (const auto& w : warnings) loop->Say("warning: " + w);
  if (!reindexed.ok())
    loop->Say("warning: cannot rewrite checkpoints.json: " + reindexed.message());
  loop->first_attempt = loop->record.Resume();
  loop->outcome.rounds = loop->store.LastRound();
  const std::string secret = wire::GenerateSecret();  // the port checks hellos against it
  JT_ASSIGN_OR_RETURN(loop->port, seams_.open_port(secret, *loop, &port_));

  JT_RETURN_IF_ERROR(loop->placement.Start(
      {.argv = options_.worker_argv,
       .cwd = options_.worker_cwd,
       .env = options_.worker_env,
       .controller_address = wire::HostPort{options_.listen_host, port_}.ToString(),
       .run_dir = loop->store.dir(),
       .experiment_name = options_.experiment_name,
       .secret_hex = wire::ToHex(secret)}));
  if (options_.elastic) loop->record.set_resizes(loop->placement.resizes());
  Status started = loop->StartAttempt(loop->first_attempt, loop->CheckpointToRestore());
  if (!started.ok()) {
    // run.json may already say RUNNING; it must say how the run ended instead.
    loop->attempt->SetStartFailure(
        {.rank = -1,
         .host = HostName(),
         .cause = FailureCause::kStartUp,
         .message = "the worker group could not be started: " + started.message()});
    loop->record.AddAttempt(loop->attempt->Record("ERRORED"));
    Status recorded = loop->WriteRunState("ERRORED");
    if (!recorded.ok()) loop->Say("cannot write run.json: " + recorded.message());
    return started;
  }
  loop_ = std::move(loop);
  thread_ = std::thread([this] { RunLoop(); });
  return OkStatus();
}

void Controller::RunLoop() {
  do {
    while (!loop_->Step()) {
    }
  } while (loop_->EndAttempt());
  loop_->output.ClearStatus();
  Outcome out = loop_->Finish();
  // What the workers printed is shown before fit() returns, unless the console stopped reading.
  if (!loop_->output.Flush(kConsoleFlushTimeout)) {
    (void)WriteAll(2,
                   "jaxtrain: the console stopped reading; the rest of the workers' output is "
                   "in their log files\n");
  }
  std::lock_guard<std::mutex> lock(mu_);
  outcome_ = std::move(out);
  done_ = true;
  done_cv_.notify_all();
}

RunMetrics Controller::metrics() const {
  MutexLock lock(metrics_mu_);
  return metrics_;
}

bool Controller::Wait(Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return done_cv_.wait_for(lock, timeout, [this] { return done_; });
}

StatusOr<std::string> Controller::TakeStacks(Duration timeout) {
  std::lock_guard<std::mutex> call(request_call_mu_);
  stacks_requested_ = true;
  return AskLoop(timeout);
}

StatusOr<std::string> Controller::StartProfile(int steps, Duration timeout) {
  if (steps < 1) {
    return InvalidArgumentError("steps=" + std::to_string(steps) +
                                " is not allowed; trace 1 step or more");
  }
  std::lock_guard<std::mutex> call(request_call_mu_);
  profile_steps_ = steps;
  return AskLoop(timeout);
}

StatusOr<std::string> Controller::AskLoop(Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (done_ || wake_fd_ < 0) {
    stacks_requested_ = false;
    profile_steps_ = 0;
    return FailedPreconditionError("the run is not running");
  }
  request_result_.reset();
  ++request_number_;
  uint64_t one = 1;
  [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof(one));
  if (!done_cv_.wait_for(lock, timeout, [this] { return done_ || request_result_.has_value(); })) {
    stacks_requested_ = false;
    profile_steps_ = 0;
    return DeadlineExceededError("no answer came within " +
                                 FormatNumber(std::chrono::duration<double>(timeout).count()) +
                                 " s: the run is between attempts (a restart under way?)");
  }
  if (!request_result_) return FailedPreconditionError("the run ended");
  StatusOr<std::string> out = *std::move(request_result_);
  request_result_.reset();
  return out;
}

uint64_t Controller::WaitForCommits(uint64_t seen, Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait_for(lock, timeout, [this, seen] { return done_ || commits_ > seen; });
  return commits_;
}

void Controller::Abort(std::string reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_ || wake_fd_ < 0) return;
    if (abort_reason_.empty()) abort_reason_ = std::move(reason);
  }
  abort_requested_ = true;
  // A restart may be starting its group on the loop's thread: the launcher cuts that short.
  launcher_->Interrupt();
  uint64_t one = 1;
  // Fails only when the counter would overflow, which leaves it readable: no wake-up is lost.
  [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof(one));
}

}  // namespace jaxtrain::controller
