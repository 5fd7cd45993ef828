#include "controller/attempt.h"

#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "base/strings.h"
#include "controller/rank_stacks.h"
#include "controller/run_record.h"
#include "storage/checkpoint.h"
#include "storage/files.h"
#include "wire/frame.h"

namespace jaxtrain::controller {
namespace {

// How long a rank that the progress watchdog finds stale has to answer its ping.
constexpr Duration kWatchdogPingWait = std::chrono::seconds(2);
// How long the output of a group whose every process is reaped is read before the attempt ends.
constexpr Duration kDrainTime = std::chrono::seconds(1);

// How many processes the kernel's out-of-memory killer has killed since boot. A SIGKILL that the
// controller did not send, while this count rose, is most likely the OOM killer's.
uint64_t OomKillCount() {
  auto text = storage::ReadFile("/proc/vmstat");
  if (!text.ok()) return 0;
  size_t at = text->find("\noom_kill ");
  return at == std::string::npos ? 0 : std::strtoull(text->c_str() + at + 10, nullptr, 10);
}

std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3g s", s);
  return buf;
}

// A SIGKILL the controller did not send comes from outside (the kernel's out-of-memory killer,
// an operator, a reclaimed machine): it is the attempt's cause, over an error or exit of
// another rank seen first, which is most often a peer noticing the loss in a collective (and
// may be read first: connections are handled before processes in one turn of the loop).
bool IsPeerNotice(FailureCause cause) {
  return cause == FailureCause::kException || cause == FailureCause::kExit ||
         cause == FailureCause::kConnection;
}

}  // namespace

Attempt::Attempt(Setup setup, const ControllerOptions& opts, ControlPort& port, WorkerGroup& group,
                 const Clock& clock, Delegate& delegate)
    : setup_(std::move(setup)),
      opts_(opts),
      port_(port),
      group_(group),
      clock_(clock),
      delegate_(delegate),
      ranks_(plan().workers.size()),
      start_time_(clock.UnixSeconds()),
      oom_kills_before_(OomKillCount()),
      collector_(world_size(), setup_.first_round),
      collectives_(world_size()),
      preemption_(world_size()),
      watchdog_(opts.progress_timeout > Duration::zero() || !opts.progress_auto
                    ? Watchdog(clock, world_size(), opts.progress_timeout)
                    : Watchdog(clock, world_size(), *opts.progress_auto)),
      stragglers_(world_size()) {
  port_.BeginAttempt(setup_.number, ranks_.size());
}

Status Attempt::Start(const std::vector<launch::ProcessSpec>& specs) {
  started_ = Now();
  JT_RETURN_IF_ERROR(group_.Start(specs));
  phase_ = Phase::kStarting;
  start_deadline_ = Now() + opts_.start_timeout;
  return OkStatus();
}

// --- failures and stopping ---------------------------------------------------------------------

void Attempt::Fail(RankFailure f) {
  // A rank lost while its host is being preempted went with the host (or noticed a peer that
  // did): the preemption's, not the run's failure budget.
  if (!failure_ && preemption_.open() && IsTrainingFailure(f.cause)) {
    f.message = "during the preemption notice of " + preemption_.Describe() + ": " + f.message;
    f.cause = FailureCause::kPreemption;
    f.preemption = nlohmann::json::parse(preemption_.Info(/*drain_timed_out=*/false));
  }
  const bool first = !failed_at_;
  const int rank = f.rank;
  const FailureCause cause = f.cause;
  if (!failure_) {
    if (failure_time_ == 0) failure_time_ = clock_.UnixSeconds();  // kept by Reblame()
    f.attempt = setup_.number;
    if (f.rank >= 0) {
      if (!ranks_[static_cast<size_t>(f.rank)].host.empty()) {
        f.host = ranks_[static_cast<size_t>(f.rank)].host;
      } else if (f.host.empty() && static_cast<size_t>(f.rank) < plan().workers.size()) {
        f.host = plan().workers[static_cast<size_t>(f.rank)].host;  // it never registered
      }
      f.log_path = setup_.log_path(f.rank);
    }
    failure_ = std::move(f);
    if (!failed_at_) failed_at_ = Now();
  }
  // While the failed rank's rounds are being completed, its own exit and closed connection are
  // expected; any other rank's failure stops the group at once.
  if (FinishingRounds() && rank == owed_->rank) return;
  if (first && AwaitRoundsOf(rank, cause)) return;
  Stop();
}

// A round that every rank has reported is recorded, and its checkpoint committed, even when a
// rank fails right after (DESIGN.md §6): its last reports may still be on their way from the
// others, whose report() returns before its checkpoint is staged and sent (session.report), and
// whose next report(checkpoint=) waits for the commit ahead of it. True when the group goes on
// until the rounds the failed rank reported are complete (owed_); false when nothing is owed, or
// when a rank that has not reported them can no longer do so (it returned, its connection is
// gone), or when the failure leaves nothing to wait for (not a training failure, a stuck group).
bool Attempt::AwaitRoundsOf(int failed, FailureCause cause) {
  if (phase_ != Phase::kRunning || failed < 0 || !IsTrainingFailure(cause) ||
      cause == FailureCause::kWatchdog) {
    return false;
  }
  const uint64_t reports = collector_.reports(failed);
  if (collector_.complete() >= reports) return false;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    const int other = static_cast<int>(r);
    if (other == failed || collector_.reports(other) >= reports) continue;
    if (ranks_[r].done || !port_.connected(other)) return false;
  }
  owed_ = OwedRounds{
      .rank = failed, .reports = reports, .deadline = Now() + opts_.finish_rounds_timeout};
  return true;
}

