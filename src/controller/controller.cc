#include "controller/controller.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/fd_io.h"
#include "base/open_files.h"
#include "base/strings.h"
#include "controller/checkpoint_committer.h"
#include "controller/collective.h"
#include "controller/console.h"
#include "controller/control_port.h"
#include "controller/failure_policy.h"
#include "controller/preemption.h"
#include "controller/rank_logs.h"
#include "controller/rank_output.h"
#include "controller/report_collector.h"
#include "controller/restore_verifier.h"
#include "controller/round_recorder.h"
#include "controller/status_line.h"
#include "controller/stragglers.h"
#include "controller/watchdog.h"
#include "controller/worker_group.h"
#include "controller/worker_specs.h"
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
constexpr Duration kDrainTime = std::chrono::seconds(1);
// How often, at most, reports rewrite run.json to refresh the ranks' step times in it.
constexpr Duration kStepTimesRefresh = std::chrono::seconds(10);
// How long a rank that the progress watchdog finds stale has to answer its ping.
constexpr Duration kWatchdogPingWait = std::chrono::seconds(2);
// How long the end of a run waits for a console that does not read (the output is in the logs).
constexpr Duration kConsoleFlushTimeout = std::chrono::seconds(10);
constexpr uint64_t kSpareFiles = 256;  // descriptors left for the driver's own files
constexpr uint64_t kMinOpenLogs = 16;  // logs held open however low the limit is
// Rank 0's pickled return value in the run directory (Result.return_value reads it).
constexpr char kReturnValueFile[] = "return_value.pkl";
// The columns of the terminal on `fd`, or 100 when it is not a terminal.
size_t TerminalWidth(int fd) {
  winsize ws{};
  if (ioctl(fd, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  return 100;
}

// How many processes the kernel's out-of-memory killer has killed since boot. A SIGKILL that the
// controller did not send, while this count rose, is most likely the OOM killer's.
uint64_t OomKillCount() {
  auto text = storage::ReadFile("/proc/vmstat");
  if (!text.ok()) return 0;
  size_t at = text->find("\noom_kill ");
  return at == std::string::npos ? 0 : std::strtoull(text->c_str() + at + 10, nullptr, 10);
}

std::string HostName() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return host;
}

}  // namespace

std::string_view OutcomeStateName(Outcome::State state) {
  switch (state) {
    case Outcome::State::kSucceeded: return "FINISHED";
    case Outcome::State::kFailed: return "ERRORED";
    case Outcome::State::kAborted: return "ABORTED";
  }
  return "ABORTED";
}

// All state of a running attempt; touched only by the event-loop thread.
struct Controller::Loop : ControlPort::Delegate, WorkerGroup::Delegate, RoundRecorder::Delegate {
  enum class Phase { kStarting, kRunning, kStopping, kDraining };

  struct RankState {
    bool registered = false;
    bool done = false;
    bool refused = false;      // the controller closed its connection (a protocol error)
    uint64_t closed_turn = 0;  // the turn of the loop (Step()) that saw its connection close
    std::string host;
    std::string coordinator;
  };

  Loop(Controller& c, storage::RunStore s, std::unique_ptr<CheckpointCommitter> committer)
      : ctl(c),
        opts(c.options_),
        store(std::move(s)),
        recorder(store, std::move(committer), c.clock_, *this),
        collector(WorldSize(c), store.LastRound() + 1),
        collectives(WorldSize(c)),
        policy(c.options_.max_failures, c.options_.max_start_failures,
               FailurePolicy::kMaxStorageFailures, c.options_.max_preemptions),
        preemption(WorldSize(c)),
        watchdog(c.clock_, WorldSize(c), c.options_.progress_timeout),
        stragglers(WorldSize(c)),
        logs([this](int r) { return store.LogPath(r); }, WorldSize(c)) {}

  static int WorldSize(const Controller& c) {
    return static_cast<int>(c.options_.plan.workers.size());
  }

  Controller& ctl;
  const ControllerOptions& opts;
  storage::RunStore store;
  // Records completed rounds in order, committing their checkpoints off this thread, one at a
  // time (round_recorder.h).
  RoundRecorder recorder;
  std::unique_ptr<RestoreVerifier> verifier;  // set by Start()
  bool checkpoints_released = false;          // this attempt's ranks were told no commit is ahead
  ReportCollector collector;
  Collectives collectives;  // this attempt's barrier() and broadcast_from_rank_zero() calls
  FailurePolicy policy;
  PreemptionNotice preemption;      // this attempt's (preemption.h)
  uint64_t attempt_base_round = 1;  // the run's number of this attempt's first round
  Watchdog watchdog;                // this attempt's progress watchdog
  // The ping of the ranks the watchdog found stale, until it fails the attempt: a rank waiting in
  // a collective for a stuck peer answers (its connection's thread does), a stopped process or a
  // cut-off host does not.
  struct WatchdogPing {
    std::vector<int> ranks;      // pinged, in the order they were found stale
    std::vector<bool> answered;  // by position in `ranks`
    TimePoint deadline;          // the last rank pinged has until then to answer
  };
  std::optional<WatchdogPing> watchdog_ping;
  StragglerDetector stragglers;  // this attempt's step times (stragglers.h)
  TimePoint state_written;       // when run.json was last written (WriteRunState())
  // This attempt's straggler changes as run.json records them (AttemptState()).
  nlohmann::json straggler_events = nlohmann::json::array();
  RunMetrics metrics;  // what Publish() copies to the Controller (run_metrics.h)
  std::optional<TimePoint> group_spawned;    // this attempt's group, until it all registered
  std::optional<TimePoint> failure_noticed;  // the first failure since training last ran
  // The listener and the ranks' connections, through the handshake (control_port.h); set by
  // Start().
  std::unique_ptr<ControlPort> port;
  int first_attempt = 0;  // attempts of earlier runs of this run directory
  int attempt = 0;
  double start_time = 0;
  double attempt_start_time = 0;
  // When this attempt's every rank had registered and the start was sent; 0 = not yet.
  double attempt_ready_time = 0;
  double failure_time = 0;  // when this attempt's first failure was noticed, whoever is blamed
  nlohmann::json attempt_log = nlohmann::json::array();  // run.json's attempts, earlier runs' too
  std::string restore_from;  // the checkpoint this attempt starts from; "" for none
  // restore_from was checked by sizes only: its parts are in host memory (RestoreVerifier).
  bool restore_checksums_skipped = false;
  std::vector<launch::ProcessSpec> specs;
  std::shared_ptr<std::map<std::string, std::string>> shared_env;  // every spec's shared_env
  std::vector<RankFailure> failures;
  uint64_t turn = 0;  // Step()s taken
  bool sent_sigterm = false;
  bool sent_sigkill = false;
  uint64_t oom_kills_before = 0;
  bool log_failed = false;
  std::vector<std::string> warnings;
  Phase phase = Phase::kStarting;
  // This attempt's processes (worker_group.h); set by Start().
  std::unique_ptr<WorkerGroup> group;
  RankLogs logs;  // created on each rank's first output (rank_logs.h)
  std::vector<RankState> ranks;
  size_t registered = 0;                       // ranks of this attempt registered
  std::string payload_header;                  // the kPayload frame's header
  std::shared_ptr<const std::string> payload;  // its body, shared by every connection's queue
  TimePoint start_deadline;
  std::optional<TimePoint> kill_deadline;
  std::optional<TimePoint> drain_deadline;
  std::optional<RankFailure> failure;
  bool aborted = false;
  std::string abort_reason;
  uint64_t rounds = 0;
  std::string last_metrics;