// The rounds owed are complete (their commits go on while the group stops: the attempt ends
// only once they have ended), or can no longer be.
void Attempt::StopIfRoundsFinished() {
  if (!FinishingRounds()) return;
  bool possible = true;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    if (ranks_[r].done && collector_.reports(static_cast<int>(r)) < owed_->reports) {
      possible = false;
    }
  }
  if (collector_.complete() >= owed_->reports || !possible) Stop();
}

void Attempt::Stop() {
  if (Stopping()) return;
  phase_ = Phase::kStopping;
  delegate_.Publish();
  if (group_.running() > 0) {
    // The grace period runs from the decision to stop, not from when the signals were sent.
    kill_deadline_ = Now() + opts_.terminate_grace;
    Signal(SIGTERM);
    sent_sigterm_ = true;
    // A stopped process (SIGSTOP, a debugger) acts on SIGTERM only once continued.
    Signal(SIGCONT);
  }
}

// A signal that cannot be delivered is said; the stop goes on (SIGKILL after the grace period).
void Attempt::Signal(int signal) {
  Status s = group_.Signal(signal);
  if (!s.ok()) delegate_.Say("warning: " + s.message());
}

// --- connections (control_port.h) -----------------------------------------------------------

// What a start-up failure adds when connections were dropped meanwhile.
std::string Attempt::FloodNote() const {
  if (port_.dropped() == 0) return "";
  return "; meanwhile the controller dropped " + std::to_string(port_.dropped()) +
         " connection(s) to its control port that sent no valid hello (is another process "
         "flooding it?)";
}

void Attempt::OnClosed(int rank, bool timed_out) {
  RankState& r = ranks_[static_cast<size_t>(rank)];
  r.closed_turn = turn_;
  // Told before the stop below signals the group: a launcher that cannot reach the rank's host
  // ends its processes at once instead of after the grace period (Launcher::Unreachable), and
  // at once too when the stop has begun. Keyed by the plan's host, the launcher's own name.
  if (timed_out) {
    group_.Unreachable(rank);
    silent_hosts_.insert(PlannedHost(static_cast<size_t>(rank)));
  }
  if (r.done || Stopping()) return;
  Fail({.rank = rank,
        .cause = FailureCause::kConnection,
        .message = timed_out ? "its control connection timed out: its host stopped answering "
                               "(cut off from the network, or frozen)"
                             : "its control connection closed before its training function "
                               "returned"});
}

void Attempt::OnBadFrame(int rank, const std::string& what) { ProtocolError(rank, what); }

void Attempt::OnFrame(int rank, const wire::FrameView& f) {
  StatusOr<wire::WorkerMessage> message = wire::DecodeWorkerMessage(f);
  if (!message.ok()) return ProtocolError(rank, message.status().message());
  std::visit([&](auto& m) { OnMessage(rank, m); }, *message);
}

void Attempt::OnMessage(int rank, const wire::Registration& m) {
  RankState& r = ranks_[static_cast<size_t>(rank)];
  if (!r.registered) ++registered_;
  r.registered = true;
  r.host = m.host;
  r.coordinator = m.coordinator;
  delegate_.RefreshStatus();
  MaybeStartTraining();
  delegate_.Publish();
}

void Attempt::OnMessage(int rank, const wire::Report& m) {
  AddReport(rank, m.metrics_json, std::nullopt);
}

// A report, with or without a checkpoint: the rounds it completes are recorded, and at each the
// straggler rule is applied.
void Attempt::AddReport(int rank, std::string_view metrics_json,
                        std::optional<CheckpointPart> part) {
  watchdog_.Progress(rank);
  delegate_.CountReport();
  stragglers_.Report(rank, Now());
  for (Round& done : collector_.Add(rank, metrics_json, std::move(part))) {
    ApplyStragglerRule();
    delegate_.AddRound(std::move(done));
  }
  StopIfRoundsFinished();
  if (phase_ == Phase::kRunning) delegate_.RecordRunning(/*if_stale=*/true);
}

void Attempt::ApplyStragglerRule() {
  std::vector<StragglerChange> changes = stragglers_.Evaluate();
  if (watchdog_.auto_limit()) {  // the ranks' median step time sets the automatic limit
    std::vector<double> steps;
    for (int r = 0; r < world_size(); ++r) {
      if (std::optional<double> s = stragglers_.StepSeconds(r)) steps.push_back(*s);
    }
    if (!steps.empty()) {
      std::nth_element(steps.begin(), steps.begin() + steps.size() / 2, steps.end());
      watchdog_.SetStepTime(std::chrono::duration_cast<Duration>(
          std::chrono::duration<double>(steps[steps.size() / 2])));
    }
  }
  if (changes.empty()) return;
  for (const StragglerChange& c : changes) {
    const auto& host = ranks_[static_cast<size_t>(c.rank)].host;
    delegate_.Say("rank " + std::to_string(c.rank) + " (host " + (host.empty() ? "?" : host) +
                  ") " + (c.slow ? "is a straggler" : "is no longer a straggler") +
                  ": its step time is " + Seconds(c.step_s) + ", the other ranks' median " +
                  Seconds(c.others_s));
    straggler_events_.push_back({{"rank", c.rank},
                                 {"slow", c.slow},
                                 {"time", clock_.UnixSeconds()},
                                 {"step_time_s", c.step_s},
                                 {"median_step_time_s", c.others_s}});
  }
  // Callbacks learn of it from run.json (python/jaxtrain/callbacks.py).
  delegate_.RecordRunning(/*if_stale=*/false);
  delegate_.RefreshStatus();
}

void Attempt::OnMessage(int rank, wire::CheckpointReport& m) {
  // Only this rank's own staging directory of this round may be moved from and deleted.
  const std::string expected =
      m.in_store ? "" : storage::StagingPath(setup_.run_dir, setup_.number, m.round, rank);
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

void Attempt::OnMessage(int rank, wire::WorkerError& m) {
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

void Attempt::OnMessage(int rank, const wire::Done& m) {
  if (!ranks_[static_cast<size_t>(rank)].done && ++ranks_returned_ == ranks_.size()) {
    returned_time_ = clock_.UnixSeconds();
  }
  ranks_[static_cast<size_t>(rank)].done = true;
  if (rank == 0) {
    Status s = delegate_.RecordReturnValue(m.return_value);
    if (!s.ok()) Fail(StorageFailure(s, "rank 0's return value: " + s.message()));
  }
  watchdog_.Done(rank);
  StopIfRoundsFinished();
  Status unmatched = collectives_.Done(rank);
  if (!unmatched.ok()) {
    return Fail({.rank = rank, .cause = FailureCause::kException, .message = unmatched.message()});
  }
  // No round can complete without this rank any more: no commit can be ahead of another
  // rank's next checkpoint, so none of them waits for one (said once per attempt).
  if (checkpoints_released_) return;
  checkpoints_released_ = true;
  for (size_t other = 0; other < ranks_.size(); ++other) {
    if (!ranks_[other].done) {
      port_.Send(static_cast<int>(other), wire::MessageType::kCheckpointSettled, "release");
    }
  }
}

// --- preemption (preemption.h, docs/preemption.md) ----------------------------------------------

// `source`: the notice's, which an answer names (the worker matches it to its notice).
void Attempt::Reply(int rank, std::string_view kind, const std::string& source) {
  nlohmann::json reply = {{"kind", kind}};
  if (!source.empty()) reply["source"] = source;
  port_.Send(rank, wire::MessageType::kPreemptionReply, reply.dump());
}

void Attempt::OnMessage(int rank, const wire::Preemption& m) {
  if (m.source.empty()) {  // an answer to the query
    // The rank's report rounds of this attempt, as the run's round numbers.
    const uint64_t last_round = setup_.first_round - 1 + m.rounds;
    if (std::optional<std::string> agreed = preemption_.Answer(rank, m.calls, last_round)) {
      for (size_t r = 0; r < ranks_.size(); ++r) {
        port_.Send(static_cast<int>(r), wire::MessageType::kPreemptionReply, *agreed);
      }
    }
    return;
  }
  // The group is being stopped (its SIGTERM is the stop's) or not training: the rank ends.
  if (phase_ != Phase::kRunning) return Reply(rank, "stop", m.source);
  const std::string& host = ranks_[static_cast<size_t>(rank)].host;
  std::vector<int> host_ranks;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    if (ranks_[r].host == host) host_ranks.push_back(static_cast<int>(r));
  }
  const auto now_ms = static_cast<uint64_t>(clock_.UnixSeconds() * 1000);
  Duration grace = opts_.preemption_grace;
  if (m.deadline_ms != 0) {
    grace = std::min<Duration>(
        grace, std::chrono::milliseconds(m.deadline_ms > now_ms ? m.deadline_ms - now_ms : 0));
  }
  const uint64_t deadline_ms =
      now_ms +
      static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(grace).count());
  const bool opened =
      preemption_.Notice(rank, host, std::move(host_ranks), m.source, Now() + grace, deadline_ms);
  Reply(rank, "noted", m.source);
  if (!opened) return;
  delegate_.Say("preemption notice: " + preemption_.Describe() +
                "; the group goes on until a checkpoint reported after it is committed, for " +
                FormatNumber(std::chrono::duration<double>(grace).count()) + " s at most");
  for (size_t r = 0; r < ranks_.size(); ++r) Reply(static_cast<int>(r), "query");
}

void Attempt::StopForPreemption(const std::string& why, bool drain_timed_out) {
  Fail({.rank = preemption_.first_rank(),
        .cause = FailureCause::kPreemption,
        .message = "preempted: " + preemption_.Describe() + "; " + why,
        .preemption = nlohmann::json::parse(preemption_.Info(drain_timed_out))});
}