  TimePoint Now() const { return ctl.clock_.Now(); }

  void Say(const std::string& line) override {
    std::string text = "jaxtrain: " + line + "\n";
    if (!status.empty()) console.Write(opts.console_fd, kEraseLine);
    console.Write(2, std::move(text));
    if (!status.empty()) console.Write(opts.console_fd, status);
  }

  // --- the console and its status line -------------------------------------------------------

  // Rank output, jaxtrain's own lines (stderr) and the status line, in order, written by a thread
  // of its own: a console that does not read never blocks the loop.
  Console console;
  std::string status;  // the status line on the console now; "" = none
  uint64_t attempt_rounds = 0;
  std::optional<TimePoint> attempt_first_round;

  // Writes rank output to the console, under the status line when there is one.
  void ToConsole(std::string text) {
    if (opts.console_fd < 0 || text.empty()) return;
    if (!status.empty()) text = kEraseLine + text + status;
    console.Write(opts.console_fd, std::move(text));
  }

  void RefreshStatus() {
    if (!opts.status_line || opts.console_fd < 0 || phase == Phase::kDraining) return;
    StatusView view{.attempt = attempt,
                    .world_size = static_cast<int>(ranks.size()),
                    .round = rounds,
                    .metrics_json = last_metrics};
    view.ranks_up = static_cast<int>(registered);
    view.stragglers = stragglers.Stragglers();
    if (attempt_rounds > 1) {
      double s = std::chrono::duration<double>(Now() - *attempt_first_round).count();
      if (s > 0) view.rounds_per_s = static_cast<double>(attempt_rounds - 1) / s;
    }
    std::string line = FormatStatus(view, TerminalWidth(opts.console_fd) - 1);
    if (line == status) return;
    status = line;
    console.Write(opts.console_fd, kEraseLine + status);
  }

  void ClearStatus() {
    if (status.empty()) return;
    console.Write(opts.console_fd, kEraseLine);
    status.clear();
  }

  // --- failures and stopping -------------------------------------------------------------------

  void Fail(RankFailure f) {
    // A rank lost while its host is being preempted went with the host (or noticed a peer that
    // did): the preemption's, not the run's failure budget.
    if (!failure && preemption.open() && IsTrainingFailure(f.cause)) {
      f.message = "during the preemption notice of " + preemption.Describe() + ": " + f.message;
      f.cause = FailureCause::kPreemption;
      f.preemption = nlohmann::json::parse(preemption.Info(/*drain_timed_out=*/false));
    }
    if (!failure) {
      if (failure_time == 0) failure_time = ctl.clock_.UnixSeconds();  // kept by Reblame()
      f.attempt = attempt;
      if (f.rank >= 0) {
        if (!ranks[static_cast<size_t>(f.rank)].host.empty()) {
          f.host = ranks[static_cast<size_t>(f.rank)].host;
        } else if (f.host.empty() && static_cast<size_t>(f.rank) < opts.plan.workers.size()) {
          f.host = opts.plan.workers[static_cast<size_t>(f.rank)].host;  // it never registered
        }
        f.log_path = store.LogPath(f.rank);
      }
      failure = std::move(f);
      if (!failure_noticed) failure_noticed = Now();
    }
    BeginStop();
  }

  // A failure of the driver's own records (the run directory), blamed on no rank.
  // `why` is the error, whose code FailurePolicy decides from.
  static RankFailure StorageFailure(const Status& why, std::string message) {
    return {.rank = -1,
            .host = HostName(),
            .cause = FailureCause::kStorage,
            .status_code = why.code(),
            .message = std::move(message)};
  }

  // Rank output to its log. A log that cannot be written is said once, not fatal: the output
  // still reaches the console, and the metrics and checkpoints are recorded elsewhere.
  void WriteLog(int rank, std::string_view text) { WarnLogs(logs.Write(rank, text)); }
  void WarnLogs(const Status& s) {
    if (s.ok() || log_failed) return;
    log_failed = true;
    Say("warning: " + s.message() + "; rank output is missing from the logs from here on");
    warnings.push_back(s.message());
  }

  void BeginStop() {
    if (phase == Phase::kStopping || phase == Phase::kDraining) return;
    phase = Phase::kStopping;
    Publish();
    if (AnyUnreaped()) {
      // The grace period runs from the decision to stop, not from when the signals were sent.
      kill_deadline = Now() + opts.terminate_grace;
      Signal(SIGTERM);
      sent_sigterm = true;
      // A stopped process (SIGSTOP, a debugger) acts on SIGTERM only once continued.
      Signal(SIGCONT);
    }
  }

  // A signal that cannot be delivered is said; the stop goes on (SIGKILL after the grace period).
  void Signal(int signal) {
    Status s = group->Signal(signal);
    if (!s.ok()) Say("warning: " + s.message());
  }

  bool AnyUnreaped() const { return group->running() > 0; }

  // --- connections (control_port.h) ---------------------------------------------------------

  // What a start-up failure adds when connections were dropped meanwhile.
  std::string FloodNote() const {
    if (port->dropped() == 0) return "";
    return "; meanwhile the controller dropped " + std::to_string(port->dropped()) +
           " connection(s) to its control port that sent no valid hello (is another process "
           "flooding it?)";
  }

  void OnClosed(int rank) override {
    ranks[static_cast<size_t>(rank)].closed_turn = turn;
    if (!ranks[static_cast<size_t>(rank)].done && phase != Phase::kStopping &&
        phase != Phase::kDraining) {
      Fail({.rank = rank,
            .cause = FailureCause::kConnection,
            .message = "its control connection closed before its training function returned"});
    }
  }

  void OnBadFrame(int rank, const std::string& what) override { ProtocolError(rank, what); }

  // A body of the wrong shape from an authenticated worker fails that rank (a protocol error).
  void OnFrame(int rank, const wire::FrameView& f) override {
    StatusOr<wire::WorkerMessage> message = wire::DecodeWorkerMessage(f);
    if (!message.ok()) return ProtocolError(rank, message.status().message());
    std::visit([&](auto& m) { OnMessage(rank, m); }, *message);
  }

  void OnMessage(int rank, const wire::Registration& m) {
    RankState& r = ranks[static_cast<size_t>(rank)];
    if (!r.registered) ++registered;
    r.registered = true;
    r.host = m.host;
    r.coordinator = m.coordinator;
    RefreshStatus();
    MaybeStartTraining();
    Publish();
  }

  void OnMessage(int rank, const wire::Report& m) { AddReport(rank, m.metrics_json, std::nullopt); }

  // A report, with or without a checkpoint: the rounds it completes are recorded, and at each the
  // straggler rule is applied.
  void AddReport(int rank, std::string_view metrics_json, std::optional<CheckpointPart> part) {
    watchdog.Progress(rank);
    ++metrics.reports;
    stragglers.Report(rank, Now());
    for (Round& done : collector.Add(rank, metrics_json, std::move(part))) {
      ApplyStragglerRule();
      recorder.Add(std::move(done));
    }
    if (phase == Phase::kRunning && Now() - state_written >= kStepTimesRefresh) {
      Status written = WriteRunState("RUNNING");
      if (!written.ok()) Say("cannot write run.json: " + written.message());
    }
  }