void Attempt::OnMessage(int rank, const wire::Pong& m) {
  if (live_stacks_) {
    auto asked = live_stacks_->asked.find(rank);
    if (asked != live_stacks_->asked.end()) asked->second = m;
    CheckLiveStacks();
  }
  if (!watchdog_ping_) return;
  WatchdogPing& p = *watchdog_ping_;
  auto at = std::find(p.ranks.begin(), p.ranks.end(), rank);
  if (at != p.ranks.end()) p.answered[static_cast<size_t>(at - p.ranks.begin())] = true;
  auto asked = p.asked.find(rank);
  if (asked != p.asked.end()) asked->second = m;
  if (m.has_stacks) {
    for (size_t r = 0; r < ranks_.size(); ++r) AskForStacks(static_cast<int>(r));
  }
  if (phase_ == Phase::kRunning) CheckProgress();  // decides once no answer is awaited
}

// A collective call; once every rank has made it, each is released (with rank 0's data, one
// buffer shared by every connection's queue).
void Attempt::OnMessage(int rank, const wire::Collective& m) {
  watchdog_.Progress(rank);
  StatusOr<std::optional<Collectives::Release>> arrived = collectives_.Arrive(rank, m, Now());
  if (arrived.status().code() == StatusCode::kInvalidArgument) {
    return ProtocolError(rank, arrived.status().message());
  }
  if (!arrived.ok()) {
    // A call made after a rank returned without it: that rank broke the sequence, not this one
    // (which only came to the call after it had returned).
    const int blamed = collectives_.first_returned() >= 0 ? collectives_.first_returned() : rank;
    return Fail(
        {.rank = blamed, .cause = FailureCause::kException, .message = arrived.status().message()});
  }
  if (!*arrived) return;
  const Collectives::Release& r = **arrived;
  // Sealed once for every rank: the data is at most wire::kMaxCollectiveData.
  const wire::SharedFrame frame = *wire::SealShared(
      wire::MessageType::kCollectiveRelease,
      wire::EncodeCollectiveRelease({.sequence = r.sequence, .kind = r.kind, .data = r.data}));
  for (size_t other = 0; other < ranks_.size(); ++other) {
    port_.SendShared(static_cast<int>(other), frame);
  }
}

void Attempt::ProtocolError(int rank, const std::string& what) {
  Fail({.rank = rank, .cause = FailureCause::kConnection, .message = "protocol error: " + what});
  ranks_[static_cast<size_t>(rank)].refused = true;
  port_.Close(rank);
}

void Attempt::MaybeStartTraining() {
  if (phase_ != Phase::kStarting || registered_ < ranks_.size()) return;
  if (ranks_[0].coordinator.empty()) {
    Fail({.rank = 0,
          .cause = FailureCause::kStartUp,
          .message = "rank 0 did not publish a coordinator"});
    return;
  }
  phase_ = Phase::kRunning;
  ready_time_ = clock_.UnixSeconds();
  nlohmann::json start = {
      {"coordinator", ranks_[0].coordinator},
      {"world_size", ranks_.size()},
      {"attempt", setup_.number},
      {"run_dir", setup_.run_dir},
      {"experiment_name", opts_.experiment_name},
      {"checkpoint",
       setup_.restore_from.empty() ? nlohmann::json() : nlohmann::json(setup_.restore_from)},
      // This attempt's first report is this round (rounds continue across attempts), and these
      // checkpoints are committed: what ranks that write to object storage themselves need to
      // name a round's directory there and to sweep what an earlier attempt left.
      {"first_round", collector_.next_round()},
      {"committed", delegate_.CommittedNames()}};
  if (setup_.restore_checksums_skipped) start["checkpoint_checksums_skipped"] = true;
  // The start frame is the same for every rank: sealed once, shared by every connection's queue
  // like the payload (O(start), not O(ranks x start)).
  const wire::SharedFrame head = *wire::SealShared(wire::MessageType::kStart, start.dump());
  for (size_t rank = 0; rank < ranks_.size(); ++rank) {
    port_.SendShared(static_cast<int>(rank), head);
    port_.SendShared(static_cast<int>(rank), setup_.payload);
  }
  delegate_.OnTrainingStarted();
}

// --- rounds (round_recorder.h) -------------------------------------------------------------------

void Attempt::RequestResize(std::string why) {
  if (resize_after_ || Stopping() || failure_) return;
  resize_after_ = collector_.next_round();
  resize_why_ = std::move(why);
}

void Attempt::OnRecorded(uint64_t round, const std::string& committed) {
  if (!committed.empty() && phase_ == Phase::kRunning && preemption_.AfterNotice(round)) {
    StopForPreemption(
        "the group was stopped once " + committed + ", reported after the notice, was committed",
        /*drain_timed_out=*/false);
  }
  if (!committed.empty() && phase_ == Phase::kRunning && ResizeAfter(round)) {
    resized_ = true;
    delegate_.Say("stopping the group to resize it (" + resize_why_ + "), " + committed +
                  " being committed");
    Stop();
  }
  if (rounds_++ == 0) first_round_at_ = Now();
}

void Attempt::OnSettled(int rank, uint64_t round) {
  if (phase_ == Phase::kRunning && (preemption_.AfterNotice(round) || ResizeAfter(round))) return;
  port_.Send(rank, wire::MessageType::kCheckpointSettled, "settled");
}

double Attempt::RoundsPerSecond() const {
  if (rounds_ <= 1) return 0;
  double s = std::chrono::duration<double>(Now() - *first_round_at_).count();
  return s > 0 ? static_cast<double>(rounds_ - 1) / s : 0;
}

// --- processes ---------------------------------------------------------------------------------

void Attempt::OnExit(const std::vector<int>& proc_ranks, const launch::ExitStatus& exit,
                     const RankOutput& output) {
  if (proc_ranks.size() > 1) return OnStepExit(proc_ranks, exit, output);
  const int rank = proc_ranks.front();
  RankState& r = ranks_[static_cast<size_t>(rank)];
  // A frame sent just before exit may still be unread: read it first.
  port_.Read(rank);
  const bool stopping = Stopping();
  const bool oom = exit.signal == SIGKILL && !sent_sigkill_ && OomKillCount() > oom_kills_before_;
  RankFailure exit_failure{.rank = rank,
                           .cause = oom           ? FailureCause::kOom
                                    : exit.signal ? FailureCause::kSignal
                                                  : FailureCause::kExit,
                           .exit_code = exit.exit_code,
                           .signal = exit.signal,
                           .message = std::string("its process ") + (exit.signal ? "was " : "") +
                                      exit.ToString() +
                                      (exit.ok() ? " before its training function returned" : "") +
                                      (oom ? " by the kernel's out-of-memory killer" : "")};
  // The connection usually closes just before the exit is seen; the exit says more, unless the
  // process died of the signal the controller sent to stop the group.
  // A rank that ends before it has registered could not start: a start-up failure, with its
  // own budget. Among them a worker that could not get through a flood of its control port.
  if (phase_ == Phase::kStarting && !r.registered) {
    exit_failure.cause = FailureCause::kStartUp;
    exit_failure.message += FloodNote();
  }
  // A SIGKILL on a host found silent is the stop's too: the launcher ends such processes at once
  // (Launcher::Unreachable) instead of waiting for the controller's.
  const bool stop_sigkill =
      sent_sigkill_ || (stopping && silent_hosts_.count(PlannedHost(static_cast<size_t>(rank))));
  const bool our_signal =
      (exit.signal == SIGTERM && sent_sigterm_) || (exit.signal == SIGKILL && stop_sigkill);
  // Not when the controller closed the connection itself: the exit (the worker's "controller
  // lost") is then the protocol error's consequence.
  if (failure_ && failure_->rank == rank && failure_->cause == FailureCause::kConnection &&
      !our_signal && !r.refused) {
    failure_->cause = exit_failure.cause;
    failure_->exit_code = exit_failure.exit_code;
    failure_->signal = exit_failure.signal;
    failure_->message = exit_failure.message;
  }
  if (failure_ && failure_->rank != rank && exit.signal == SIGKILL && !stop_sigkill &&
      IsPeerNotice(failure_->cause)) {
    return Reblame(std::move(exit_failure));
  }
  if (stopping || (exit.ok() && r.done)) return;
  Fail(std::move(exit_failure));
}

void Attempt::Reblame(RankFailure killed) {
  const std::string first = failure_->message.substr(0, failure_->message.find('\n'));
  killed.message += "; rank " + std::to_string(failure_->rank) + " failed meanwhile: " + first;
  failure_.reset();
  Fail(std::move(killed));
}