  void ApplyStragglerRule() {
    std::vector<StragglerChange> changes = stragglers.Evaluate();
    if (changes.empty()) return;
    for (const StragglerChange& c : changes) {
      const auto& host = ranks[static_cast<size_t>(c.rank)].host;
      Say("rank " + std::to_string(c.rank) + " (host " + (host.empty() ? "?" : host) + ") " +
          (c.slow ? "is a straggler" : "is no longer a straggler") + ": its step time is " +
          Seconds(c.step_s) + ", the other ranks' median " + Seconds(c.others_s));
      straggler_events.push_back({{"rank", c.rank},
                                  {"slow", c.slow},
                                  {"time", ctl.clock_.UnixSeconds()},
                                  {"step_time_s", c.step_s},
                                  {"median_step_time_s", c.others_s}});
    }
    // Callbacks learn of it from run.json (python/jaxtrain/callbacks.py).
    Status written = WriteRunState("RUNNING");
    if (!written.ok()) Say("cannot write run.json: " + written.message());
    RefreshStatus();
  }

  static std::string Seconds(double s) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.3g s", s);
    return buf;
  }

  // Copies the run's metrics where Controller::metrics() reads them.
  void Publish() {
    switch (phase) {
      case Phase::kStarting:
        metrics.state = attempt > first_attempt ? "RESTARTING" : "STARTING";
        break;
      case Phase::kRunning: metrics.state = "RUNNING"; break;
      case Phase::kStopping:
      case Phase::kDraining: metrics.state = "STOPPING"; break;
    }
    PublishAs(metrics.state);
  }

  void PublishAs(std::string state) {
    metrics.state = std::move(state);
    metrics.attempt = attempt;
    metrics.world_size = static_cast<int>(ranks.size());
    metrics.ranks_up = static_cast<int>(registered);
    metrics.rank_step_s.resize(ranks.size());
    for (size_t r = 0; r < ranks.size(); ++r) {
      metrics.rank_step_s[r] = stragglers.StepSeconds(static_cast<int>(r));
    }
    metrics.stragglers = stragglers.Stragglers();
    MutexLock lock(ctl.metrics_mu_);
    ctl.metrics_ = metrics;
  }

  void OnMessage(int rank, wire::CheckpointReport& m) {
    // Only this rank's own staging directory of this round may be moved from and deleted.
    const std::string expected =
        m.in_store ? "" : storage::StagingPath(store.dir(), attempt, m.round, rank);
    if (m.staging != expected) {
      return ProtocolError(rank, "rank " + std::to_string(rank) + "'s checkpoint of round " +
                                     std::to_string(m.round) + " names the staging directory '" +
                                     m.staging + "', not its own ('" + expected +
                                     "'); refused, nothing was moved or deleted");
    }
    CheckpointPart part{.staged = {.rank = rank,
                                   .staging_dir = std::move(m.staging),
                                   .files = std::move(m.files),
                                   .copy_id = std::move(m.copy_id),
                                   .in_store = m.in_store},
                        .dir_name = std::move(m.dir_name)};
    AddReport(rank, m.metrics_json, std::move(part));
  }

  void OnMessage(int rank, wire::WorkerError& m) {
    RankFailure failure{.rank = rank,
                        .cause = FailureCause::kException,
                        .message = std::move(m.message),
                        .traceback = std::move(m.traceback)};
    if (m.phase == wire::ErrorPhase::kStartUp) failure.cause = FailureCause::kStartUp;
    if (m.phase == wire::ErrorPhase::kStorage) {  // its upload to object storage failed
      failure.cause = FailureCause::kStorage;
      failure.status_code = m.status_code;
    }
    Fail(std::move(failure));
  }

  void OnMessage(int rank, const wire::Done& m) {
    ranks[static_cast<size_t>(rank)].done = true;
    if (rank == 0) RecordReturnValue(m.return_value);
    watchdog.Done(rank);
    Status unmatched = collectives.Done(rank);
    if (!unmatched.ok()) {
      return Fail(
          {.rank = rank, .cause = FailureCause::kException, .message = unmatched.message()});
    }
    // No round can complete without this rank any more: no commit can be ahead of another
    // rank's next checkpoint, so none of them waits for one (said once per attempt).
    if (checkpoints_released) return;
    checkpoints_released = true;
    for (size_t other = 0; other < ranks.size(); ++other) {
      if (!ranks[other].done) {
        port->Send(static_cast<int>(other), wire::MessageType::kCheckpointSettled, "release");
      }
    }
  }

  // --- preemption (preemption.h, docs/preemption.md) ------------------------------------------

  // `source`: the notice's, which an answer names (the worker matches it to its notice).
  void Reply(int rank, std::string_view kind, const std::string& source = "") {
    nlohmann::json reply = {{"kind", kind}};
    if (!source.empty()) reply["source"] = source;
    port->Send(rank, wire::MessageType::kPreemptionReply, reply.dump());
  }

  void OnMessage(int rank, const wire::Preemption& m) {
    if (m.source.empty()) {  // an answer to the query
      // The rank's report rounds of this attempt, as the run's round numbers.
      const uint64_t last_round = attempt_base_round - 1 + m.rounds;
      if (std::optional<std::string> agreed = preemption.Answer(rank, m.calls, last_round)) {
        for (size_t r = 0; r < ranks.size(); ++r) {
          port->Send(static_cast<int>(r), wire::MessageType::kPreemptionReply, *agreed);
        }
      }
      return;
    }
    // The group is being stopped (its SIGTERM is the stop's) or not training: the rank ends.
    if (phase != Phase::kRunning) return Reply(rank, "stop", m.source);
    const std::string& host = ranks[static_cast<size_t>(rank)].host;
    std::vector<int> host_ranks;
    for (size_t r = 0; r < ranks.size(); ++r) {
      if (ranks[r].host == host) host_ranks.push_back(static_cast<int>(r));
    }
    const auto now_ms = static_cast<uint64_t>(ctl.clock_.UnixSeconds() * 1000);
    Duration grace = opts.preemption_grace;
    if (m.deadline_ms != 0) {
      grace = std::min<Duration>(
          grace, std::chrono::milliseconds(m.deadline_ms > now_ms ? m.deadline_ms - now_ms : 0));
    }
    const uint64_t deadline_ms =
        now_ms +
        static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(grace).count());
    const bool opened =
        preemption.Notice(rank, host, std::move(host_ranks), m.source, Now() + grace, deadline_ms);
    Reply(rank, "noted", m.source);
    if (!opened) return;
    Say("preemption notice: " + preemption.Describe() + "; the group goes on until a checkpoint " +
        "reported after it is committed, for " +
        FormatNumber(std::chrono::duration<double>(grace).count()) + " s at most");
    for (size_t r = 0; r < ranks.size(); ++r) Reply(static_cast<int>(r), "query");
  }

  void StopForPreemption(const std::string& why, bool drain_timed_out) {
    Fail({.rank = preemption.first_rank(),
          .cause = FailureCause::kPreemption,
          .message = "preempted: " + preemption.Describe() + "; " + why,
          .preemption = nlohmann::json::parse(preemption.Info(drain_timed_out))});
  }

  // A collective call; once every rank has made it, each is released (with rank 0's data, one
  // buffer shared by every connection's queue).
  void OnMessage(int rank, const wire::Pong&) {
    if (!watchdog_ping) return;
    WatchdogPing& p = *watchdog_ping;
    auto at = std::find(p.ranks.begin(), p.ranks.end(), rank);
    if (at != p.ranks.end()) p.answered[static_cast<size_t>(at - p.ranks.begin())] = true;
    if (phase == Phase::kRunning) CheckProgress();  // decides once no answer is awaited
  }

  void OnMessage(int rank, const wire::Collective& m) {
    watchdog.Progress(rank);
    StatusOr<std::optional<Collectives::Release>> arrived = collectives.Arrive(rank, m, Now());
    if (arrived.status().code() == StatusCode::kInvalidArgument) {
      return ProtocolError(rank, arrived.status().message());
    }
    if (!arrived.ok()) {
      // A call made after a rank returned without it: that rank broke the sequence, not this one
      // (which only came to the call after it had returned).
      const int blamed = collectives.first_returned() >= 0 ? collectives.first_returned() : rank;
      return Fail({.rank = blamed,
                   .cause = FailureCause::kException,
                   .message = arrived.status().message()});
    }
    if (!*arrived) return;
    const Collectives::Release& r = **arrived;
    auto frame = std::make_shared<const std::string>(*wire::EncodeFrame(
        wire::MessageType::kCollectiveRelease,
        wire::EncodeCollectiveRelease({.sequence = r.sequence, .kind = r.kind, .data = r.data})));
    for (size_t other = 0; other < ranks.size(); ++other) {
      port->SendShared(static_cast<int>(other), {frame});
    }
  }

  // Rank 0's return value as the run directory's file, replacing an earlier attempt's or run's;
  // none removes it. A file that cannot be written fails the run as any record of it does.
  void RecordReturnValue(const std::optional<std::string>& value) {
    const std::string path = storage::JoinPath(store.dir(), kReturnValueFile);
    Status s = OkStatus();
    if (value) {
      s = storage::WriteFileAtomically(path, *value);
    } else if (unlink(path.c_str()) != 0 && errno != ENOENT) {
      s = storage::PathError("cannot remove", path, errno);
    }
    if (!s.ok()) Fail(StorageFailure(s, "rank 0's return value: " + s.message()));
  }

  void ProtocolError(int rank, const std::string& what) {
    Fail({.rank = rank, .cause = FailureCause::kConnection, .message = "protocol error: " + what});
    ranks[static_cast<size_t>(rank)].refused = true;
    port->Close(rank);
  }

  nlohmann::json CommittedNames() const {
    nlohmann::json names = nlohmann::json::array();
    for (const auto& r : recorder.records()) names.push_back(r.dir_name);
    return names;
  }

  void MaybeStartTraining() {
    if (phase != Phase::kStarting || registered < ranks.size()) return;
    if (ranks[0].coordinator.empty()) {
      Fail({.rank = 0,
            .cause = FailureCause::kStartUp,
            .message = "rank 0 did not publish a coordinator"});
      return;
    }
    phase = Phase::kRunning;
    attempt_ready_time = ctl.clock_.UnixSeconds();
    if (group_spawned) metrics.group_start.Add(SecondsSince(*group_spawned));
    if (failure_noticed) metrics.restart.Add(SecondsSince(*failure_noticed));
    group_spawned.reset();
    failure_noticed.reset();
    nlohmann::json start = {
        {"coordinator", ranks[0].coordinator},
        {"world_size", ranks.size()},
        {"attempt", attempt},
        {"run_dir", store.dir()},
        {"experiment_name", opts.experiment_name},
        {"checkpoint", restore_from.empty() ? nlohmann::json() : nlohmann::json(restore_from)},
        // This attempt's first report is this round (rounds continue across attempts), and these
        // checkpoints are committed: what ranks that write to object storage themselves need to
        // name a round's directory there and to sweep what an earlier attempt left.
        {"first_round", collector.next_round()},
        {"committed", CommittedNames()}};
    if (restore_checksums_skipped) start["checkpoint_checksums_skipped"] = true;
    // The start frame and the payload's header are the same for every rank: one buffer, shared
    // by every connection's queue like the payload (O(start), not O(ranks x start)).
    auto head = std::make_shared<const std::string>(
        *wire::EncodeFrame(wire::MessageType::kStart, start.dump()) + payload_header);
    for (size_t rank = 0; rank < ranks.size(); ++rank) {
      port->SendShared(static_cast<int>(rank), {head, payload});
    }
    // The group is ready: the next attempt's processes can start ahead (standby workers), at
    // low priority, so that a restart or a later fit() finds them past import jax.
    Status prepared = ctl.launcher_->PrepareNext(specs);
    if (!prepared.ok()) Say("warning: " + prepared.message() + "; a restart starts afresh");
    for (const std::string& note : ctl.launcher_->TakeNotes()) Say(note);
  }

  // --- rounds (round_recorder.h) ---------------------------------------------------------

  void OnRecorded(const Round& round, const std::string& committed) override {
    rounds = round.round;
    last_metrics = round.metrics_json;
    if (!committed.empty() && phase == Phase::kRunning && preemption.AfterNotice(round.round)) {
      StopForPreemption(
          "the group was stopped once " + committed + ", reported after the notice, was committed",
          /*drain_timed_out=*/false);
    }
    if (attempt_rounds++ == 0) attempt_first_round = Now();
    ++metrics.rounds;
    metrics.last_round = round.round;
    if (!committed.empty()) {
      const RoundRecorder::CommitStats& commit = recorder.last_commit();
      metrics.checkpoint_commit.Add(std::chrono::duration<double>(commit.took).count());
      metrics.checkpoint_bytes += commit.bytes;
      metrics.last_checkpoint_bytes = commit.bytes;
    }
    RefreshStatus();
    Publish();
  }

  double SecondsSince(TimePoint t) const {
    return std::chrono::duration<double>(Now() - t).count();
  }

  // The rank's next report(checkpoint=) may go on (WorkerClient::WaitCheckpointsSettled()).
  // A rank that reported a checkpoint after an agreed preemption waits for it to settle (the
  // just-in-time checkpoint): its commit stops the group instead, so no step goes on past it.
  void OnSettled(int rank, uint64_t round) override {
    if (phase == Phase::kRunning && preemption.AfterNotice(round)) return;
    port->Send(rank, wire::MessageType::kCheckpointSettled, "settled");
  }

  // Fail() names the host of a rank's failure; one of the run directory's is this host's.
  void OnFailed(RoundFailure f) override {
    Fail({.rank = f.rank,
          .host = f.rank < 0 ? HostName() : "",
          .cause = f.cause,
          .status_code = f.code,
          .message = std::move(f.message)});
  }

  // --- processes -----------------------------------------------------------------------------

  void OnLog(int rank, std::string_view text) override { WriteLog(rank, text); }
  void OnConsole(std::string text) override { ToConsole(std::move(text)); }

  // A process has exited: a failure unless its rank had returned (or the group is being stopped).
  void OnExit(const std::vector<int>& proc_ranks, const launch::ExitStatus& exit,
              const RankOutput& output) override {
    if (proc_ranks.size() > 1) return OnStepExit(proc_ranks, exit, output);
    const int rank = proc_ranks.front();
    RankState& r = ranks[static_cast<size_t>(rank)];
    // A frame sent just before exit may still be unread: read it first.
    port->Read(rank);
    const bool stopping = phase == Phase::kStopping || phase == Phase::kDraining;
    const bool oom = exit.signal == SIGKILL && !sent_sigkill && OomKillCount() > oom_kills_before;
    RankFailure exit_failure{
        .rank = rank,
        .cause = oom           ? FailureCause::kOom
                 : exit.signal ? FailureCause::kSignal
                               : FailureCause::kExit,
        .exit_code = exit.exit_code,
        .signal = exit.signal,
        .message = std::string("its process ") + (exit.signal ? "was " : "") + exit.ToString() +
                   (exit.ok() ? " before its training function returned" : "") +
                   (oom ? " by the kernel's out-of-memory killer" : "")};
    // The connection usually closes just before the exit is seen; the exit says more, unless the
    // process died of the signal the controller sent to stop the group.
    // A rank that ends before it has registered could not start: a start-up failure, with its
    // own budget. Among them a worker that could not get through a flood of its control port.
    if (phase == Phase::kStarting && !r.registered) {
      exit_failure.cause = FailureCause::kStartUp;
      exit_failure.message += FloodNote();
    }
    const bool our_signal =
        (exit.signal == SIGTERM && sent_sigterm) || (exit.signal == SIGKILL && sent_sigkill);
    // Not when the controller closed the connection itself: the exit (the worker's "controller
    // lost") is then the protocol error's consequence.
    if (failure && failure->rank == rank && failure->cause == FailureCause::kConnection &&
        !our_signal && !r.refused) {
      failure->cause = exit_failure.cause;
      failure->exit_code = exit_failure.exit_code;
      failure->signal = exit_failure.signal;
      failure->message = exit_failure.message;
    }
    if (failure && failure->rank != rank && exit.signal == SIGKILL && !sent_sigkill &&
        IsPeerNotice(failure->cause)) {
      return Reblame(std::move(exit_failure));
    }
    if (stopping || (exit.ok() && r.done)) return;
    Fail(std::move(exit_failure));
  }

  // A SIGKILL the controller did not send comes from outside (the kernel's out-of-memory killer,
  // an operator, a reclaimed machine): it is the attempt's cause, over an error or exit of
  // another rank seen first, which is most often a peer noticing the loss in a collective (and
  // may be read first: connections are handled before processes in one turn of the loop).
  static bool IsPeerNotice(FailureCause cause) {
    return cause == FailureCause::kException || cause == FailureCause::kExit ||
           cause == FailureCause::kConnection;
  }
  void Reblame(RankFailure killed) {
    const std::string first = failure->message.substr(0, failure->message.find('\n'));
    killed.message += "; rank " + std::to_string(failure->rank) + " failed meanwhile: " + first;
    failure.reset();
    Fail(std::move(killed));
  }

  // The process that ran several ranks (srun) has ended. How each rank ended is known from srun's
  // own lines ("task 1: Killed") when it said; the first rank that failed is blamed.
  void OnStepExit(const std::vector<int>& proc_ranks, const launch::ExitStatus& exit,
                  const RankOutput& output) {
    for (int rank : proc_ranks) port->Read(rank);
    auto ours = [this](const launch::ExitStatus& e) {
      return (e.signal == SIGTERM && sent_sigterm) || (e.signal == SIGKILL && sent_sigkill);
    };
    // The task that failed first is blamed: of those whose connections closed, the one whose
    // close was seen in the earliest turn of the loop; among those closing in one turn, the
    // first that srun reports. srun's order alone is no witness: it may report the SIGKILLs of
    // the rest of the step (--kill-on-bad-exit, or srun's answer to the stop's SIGTERM) before
    // the failure that caused them, as the messages of several nodes race.
    auto closed = [this](int rank) {
      const uint64_t t = ranks[static_cast<size_t>(rank)].closed_turn;
      return t == 0 ? UINT64_MAX : t;
    };
    const std::pair<int, launch::TaskEnd>* first = nullptr;
    for (const auto& task : output.task_ends()) {
      if (task.second.exit.ok() || ours(task.second.exit)) continue;
      if (!first || closed(task.first) < closed(first->first)) first = &task;
    }
    auto blame_first = [&](RankFailure& f) {
      const launch::TaskEnd& end = first->second;
      f.rank = first->first;
      f.host = end.node;
      f.log_path = store.LogPath(f.rank);
      f.cause = end.exit.signal ? FailureCause::kSignal : FailureCause::kExit;
      f.exit_code = end.exit.exit_code;
      f.signal = end.exit.signal;
      f.message = std::string("its process ") + (end.exit.signal ? "was " : "") +
                  end.exit.ToString() + " on " + end.node;
    };
    // A connection that closed first is explained by its own task's end, not by a later one's
    // (a node lost at once: its tasks unreported, the others killed when the step is cancelled).
    if (failure && failure->cause == FailureCause::kConnection) {
      if (first && closed(first->first) <= closed(failure->rank)) {
        blame_first(*failure);
      } else if (!output.launcher_error().empty()) {
        failure->message += " (" + output.launcher_error() + ")";
      }
    }
    const bool stopping = phase == Phase::kStopping || phase == Phase::kDraining;
    const auto not_done = std::find_if(proc_ranks.begin(), proc_ranks.end(), [this](int r) {
      return !ranks[static_cast<size_t>(r)].done;
    });
    if (stopping || (exit.ok() && not_done == proc_ranks.end())) return;
    RankFailure f;
    if (first) {
      blame_first(f);
    } else {
      f = {.rank = not_done != proc_ranks.end() ? *not_done : proc_ranks.front(),
           .cause = exit.signal ? FailureCause::kSignal : FailureCause::kExit,
           .exit_code = exit.exit_code,
           .signal = exit.signal,
           .message = "its job step ended (" + exit.ToString() +
                      ") before its training function returned" +
                      (output.launcher_error().empty() ? "" : ": " + output.launcher_error())};
    }
    // A step that ends before its ranks have registered could not start (srun refused it).
    if (phase == Phase::kStarting) f.cause = FailureCause::kStartUp;
    Fail(std::move(f));
  }

  // --- the loop ------------------------------------------------------------------------------

  // `rs` with their hosts, grouped by host in order: "0, 1 on host1; 2 on host2".
  std::string RanksOn(const std::vector<int>& rs) const {
    std::vector<std::pair<std::string, std::string>> by_host;  // host, its ranks
    for (int r : rs) {
      std::string host = ranks[static_cast<size_t>(r)].host;
      if (host.empty()) host = opts.plan.workers[static_cast<size_t>(r)].host;
      auto at = std::find_if(by_host.begin(), by_host.end(),
                             [&](const auto& h) { return h.first == host; });
      if (at == by_host.end()) at = by_host.insert(by_host.end(), {host, ""});
      at->second += (at->second.empty() ? "" : ", ") + std::to_string(r);
    }
    std::string out;
    for (const auto& [host, names] : by_host) {
      out += (out.empty() ? "" : "; ") + names + (host.empty() ? "" : " on " + host);
    }
    return out;
  }

  // The progress watchdog (watchdog.h): every stale rank is named with its host. A stale rank is
  // pinged first (ranks waiting in a collective for a stuck one stall with it): those that do not
  // answer within kWatchdogPingWait (stopped, frozen, cut off) are blamed, else the one stale
  // longest. A rank found stale while others' answers are awaited is pinged too.
  void CheckProgress() {
    std::optional<Watchdog::Stale> stale = watchdog.Check();
    if (!stale) {
      watchdog_ping.reset();
      return;
    }
    if (!watchdog_ping) watchdog_ping.emplace();
    WatchdogPing& ping = *watchdog_ping;
    const TimePoint now = Now();
    for (int r : stale->ranks) {
      if (std::find(ping.ranks.begin(), ping.ranks.end(), r) != ping.ranks.end()) continue;
      ping.ranks.push_back(r);
      ping.answered.push_back(false);
      ping.deadline = now + kWatchdogPingWait;
      if (port->connected(r)) port->Send(r, wire::MessageType::kPing, "");
    }
    std::vector<int> silent, answered;
    for (size_t i = 0; i < ping.ranks.size(); ++i) {
      (ping.answered[i] ? answered : silent).push_back(ping.ranks[i]);
    }
    if (!silent.empty() && now < ping.deadline) return;  // answers may yet come
    std::sort(silent.begin(), silent.end());
    std::sort(answered.begin(), answered.end());
    std::string message =
        "no report() for " +
        FormatNumber(std::chrono::duration<double>(opts.progress_timeout).count()) +
        " s (the progress watchdog's limit) from rank(s) " + RanksOn(stale->ranks);
    int blamed = stale->blamed;
    if (silent.empty()) {
      message += ", alive but stuck";
    } else {
      if (std::find(silent.begin(), silent.end(), blamed) == silent.end()) blamed = silent.front();
      message += "; rank(s) " + RanksOn(silent) + " did not answer a ping within " +
                 FormatNumber(std::chrono::duration<double>(kWatchdogPingWait).count()) +
                 " s: stopped (SIGSTOP), frozen or cut off";
      if (!answered.empty()) message += "; rank(s) " + RanksOn(answered) + " answered";
    }
    watchdog_ping.reset();
    Fail({.rank = blamed, .cause = FailureCause::kWatchdog, .message = std::move(message)});
  }

  void CheckTimers() {
    TimePoint now = Now();
    port->ExpireHandshakes();
    if (phase == Phase::kStarting && now >= start_deadline) {
      int missing = 0;
      while (missing < static_cast<int>(ranks.size()) && ranks[missing].registered) ++missing;
      Fail({.rank = missing,
            .cause = FailureCause::kStartUp,
            .message =
                "it did not connect to the controller within the start-up timeout" + FloodNote()});
    }
    if (phase == Phase::kRunning) {
      CheckProgress();
      std::string waiting = collectives.TakeWarning(now);
      if (!waiting.empty()) Say("warning: " + waiting);
    }
    if (phase == Phase::kRunning && preemption.open() && now >= preemption.deadline()) {
      StopForPreemption(
          "its deadline passed before a checkpoint reported after the notice was committed",
          /*drain_timed_out=*/true);
    }
    if (kill_deadline && now >= *kill_deadline) {
      kill_deadline.reset();
      if (AnyUnreaped()) {
        Say("workers did not stop within the grace period; sending SIGKILL");
        sent_sigkill = true;
        Signal(SIGKILL);
      }
    }
  }

  std::optional<TimePoint> NextDeadline() {
    std::optional<TimePoint> next;
    auto consider = [&](TimePoint t) { next = next ? std::min(*next, t) : t; };
    if (auto t = port->NextDeadline()) consider(*t);
    if (phase == Phase::kStarting) consider(start_deadline);
    if (phase == Phase::kRunning) {
      if (auto t = watchdog.NextDeadline()) consider(*t);
      if (watchdog_ping) consider(watchdog_ping->deadline);
      if (preemption.open()) consider(preemption.deadline());
      if (auto t = collectives.NextWarning()) consider(*t);
    }
    if (kill_deadline) consider(*kill_deadline);
    // Past it, only a commit in flight holds the attempt open: its descriptor wakes the loop.
    if (drain_deadline && !(recorder.busy() && Now() >= *drain_deadline)) {
      consider(*drain_deadline);
    }
    return next;
  }

  bool OutputsOpen() const { return group->outputs_open() > 0; }

  // True once the attempt is over: every process reaped and its output drained.
  // True when Abort() was called since the last look; the run is then marked aborted, with
  // Abort()'s reason, unless `counts` is false (a failure or a drain already ends the attempt).
  bool TakeAbortRequest(bool counts) {
    if (!ctl.abort_requested_.exchange(false)) return false;
    std::lock_guard<std::mutex> lock(ctl.mu_);
    if (counts && !aborted) {
      aborted = true;
      abort_reason = ctl.abort_reason_;
      Say("stopping the run: " + abort_reason);
    }
    return true;
  }

  // Resets the wake-up eventfd once poll() has found it readable.
  void DrainWake() {
    uint64_t v;
    [[maybe_unused]] ssize_t n = read(ctl.wake_fd_, &v, sizeof(v));
  }

  bool Step() {
    ++turn;
    if (TakeAbortRequest(/*counts=*/!failure && phase != Phase::kDraining)) BeginStop();
    if (!AnyUnreaped()) {
      if (!drain_deadline) drain_deadline = Now() + kDrainTime;
      phase = Phase::kDraining;
      // An attempt ends only once its commit in flight has ended and its round is recorded.
      if ((!OutputsOpen() || Now() >= *drain_deadline) && !recorder.busy()) return true;
    }

    // Connections before the listener: a hello that has arrived is handled before new
    // connections can push its connection out (Accept()). Connections before processes: a
    // worker's last frames are handled before its exit.
    // A descriptor of -1 (a port without a listener, a clock that moves by itself) is ignored.
    pollfd fds[] = {{ctl.wake_fd_, POLLIN, 0},        {port->ready_fd(), POLLIN, 0},
                    {recorder.ready_fd(), POLLIN, 0}, {port->listen_fd(), POLLIN, 0},
                    {group->ready_fd(), POLLIN, 0},   {ctl.clock_.wake_fd(), POLLIN, 0}};
    if (poll(fds, std::size(fds), PollTimeoutMs(ctl.clock_, NextDeadline())) > 0) {
      if (fds[0].revents != 0) DrainWake();
      if (fds[1].revents != 0) port->OnConnsReady();
      if (fds[2].revents != 0) recorder.OnCommitReady();
      if (fds[3].revents != 0) port->Accept();
      if (fds[4].revents != 0) group->OnReady();
      if (fds[5].revents != 0) ClearWake(ctl.clock_);
    }
    CheckTimers();
    port->Sweep();
    return false;
  }

  // --- attempts ------------------------------------------------------------------------------

  // The checkpoint the first attempt restores from (RestoreVerifier), chosen on the thread that
  // calls Start(), before the loop runs.
  std::string CheckpointToRestore() {
    return Chosen(RestoreVerifier::Choose(store.dir(), recorder.records(), opts.verify_checksums));
  }

  // The directory `chosen` names, its warnings said.
  std::string Chosen(const RestoreVerifier::Result& chosen) {
    for (const auto& w : chosen.warnings) Say("warning: " + w);
    restore_checksums_skipped = chosen.checksums_skipped;
    return chosen.dir;
  }

  // The checkpoint a restart restores from, verified on the verifier's thread while the loop
  // keeps honouring Abort() (no worker is alive and no commit in flight by then); nullopt when
  // the run was aborted meanwhile, the verification cancelled.
  std::optional<std::string> CheckpointToRestoreServingAbort() {
    Status started =
        verifier->Start(store.dir(), recorder.records(), opts.verify_checksums, opts.memory_store);
    if (!started.ok()) return CheckpointToRestore();
    for (;;) {
      pollfd fds[] = {{ctl.wake_fd_, POLLIN, 0}, {verifier->ready_fd(), POLLIN, 0}};
      if (poll(fds, std::size(fds), -1) > 0 && fds[0].revents != 0) DrainWake();
      if (TakeAbortRequest(/*counts=*/true)) verifier->Cancel();
      if (std::optional<RestoreVerifier::Result> chosen = verifier->TakeResult()) {
        if (chosen->cancelled) return std::nullopt;
        return Chosen(*chosen);
      }
    }
  }

  // Starts the worker group of the next attempt, restoring from `restore` ("" for none). Errors:
  // as Launcher::Launch().
  Status StartAttempt(std::string restore) {
    const int world_size = static_cast<int>(ranks.size());
    ranks.assign(ranks.size(), RankState{});
    registered = 0;
    watchdog = Watchdog(ctl.clock_, world_size, opts.progress_timeout);
    watchdog_ping.reset();
    preemption = PreemptionNotice(world_size);
    port->BeginAttempt(attempt, ranks.size());
    failure.reset();
    kill_deadline.reset();
    drain_deadline.reset();
    sent_sigterm = false;
    sent_sigkill = false;
    oom_kills_before = OomKillCount();
    collector = ReportCollector(world_size, collector.next_round());
    attempt_base_round = collector.next_round();
    collectives = Collectives(world_size);
    checkpoints_released = false;
    attempt_rounds = 0;
    attempt_first_round.reset();
    stragglers = StragglerDetector(world_size);
    straggler_events = nlohmann::json::array();
    ++metrics.attempts_by_cause[attempt == first_attempt || failures.empty()
                                    ? "start"
                                    : std::string(FailureCauseName(failures.back().cause))];
    JT_RETURN_IF_ERROR(SweepStaging());
    restore_from = std::move(restore);
    attempt_start_time = ctl.clock_.UnixSeconds();
    attempt_ready_time = 0;
    failure_time = 0;
    if (attempt > first_attempt) {
      Say("restarting the worker group: attempt " + std::to_string(attempt) +
          (restore_from.empty() ? ", from the start" : ", from checkpoint " + restore_from));
    }
    logs.BeginAttempt(attempt);  // each log gets the attempt's header before its first output
    (*shared_env)["JAXTRAIN_ATTEMPT"] = std::to_string(attempt);
    // An attempt that run.json does not show must not run: its rounds would be lost with it.
    JT_RETURN_IF_ERROR(WriteRunState("RUNNING"));
    group_spawned = Now();
    PublishAs(attempt > first_attempt ? "RESTARTING" : "STARTING");
    Status started = group->Start(specs);
    for (const std::string& note : ctl.launcher_->TakeNotes()) Say(note);
    JT_RETURN_IF_ERROR(started);
    // The descriptors left beside a connection per rank and the processes' pidfds and pipes are
    // the logs' to keep open; the others are opened again when written to.
    rlimit files{};
    getrlimit(RLIMIT_NOFILE, &files);
    const uint64_t taken = ranks.size() + 2 * group->size() + kSpareFiles;
    logs.set_max_open(files.rlim_cur > taken + kMinOpenLogs ? files.rlim_cur - taken
                                                            : kMinOpenLogs);
    phase = Phase::kStarting;
    start_deadline = Now() + opts.start_timeout;
    RefreshStatus();
    return OkStatus();
  }

  nlohmann::json AttemptState(std::string_view status) const {
    nlohmann::json a = {
        {"attempt", attempt},
        {"start_time", attempt_start_time},
        {"status", status},
        {"restored_from", restore_from.empty() ? nlohmann::json() : nlohmann::json(restore_from)}};
    // The times python/jaxtrain/goodput.py splits the attempt by (docs/observability.md).
    if (attempt_ready_time > 0) a["ready_time"] = attempt_ready_time;
    // Each rank's host: where it registered from, else where the plan put it.
    nlohmann::json hosts = nlohmann::json::array();
    for (size_t r = 0; r < ranks.size(); ++r) {
      hosts.push_back(!ranks[r].host.empty()         ? ranks[r].host
                      : r < opts.plan.workers.size() ? opts.plan.workers[r].host
                                                     : std::string());
    }
    a["hosts"] = std::move(hosts);
    // Each rank's step time (stragglers.h), null until it is known; refreshed while the attempt
    // runs at most every kStepTimesRefresh (AddReport()).
    nlohmann::json step_times = nlohmann::json::array();
    for (size_t r = 0; r < ranks.size(); ++r) {
      std::optional<double> s = stragglers.StepSeconds(static_cast<int>(r));
      step_times.push_back(s ? nlohmann::json(*s) : nlohmann::json());
    }
    a["step_time_s"] = std::move(step_times);
    if (status != "RUNNING") a["end_time"] = ctl.clock_.UnixSeconds();
    if (failure) {
      a["failure"] = FailureState(*failure);
      a["failure"]["time"] = failure_time;
    }
    if (!straggler_events.empty()) a["stragglers"] = straggler_events;
    return a;
  }

  // run.json's record of a failure: the cause's name and the fields that apply to it.
  static nlohmann::json FailureState(const RankFailure& f) {
    nlohmann::json j = {{"rank", f.rank},
                        {"host", f.host},
                        {"cause", FailureCauseName(f.cause)},
                        {"message", f.message},
                        {"exit_code", f.exit_code >= 0 ? nlohmann::json(f.exit_code) : nullptr},
                        {"signal", f.signal != 0 ? nlohmann::json(f.signal) : nullptr}};
    if (f.status_code != StatusCode::kOk) j["status_code"] = StatusCodeName(f.status_code);
    if (!f.preemption.is_null()) j["preemption"] = f.preemption;
    if (!f.decision.empty()) {
      j["decision"] = {{"action", f.retried ? "retry" : "raise"}, {"reason", f.decision}};
    }
    return j;
  }

  // Ends the attempt whose processes are all reaped; true when a new attempt has started.
  bool EndAttempt() {
    group->CloseOutputs();
    // The failed rank's log exists now, with this attempt's header, even if it printed nothing:
    // its tail goes into the failure. The other silent ranks' headers wait for their next text
    // or the end of the run (rank_logs.h): a restart creates no file per silent rank.
    if (failure && failure->rank >= 0) WriteLog(failure->rank, "");
    if (!failure && !aborted) {
      for (Round& r : collector.TakeUnmatchedRank0()) recorder.Add(std::move(r));
      std::string mismatch = collector.CountMismatchWarning();
      if (!mismatch.empty()) {
        Say("warning: " + mismatch);
        warnings.push_back(mismatch);
      }
    }
    std::string_view status = failure ? "ERRORED" : aborted ? "ABORTED" : "FINISHED";
    if (failure && !aborted) {
      FailureDecision d = policy.Decide(failure->cause, failure->status_code);
      failure->retried = d.retry();
      failure->decision = std::move(d.reason);
    }
    attempt_log.push_back(AttemptState(status));
    if (!failure || aborted) return false;
    // Said now rather than when first noticed: by now the exit status has refined the cause.
    Say("attempt " + std::to_string(attempt) + " failed: " +
        (failure->rank >= 0 ? "rank " + std::to_string(failure->rank) : "the driver") + " (host " +
        (failure->host.empty() ? "?" : failure->host) + "): " + failure->message);
    failure->log_tail = storage::TailOfFile(failure->log_path, kLogTailBytes);
    failures.push_back(*failure);
    if (!failure->retried) {
      Say("not restarting: " + failure->decision);
      return false;
    }
    std::optional<std::string> restore = CheckpointToRestoreServingAbort();
    if (!restore) return false;
    ++attempt;
    Status s = StartAttempt(std::move(*restore));
    if (!s.ok() && TakeAbortRequest(/*counts=*/true)) {
      // Stopped while the group started (Abort() interrupts the launcher): the run is aborted,
      // not failed, and this attempt never ran.
      attempt_log.push_back(AttemptState("ABORTED"));
      return false;
    }
    if (!s.ok()) {
      Say("cannot restart the worker group: " + s.message());
      failures.push_back({.rank = -1,
                          .attempt = attempt,
                          .cause = FailureCause::kStartUp,
                          .message = "the worker group could not be started: " + s.message()});
      attempt_log.push_back(AttemptState("ERRORED"));
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
    // Standby workers serve a later fit() of the same processes, but not past an abort.
    ctl.launcher_->EndRun(/*keep=*/!aborted);
    Status swept = SweepStaging();
    if (!swept.ok()) Say("cannot clean up: " + swept.message());
    WarnLogs(logs.HeadAll());  // every log numbers every attempt (rank_logs.h)
    logs.CloseAll();
    port.reset();  // every connection closed, and the listener

    Outcome out;
    out.attempts = attempt - first_attempt + 1;
    out.failures = failures;
    out.warnings = warnings;
    if (aborted) {
      out.state = Outcome::State::kAborted;
      out.abort_reason = abort_reason;
    } else if (!failures.empty() && (failure || failures.back().rank < 0)) {
      out.state = Outcome::State::kFailed;
      out.failure = failures.front();
      std::string text;
      for (const auto& f : failures) {
        text += "attempt " + std::to_string(f.attempt) + ": rank " + std::to_string(f.rank) +
                " (host " + f.host + "), " + std::string(FailureCauseName(f.cause)) + ": " +
                f.message + "\n";
      }
      const RankFailure& first = failures.front();
      if (!first.traceback.empty()) text += "\n" + first.traceback;
      if (!first.log_path.empty()) {
        text += "\n--- last lines of " + first.log_path + " ---\n" + first.log_tail;
      }
      Status s = store.WriteError(text);
      if (!s.ok()) Say("cannot write error.txt: " + s.message());
    } else {
      out.state = Outcome::State::kSucceeded;
    }
    out.rounds = rounds;
    out.last_metrics_json = last_metrics;
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
        f.attempt = attempt;
        out.failures.push_back(f);
        out.failure = f;
        out.state = Outcome::State::kFailed;
      }
    }
    PublishAs(std::string(OutcomeStateName(out.state)));
    store.Unlock();  // the run is over: another driver may resume it
    return out;
  }

  // Attempts of an earlier driver of this run that run.json shows as RUNNING: that driver ended
  // (it was killed, or its machine went down) without recording how; they are marked CRASHED.
  void MarkCrashedAttempts() {
    for (auto& a : attempt_log) {
      if (!a.is_object() || a.value("status", "") != "RUNNING") continue;
      const std::string& who = store.previous_holder();
      a["status"] = "CRASHED";
      a["failure"] = {{"rank", -1},
                      {"host", ""},
                      {"cause", FailureCauseName(FailureCause::kDriver)},
                      {"message", "its driver (" + (who.empty() ? "unknown" : who) +
                                      ") ended without recording how the attempt ended"}};
    }
  }

  Status WriteRunState(std::string_view status) {
    state_written = Now();
    nlohmann::json attempts = attempt_log;
    if (status == "RUNNING") attempts.push_back(AttemptState(status));
    nlohmann::json state = {{"name", opts.experiment_name},
                            {"status", status},
                            {"world_size", ranks.size()},
                            {"platform", opts.plan.platform},
                            {"simulated", opts.plan.simulated},
                            {"start_time", start_time},
                            {"queue_wait_s", opts.queue_wait_s},
                            {"rounds", rounds},
                            {"attempts", attempts},
                            {"config", opts.run_config}};
    if (status != "RUNNING") state["end_time"] = ctl.clock_.UnixSeconds();
    return store.WriteRunState(state);
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
  nlohmann::json previous = loop->store.PreviousRunState();
  if (previous.is_object() && previous.contains("attempts") && previous["attempts"].is_array()) {
    loop->attempt_log = previous["attempts"];
    loop->first_attempt = static_cast<int>(previous["attempts"].size());
    loop->attempt = loop->first_attempt;
    loop->MarkCrashedAttempts();
  }
  loop->rounds = loop->collector.next_round() - 1;
  const std::string secret = wire::GenerateSecret();  // the port checks hellos against it
  JT_ASSIGN_OR_RETURN(loop->port, seams_.open_port(secret, *loop, &port_));
  // The payload's size was checked above: its header always encodes.
  loop->payload_header =
      *wire::EncodeFrameHeader(wire::MessageType::kPayload, options_.payload.size());
  // options_ outlives the loop: the payload is shared without a copy (an owner-less alias).
  loop->payload = std::shared_ptr<const std::string>(std::shared_ptr<void>(), &options_.payload);
  loop->ranks.resize(static_cast<size_t>(world_size));
  loop->start_time = clock_.UnixSeconds();

  WorkerSpecs built = BuildWorkerSpecs(
      options_.plan, {.argv = options_.worker_argv,
                      .cwd = options_.worker_cwd,
                      .env = options_.worker_env,
                      .controller_address = wire::HostPort{options_.listen_host, port_}.ToString(),
                      .run_dir = loop->store.dir(),
                      .experiment_name = options_.experiment_name,
                      .secret_hex = wire::ToHex(secret)});
  loop->specs = std::move(built.specs);
  loop->shared_env = std::move(built.shared_env);
  Status started = loop->StartAttempt(loop->CheckpointToRestore());
  if (!started.ok()) {
    // run.json may already say RUNNING; it must say how the run ended instead.
    loop->failure =
        RankFailure{.rank = -1,
                    .host = HostName(),
                    .cause = FailureCause::kStartUp,
                    .message = "the worker group could not be started: " + started.message()};
    loop->attempt_log.push_back(loop->AttemptState("ERRORED"));
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
  loop_->ClearStatus();
  Outcome out = loop_->Finish();
  // What the workers printed is shown before fit() returns, unless the console stopped reading.
  if (!loop_->console.Flush(kConsoleFlushTimeout)) {
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