// The process that ran several ranks (srun) has ended. How each rank ended is known from srun's
// own lines ("task 1: Killed") when it said; the first rank that failed is blamed.
void Attempt::OnStepExit(const std::vector<int>& proc_ranks, const launch::ExitStatus& exit,
                         const RankOutput& output) {
  for (int rank : proc_ranks) port_.Read(rank);
  auto ours = [this](const launch::ExitStatus& e) {
    return (e.signal == SIGTERM && sent_sigterm_) || (e.signal == SIGKILL && sent_sigkill_);
  };
  // The task that failed first is blamed: of those whose connections closed, the one whose
  // close was seen in the earliest turn of the loop; among those closing in one turn, the
  // first that srun reports. srun's order alone is no witness: it may report the SIGKILLs of
  // the rest of the step (--kill-on-bad-exit, or srun's answer to the stop's SIGTERM) before
  // the failure that caused them, as the messages of several nodes race.
  auto closed = [this](int rank) {
    const uint64_t t = ranks_[static_cast<size_t>(rank)].closed_turn;
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
    f.log_path = setup_.log_path(f.rank);
    f.cause = end.exit.signal ? FailureCause::kSignal : FailureCause::kExit;
    f.exit_code = end.exit.exit_code;
    f.signal = end.exit.signal;
    f.message = std::string("its process ") + (end.exit.signal ? "was " : "") +
                end.exit.ToString() + " on " + end.node;
  };
  // A connection that closed first is explained by its own task's end, not by a later one's
  // (a node lost at once: its tasks unreported, the others killed when the step is cancelled).
  if (failure_ && failure_->cause == FailureCause::kConnection) {
    if (first && closed(first->first) <= closed(failure_->rank)) {
      blame_first(*failure_);
    } else if (!output.launcher_error().empty()) {
      failure_->message += " (" + output.launcher_error() + ")";
    }
  }
  const bool stopping = Stopping();
  const auto not_done = std::find_if(proc_ranks.begin(), proc_ranks.end(), [this](int r) {
    return !ranks_[static_cast<size_t>(r)].done;
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
  if (phase_ == Phase::kStarting) f.cause = FailureCause::kStartUp;
  Fail(std::move(f));
}

// --- timers --------------------------------------------------------------------------------------

// Where the plan put rank `rank` (the launcher's name for its host; "" for a rank beyond it).
std::string Attempt::PlannedHost(size_t rank) const {
  return rank < plan().workers.size() ? plan().workers[rank].host : std::string();
}

// Where rank `rank` runs: where it registered from, else where the plan put it.
std::string Attempt::HostOf(size_t rank) const {
  return ranks_[rank].host.empty() ? PlannedHost(rank) : ranks_[rank].host;
}

// `rs` with their hosts, grouped by host in order: "0, 1 on host1; 2 on host2".
std::string Attempt::RanksOn(const std::vector<int>& rs) const {
  std::vector<std::pair<std::string, std::string>> by_host;  // host, its ranks
  for (int r : rs) {
    std::string host = HostOf(static_cast<size_t>(r));
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

// What set the watchdog's limit, for the failure.
std::string Attempt::LimitDescription() const {
  const std::optional<AutoLimit>& a = watchdog_.auto_limit();
  if (!a) return "the progress watchdog's limit";
  auto s = [](Duration d) { return Seconds(std::chrono::duration<double>(d).count()); };
  return "the progress watchdog's automatic limit: " + FormatNumber(a->multiple) +
         " x the median step time" +
         (watchdog_.step_time() > Duration::zero() ? " (" + s(watchdog_.step_time()) + ")" : "") +
         ", at least " + s(a->floor) + "; FailureConfig(progress_timeout_s=...) sets another";
}

void Attempt::AskForStacks(int rank) {
  WatchdogPing& ping = *watchdog_ping_;
  if (ping.asked.count(rank) || ranks_[static_cast<size_t>(rank)].done || !port_.connected(rank)) {
    return;
  }
  ping.asked[rank];
  port_.Send(rank, wire::MessageType::kPing, "stacks");
}

// The progress watchdog (watchdog.h): every stale rank is named with its host. A stale rank is
// pinged first (ranks waiting in a collective for a stuck one stall with it): those that do not
// answer within kWatchdogPingWait (stopped, frozen, cut off) are blamed; else the rank(s) the
// others wait for, told from their stacks (rank_stacks.h); else the one stale longest. A rank
// found stale while others' answers are awaited is pinged too.
void Attempt::CheckProgress() {
  std::optional<Watchdog::Stale> stale = watchdog_.Check();
  if (!stale) {
    watchdog_ping_.reset();
    return;
  }
  if (!watchdog_ping_) watchdog_ping_.emplace();
  WatchdogPing& ping = *watchdog_ping_;
  const TimePoint now = Now();
  for (int r : stale->ranks) {
    if (std::find(ping.ranks.begin(), ping.ranks.end(), r) != ping.ranks.end()) continue;
    ping.ranks.push_back(r);
    ping.answered.push_back(false);
    ping.deadline = now + kWatchdogPingWait;
    AskForStacks(r);
  }
  std::vector<int> silent, answered;
  for (size_t i = 0; i < ping.ranks.size(); ++i) {
    (ping.answered[i] ? answered : silent).push_back(ping.ranks[i]);
  }
  const bool awaited =
      !silent.empty() || std::any_of(ping.asked.begin(), ping.asked.end(),
                                     [](const auto& a) { return !a.second.has_value(); });
  if (awaited && now < ping.deadline) return;  // answers may yet come
  std::sort(silent.begin(), silent.end());
  std::sort(answered.begin(), answered.end());
  std::string message = "no report() for " +
                        FormatNumber(std::chrono::duration<double>(watchdog_.timeout()).count()) +
                        " s (" + LimitDescription() + ") from rank(s) " + RanksOn(stale->ranks);
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
  std::string stacks_dir;
  message += KeepStacks(ping, /*may_reblame=*/silent.empty(), &blamed, &stacks_dir);
  watchdog_ping_.reset();
  RankFailure f{.rank = blamed, .cause = FailureCause::kWatchdog, .message = std::move(message)};
  f.stacks_dir = std::move(stacks_dir);
  Fail(std::move(f));
}

std::string Attempt::KeepStacks(const WatchdogPing& ping, bool may_reblame, int* blamed,
                                std::string* stacks_dir) {
  std::vector<RankStacks> given = GivenStacks(ping.asked);
  if (given.empty()) return "";  // no worker could take its stacks
  std::string out;
  if (std::optional<Behind> behind = FindBehind(given); behind && may_reblame) {
    *blamed = behind->ranks.front();
    out += "; the others wait for " + RanksOn(behind->ranks) + ": " + behind->why;
  }
  const std::string dir = "stacks/attempt-" + std::to_string(setup_.number);
  Status s = WriteStacks(ping.asked, given, dir);
  if (!s.ok()) return out + "; the ranks' stacks could not be kept: " + s.message();
  *stacks_dir = dir;
  return out + "; every rank's stacks: " + storage::JoinPath(setup_.run_dir, dir);
}

std::vector<RankStacks> Attempt::GivenStacks(const StacksAsked& asked) const {
  std::vector<RankStacks> given;
  for (const auto& [rank, pong] : asked) {
    if (!pong || !pong->has_stacks) continue;
    given.push_back({.rank = rank,
                     .host = HostOf(static_cast<size_t>(rank)),
                     .reports = collector_.reports(rank),
                     .pong = *pong});
  }
  return given;
}

// Every rank's file under `dir` (relative to the run directory): its stacks, or why there are
// none.
Status Attempt::WriteStacks(const StacksAsked& asked, const std::vector<RankStacks>& given,
                            const std::string& dir) const {
  const std::string path = storage::JoinPath(setup_.run_dir, dir);
  JT_RETURN_IF_ERROR(storage::MakeDirs(path));
  for (size_t r = 0; r < ranks_.size(); ++r) {
    const int rank = static_cast<int>(r);
    auto at = std::find_if(given.begin(), given.end(),
                           [&](const RankStacks& g) { return g.rank == rank; });
    RankStacks none{.rank = rank, .host = HostOf(r), .reports = collector_.reports(rank)};
    auto a = asked.find(rank);
    none.pong.error =
        ranks_[r].done     ? "its training function had returned"
        : a == asked.end() ? "not connected"
        : a->second
            ? "its worker cannot take them"
            : "it did not answer within " +
                  FormatNumber(std::chrono::duration<double>(kWatchdogPingWait).count()) + " s";
    JT_RETURN_IF_ERROR(storage::WriteFileAtomically(
        storage::JoinPath(path, "rank-" + std::to_string(rank) + ".txt"),
        StacksFileText(at != given.end() ? *at : none, setup_.number)));
  }
  return OkStatus();
}

// --- stacks on demand (Controller::TakeStacks()) -------------------------------------------------

void Attempt::RequestStacks() {
  if (phase_ != Phase::kRunning) {
    live_result_ = FailedPreconditionError(
        "attempt " + std::to_string(setup_.number) + " is not training now (" +
        (phase_ == Phase::kStarting ? "its workers are starting" : "its workers are stopping") +
        "); try again once it trains");
    return;
  }
  if (live_stacks_) return;  // the request under way answers this one too
  live_stacks_.emplace();
  live_stacks_->deadline = Now() + kWatchdogPingWait;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    const int rank = static_cast<int>(r);
    if (ranks_[r].done || !port_.connected(rank)) continue;
    live_stacks_->asked[rank];
    port_.Send(rank, wire::MessageType::kPing, "stacks");
  }
  CheckLiveStacks();
}

// Once every rank asked has answered, or the wait is over: every rank's file, under
// stacks/attempt-<N>/live-<K>.
void Attempt::CheckLiveStacks() {
  if (!live_stacks_) return;
  const bool awaited = std::any_of(live_stacks_->asked.begin(), live_stacks_->asked.end(),
                                   [](const auto& a) { return !a.second.has_value(); });
  if (awaited && Now() < live_stacks_->deadline) return;
  const std::string dir =
      "stacks/attempt-" + std::to_string(setup_.number) + "/live-" + std::to_string(++live_taken_);
  Status s = WriteStacks(live_stacks_->asked, GivenStacks(live_stacks_->asked), dir);
  live_result_ = s.ok() ? StatusOr<std::string>(storage::JoinPath(setup_.run_dir, dir))
                        : StatusOr<std::string>(s);
  live_stacks_.reset();
}

StatusOr<std::string> Attempt::StartProfile(int steps) {
  if (phase_ != Phase::kRunning) {
    return FailedPreconditionError("attempt " + std::to_string(setup_.number) +
                                   " is not training now; try again once it trains");
  }
  const std::string dir =
      storage::JoinPath(setup_.run_dir, "profiles/attempt-" + std::to_string(setup_.number) +
                                            "/profile-" + std::to_string(++profiles_));
  JT_RETURN_IF_ERROR(storage::MakeDirs(dir));
  const std::string body = "profile " + nlohmann::json{{"dir", dir}, {"steps", steps}}.dump();
  for (size_t r = 0; r < ranks_.size(); ++r) {
    if (!ranks_[r].done && port_.connected(static_cast<int>(r))) {
      port_.Send(static_cast<int>(r), wire::MessageType::kPing, body);
    }
  }
  return dir;
}

std::optional<StatusOr<std::string>> Attempt::TakeLiveStacks() {
  std::optional<StatusOr<std::string>> out = std::move(live_result_);
  live_result_.reset();
  return out;
}

void Attempt::CheckTimers() {
  TimePoint now = Now();
  if (phase_ == Phase::kStarting && now >= start_deadline_) {
    int missing = 0;
    while (missing < world_size() && ranks_[static_cast<size_t>(missing)].registered) ++missing;
    Fail({.rank = missing,
          .cause = FailureCause::kStartUp,
          .message =
              "it did not connect to the controller within the start-up timeout" + FloodNote()});
  }
  CheckLiveStacks();
  if (phase_ == Phase::kRunning) {
    CheckProgress();
    std::string waiting = collectives_.TakeWarning(now);
    if (!waiting.empty()) delegate_.Say("warning: " + waiting);
  }
  if (phase_ == Phase::kRunning && preemption_.open() && now >= preemption_.deadline()) {
    StopForPreemption(
        "its deadline passed before a checkpoint reported after the notice was committed",
        /*drain_timed_out=*/true);
  }
  if (FinishingRounds() && now >= owed_->deadline) {
    std::vector<int> missing;
    for (size_t r = 0; r < ranks_.size(); ++r) {
      if (collector_.reports(static_cast<int>(r)) < owed_->reports) {
        missing.push_back(static_cast<int>(r));
      }
    }
    const uint64_t first = setup_.first_round + collector_.complete();
    const uint64_t last = setup_.first_round + owed_->reports - 1;
    delegate_.Say(
        "stopping the group without " +
        (first == last ? "round " + std::to_string(first)
                       : "rounds " + std::to_string(first) + " to " + std::to_string(last)) +
        ", which rank " + std::to_string(owed_->rank) + " reported before it failed: rank(s) " +
        RanksOn(missing) + " did not report " + (first == last ? "it" : "them") + " within " +
        FormatNumber(std::chrono::duration<double>(opts_.finish_rounds_timeout).count()) + " s");
    Stop();
  }
  if (kill_deadline_ && now >= *kill_deadline_) {
    kill_deadline_.reset();
    if (group_.running() > 0) {
      delegate_.Say("workers did not stop within the grace period; sending SIGKILL");
      sent_sigkill_ = true;
      Signal(SIGKILL);
    }
  }
}

std::optional<TimePoint> Attempt::NextDeadline(bool commit_in_flight) const {
  std::optional<TimePoint> next;
  auto consider = [&](TimePoint t) { next = next ? std::min(*next, t) : t; };
  if (phase_ == Phase::kStarting) consider(start_deadline_);
  if (phase_ == Phase::kRunning) {
    if (auto t = watchdog_.NextDeadline()) consider(*t);
    if (watchdog_ping_) consider(watchdog_ping_->deadline);
    if (live_stacks_) consider(live_stacks_->deadline);
    if (preemption_.open()) consider(preemption_.deadline());
    if (auto t = collectives_.NextWarning()) consider(*t);
    if (owed_) consider(owed_->deadline);
  }
  if (kill_deadline_) consider(*kill_deadline_);
  // Past it, only a commit in flight holds the attempt open: its descriptor wakes the loop.
  if (drain_deadline_ && !(commit_in_flight && Now() >= *drain_deadline_)) {
    consider(*drain_deadline_);
  }
  return next;
}

bool Attempt::Drained() {
  if (group_.running() > 0) return false;
  if (!drain_deadline_) drain_deadline_ = Now() + kDrainTime;
  phase_ = Phase::kDraining;
  return group_.outputs_open() == 0 || Now() >= *drain_deadline_;
}

// --- the record ----------------------------------------------------------------------------------

nlohmann::json Attempt::Record(std::string_view status) const {
  nlohmann::json a = {
      {"attempt", setup_.number},
      {"start_time", start_time_},
      {"status", status},
      {"restored_from",
       setup_.restore_from.empty() ? nlohmann::json() : nlohmann::json(setup_.restore_from)}};
  // The times python/jaxtrain/goodput.py splits the attempt by (docs/observability.md).
  if (ready_time_ > 0) a["ready_time"] = ready_time_;
  if (returned_time_ > 0) a["returned_time"] = returned_time_;
  // Inside start_time..ready_time: waiting for Kueue's admission or a new Slurm allocation.
  a["queue_wait_s"] = queue_wait_s_;
  if (queued_) a["phase"] = "queued";  // its launch waits in the queue now
  // Each rank's host: where it registered from, else where the plan put it.
  nlohmann::json hosts = nlohmann::json::array();
  for (size_t r = 0; r < ranks_.size(); ++r) hosts.push_back(HostOf(r));
  a["hosts"] = std::move(hosts);
  a["world_size"] = ranks_.size();
  if (!setup_.resize.is_null()) a["resize"] = setup_.resize;
  // Each rank's step time (stragglers.h), null until it is known; refreshed while the attempt
  // runs now and then (Delegate::RecordRunning()).
  nlohmann::json step_times = nlohmann::json::array();
  for (size_t r = 0; r < ranks_.size(); ++r) {
    std::optional<double> s = stragglers_.StepSeconds(static_cast<int>(r));
    step_times.push_back(s ? nlohmann::json(*s) : nlohmann::json());
  }
  a["step_time_s"] = std::move(step_times);
  if (status != "RUNNING") a["end_time"] = clock_.UnixSeconds();
  if (failure_) {
    a["failure"] = FailureJson(*failure_);
    a["failure"]["time"] = failure_time_;
  }
  if (!straggler_events_.empty()) a["stragglers"] = straggler_events_;
  return a;
}

}  // namespace jaxtrain::controller
