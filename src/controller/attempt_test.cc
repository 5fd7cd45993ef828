// One Attempt driven alone, through fakes of its edges: the ranks' connections (FakeConnections),
// their processes (FakeProcesses) and the time (FakeClock). No loop thread: each test delivers
// what the ranks do and hands it to the attempt as the run's loop would, in the loop's order
// (connections before processes), then reads the attempt's result. Above all the table of whom a
// failure blames: a closed connection explained by its process's exit, the stop's own signals, a
// SIGKILL from outside over a peer that noticed it, a rank that ends before registering.
#include "controller/attempt.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <nlohmann/json.hpp>

#include "controller/testing/cpu_plan.h"
#include "controller/testing/fake_control_port.h"
#include "controller/testing/fake_worker_group.h"
#include "wire/frame.h"
#include "wire/messages.h"

namespace jaxtrain::controller {
namespace {

using nlohmann::json;
using wire::MessageType;
using namespace std::chrono_literals;

// The run's side of the attempt: forwards the port's and the group's events to it, and notes
// what the attempt asks of the run.
class FakeRun : public ControlPort::Delegate,
                public WorkerGroup::Delegate,
                public Attempt::Delegate {
 public:
  Attempt* attempt = nullptr;
  std::vector<std::string> said;
  std::vector<uint64_t> rounds;
  int reports = 0;
  int trainings_started = 0;
  std::optional<std::string> return_value;

  // ControlPort::Delegate and WorkerGroup::Delegate.
  void OnFrame(int rank, const wire::FrameView& f) override { attempt->OnFrame(rank, f); }
  void OnBadFrame(int rank, const std::string& what) override { attempt->OnBadFrame(rank, what); }
  void OnClosed(int rank, bool timed_out) override { attempt->OnClosed(rank, timed_out); }
  void OnLog(int, std::string_view) override {}
  void OnConsole(std::string) override {}
  void OnExit(const std::vector<int>& ranks, const launch::ExitStatus& exit,
              const RankOutput& output) override {
    attempt->OnExit(ranks, exit, output);
  }

  // Attempt::Delegate (Say() serves all three).
  void Say(const std::string& line) override { said.push_back(line); }
  void CountReport() override { ++reports; }
  void AddRound(Round round) override { rounds.push_back(round.round); }
  void RecordRunning(bool) override {}
  void Publish() override {}
  void RefreshStatus() override {}
  Status RecordReturnValue(const std::optional<std::string>& value) override {
    return_value = value;
    return OkStatus();
  }
  void OnTrainingStarted() override { ++trainings_started; }
  json CommittedNames() const override { return json::array({"checkpoint_000004"}); }
};

class AttemptTest : public testing::Test {
 protected:
  static constexpr int kWorkers = 2;

  AttemptTest() : port_(ranks_, run_), group_(processes_, run_) {
    opts_.plan = CpuPlan(kWorkers);
    opts_.experiment_name = "attempt_test";
    opts_.terminate_grace = 5s;
    opts_.start_timeout = 60s;
  }

  // Attempt `number`, whose first round is `first_round`, started.
  void Start(int number = 3, uint64_t first_round = 5) {
    attempt_ = std::make_unique<Attempt>(
        Attempt::Setup{
            .number = number,
            .first_round = first_round,
            .restore_from = first_round > 1 ? "/run/checkpoint_000004" : "",
            .run_dir = "/run",
            .log_path = [](int r) { return "/run/logs/rank-" + std::to_string(r) + ".log"; },
            .payload = *wire::SealShared(MessageType::kPayload, "payload")},
        opts_, port_, group_, clock_, run_);
    run_.attempt = attempt_.get();
    std::vector<launch::ProcessSpec> specs(kWorkers);
    for (int r = 0; r < kWorkers; ++r) specs[static_cast<size_t>(r)].ranks = {r};
    ASSERT_TRUE(attempt_->Start(specs).ok());
  }

  // What the ranks sent is handled, then the processes' exits: one turn of the loop.
  void Turn() {
    attempt_->NewTurn();
    port_.OnConnsReady();
    group_.OnReady();
  }

  void Register(int rank) {
    json body = {{"host", "host-" + std::to_string(rank)},
                 {"coordinator", rank == 0 ? "127.0.0.1:8476" : ""}};
    ranks_.Deliver(rank, MessageType::kRegister, body.dump());
  }
  // Every rank reports one round (no checkpoint), handled in one turn.
  void ReportRound() {
    for (int r = 0; r < kWorkers; ++r) {
      ranks_.Deliver(r, MessageType::kReport, wire::EncodeReportBody(0, R"({"loss": 1})"));
    }
    Turn();
  }
  void RegisterAll() {
    for (int r = 0; r < kWorkers; ++r) Register(r);
    Turn();
    ASSERT_EQ(attempt_->phase(), Attempt::Phase::kRunning);
  }

  const RankFailure& Failure() {
    EXPECT_TRUE(attempt_->failure().has_value());
    static const RankFailure kNone;
    return attempt_->failure() ? *attempt_->failure() : kNone;
  }

  FakeRun run_;
  FakeConnections ranks_;
  FakeProcesses processes_;
  FakeClock clock_;
  FakeControlPort port_;
  FakeWorkerGroup group_;
  ControllerOptions opts_;
  std::unique_ptr<Attempt> attempt_;
};

TEST_F(AttemptTest, StartsWithItsOwnNumberRoundAndCheckpoint) {
  Start(/*number=*/3, /*first_round=*/5);
  EXPECT_EQ(attempt_->phase(), Attempt::Phase::kStarting);
  RegisterAll();
  EXPECT_EQ(run_.trainings_started, 1);
  for (int r = 0; r < kWorkers; ++r) {
    auto start = ranks_.WaitForSent(3, r, MessageType::kStart, 1s);
    ASSERT_TRUE(start.has_value()) << "rank " << r;
    json body = json::parse(start->body);
    EXPECT_EQ(body["attempt"], 3);
    EXPECT_EQ(body["world_size"], kWorkers);
    EXPECT_EQ(body["coordinator"], "127.0.0.1:8476");
    EXPECT_EQ(body["first_round"], 5);
    EXPECT_EQ(body["checkpoint"], "/run/checkpoint_000004");
    EXPECT_EQ(body["committed"], json::array({"checkpoint_000004"}));
    auto payload = ranks_.WaitForSent(3, r, MessageType::kPayload, 1s);
    ASSERT_TRUE(payload.has_value());
    EXPECT_EQ(payload->body, "payload");
  }
  json record = attempt_->Record("RUNNING");
  EXPECT_EQ(record["attempt"], 3);
  EXPECT_EQ(record["restored_from"], "/run/checkpoint_000004");
  EXPECT_EQ(record["hosts"], json::array({"host-0", "host-1"}));
  EXPECT_TRUE(record.contains("ready_time"));
  EXPECT_FALSE(record.contains("failure"));
  EXPECT_FALSE(record.contains("end_time"));
}

TEST_F(AttemptTest, RoundsContinueFromTheFirstRound) {
  Start(/*number=*/1, /*first_round=*/5);
  RegisterAll();
  ReportRound();
  EXPECT_EQ(run_.reports, kWorkers);
  EXPECT_EQ(run_.rounds, std::vector<uint64_t>{5});
  EXPECT_EQ(attempt_->next_round(), 6u);
}

TEST_F(AttemptTest, SucceedsWhenEveryRankReturnsAndExits) {
  Start();
  RegisterAll();
  for (int r = 0; r < kWorkers; ++r) {
    ranks_.Deliver(r, MessageType::kDone, "{}");
    processes_.Exit(r, 0);
  }
  Turn();
  EXPECT_FALSE(attempt_->failure().has_value());
  EXPECT_TRUE(attempt_->Drained());
  EXPECT_EQ(attempt_->phase(), Attempt::Phase::kDraining);
  EXPECT_EQ(processes_.signals(SIGTERM), 0);
}

// The connection closes first; the process's own exit says more and replaces it.
TEST_F(AttemptTest, ClosedConnectionIsExplainedByItsExit) {
  Start();
  RegisterAll();
  processes_.Die(1, {.exit_code = 3});  // seen with the stop's SIGTERM
  ranks_.Disconnect(1);
  Turn();
  const RankFailure& f = Failure();
  EXPECT_EQ(f.rank, 1);
  EXPECT_EQ(f.cause, FailureCause::kExit);
  EXPECT_EQ(f.exit_code, 3);
  EXPECT_EQ(f.attempt, 3);
  EXPECT_EQ(f.host, "host-1");
  EXPECT_EQ(f.log_path, "/run/logs/rank-1.log");
  EXPECT_EQ(processes_.signals(SIGTERM), 1);
  EXPECT_TRUE(attempt_->Drained());
}

// An exit by the stop's own SIGTERM explains nothing: the connection's loss stays the cause.
TEST_F(AttemptTest, OurSigtermDoesNotExplainAClosedConnection) {
  Start();
  RegisterAll();
  ranks_.Disconnect(1);
  Turn();
  const RankFailure& f = Failure();
  EXPECT_EQ(f.rank, 1);
  EXPECT_EQ(f.cause, FailureCause::kConnection);
  EXPECT_EQ(f.signal, 0);
}

// A connection the kernel timed out (the rank's host went silent) is said so, and the group is
// told which rank before the stop signals it, so that a launcher can end that host's process at
// once (Launcher::Unreachable). A connection closed in the ordinary way tells it nothing.
TEST_F(AttemptTest, ATimedOutConnectionIsBlamedOnItsHostBeforeTheStop) {
  Start();
  RegisterAll();
  ranks_.Disconnect(1, /*timed_out=*/true);
  Turn();
  const RankFailure& f = Failure();
  EXPECT_EQ(f.rank, 1);
  EXPECT_EQ(f.cause, FailureCause::kConnection);
  EXPECT_NE(f.message.find("timed out"), std::string::npos) << f.message;
  EXPECT_NE(f.message.find("stopped answering"), std::string::npos) << f.message;
  EXPECT_EQ(processes_.unreachable(), std::vector<int>{1});
  EXPECT_EQ(processes_.signals_before_unreachable(), std::vector<size_t>{0});
  EXPECT_EQ(processes_.signals(SIGTERM), 1);
  // The other rank's connection times out during the stop: told too, blamed on nobody new.
  ranks_.Disconnect(0, /*timed_out=*/true);
  Turn();
  EXPECT_EQ(processes_.unreachable(), (std::vector<int>{1, 0}));
  EXPECT_EQ(Failure().rank, 1);
}

// The launcher ends a silent host's processes with SIGKILL at the stop, before the controller's
// own SIGKILL: those exits are the stop's, not a new cause, on the silent rank and on its peers
// of the same host.
TEST_F(AttemptTest, TheLaunchersSigkillOfASilentHostKeepsTheTimeoutAsTheCause) {
  for (auto& w : opts_.plan.workers) w.host = "host-2";  // the launcher's name for both
  Start();
  for (int r = 0; r < kWorkers; ++r) {
    json body = {{"host", "host-2"}, {"coordinator", r == 0 ? "127.0.0.1:8476" : ""}};
    ranks_.Deliver(r, MessageType::kRegister, body.dump());
  }
  Turn();
  ASSERT_EQ(attempt_->phase(), Attempt::Phase::kRunning);
  processes_.IgnoreSigterm();  // as workers behind a cut link: they never hear it
  ranks_.Disconnect(1, /*timed_out=*/true);
  Turn();
  ASSERT_EQ(processes_.signals(SIGTERM), 1);
  processes_.Exit(0, launch::ExitStatus{.signal = SIGKILL});
  processes_.Exit(1, launch::ExitStatus{.signal = SIGKILL});
  Turn();
  const RankFailure& f = Failure();
  EXPECT_EQ(f.rank, 1);
  EXPECT_EQ(f.cause, FailureCause::kConnection);
  EXPECT_NE(f.message.find("timed out"), std::string::npos) << f.message;
  EXPECT_EQ(f.signal, 0);
  EXPECT_TRUE(attempt_->Drained());
}

// A SIGKILL from outside on another host is still blamed over the silent rank's peers.
TEST_F(AttemptTest, ASigkillOnAnotherHostThanTheSilentOneIsStillACause) {
  opts_.plan.workers[0].host = "host-a";
  opts_.plan.workers[1].host = "host-b";
  Start();
  RegisterAll();
  processes_.IgnoreSigterm();
  ranks_.Disconnect(1, /*timed_out=*/true);
  Turn();
  processes_.Exit(0, launch::ExitStatus{.signal = SIGKILL});
  Turn();
  EXPECT_EQ(Failure().rank, 0);
  EXPECT_EQ(Failure().cause, FailureCause::kSignal);
}

TEST_F(AttemptTest, AClosedConnectionTellsTheGroupNothingOfItsHost) {
  Start();
  RegisterAll();
  ranks_.Disconnect(1);
  Turn();
  EXPECT_EQ(Failure().cause, FailureCause::kConnection);
  EXPECT_NE(Failure().message.find("closed before"), std::string::npos) << Failure().message;
  EXPECT_TRUE(processes_.unreachable().empty());
}

// A SIGKILL the controller did not send is the cause, over the peer that noticed the loss first.
TEST_F(AttemptTest, SigkillFromOutsideIsBlamedOverAPeersError) {
  Start();
  RegisterAll();
  processes_.Die(1, {.signal = SIGKILL});
  ranks_.Deliver(0, MessageType::kError, json{{"message", "peer lost"}, {"traceback", ""}}.dump());
  Turn();
  const RankFailure& f = Failure();
  EXPECT_EQ(f.rank, 1);
  EXPECT_TRUE(f.cause == FailureCause::kSignal || f.cause == FailureCause::kOom);
  EXPECT_EQ(f.signal, SIGKILL);
  EXPECT_NE(f.message.find("rank 0 failed meanwhile: peer lost"), std::string::npos) << f.message;
}

// The stop's own SIGKILL (after the grace period) blames nobody anew.
TEST_F(AttemptTest, OurSigkillAfterTheGracePeriodKeepsTheFirstFailure) {
  Start();
  RegisterAll();
  processes_.IgnoreSigterm();
  ranks_.Deliver(0, MessageType::kError, json{{"message", "boom"}, {"traceback", ""}}.dump());
  Turn();
  EXPECT_FALSE(attempt_->Drained());
  clock_.Advance(opts_.terminate_grace);
  attempt_->CheckTimers();
  EXPECT_EQ(processes_.signals(SIGKILL), 1);
  Turn();
  const RankFailure& f = Failure();
  EXPECT_EQ(f.rank, 0);
  EXPECT_EQ(f.cause, FailureCause::kException);
  EXPECT_EQ(f.message, "boom");
  EXPECT_TRUE(attempt_->Drained());
}

TEST_F(AttemptTest, ExitBeforeRegisteringIsAStartUpFailure) {
  Start();
  Register(0);
  processes_.Exit(1, 1);
  Turn();
  const RankFailure& f = Failure();
  EXPECT_EQ(f.rank, 1);
  EXPECT_EQ(f.cause, FailureCause::kStartUp);
  EXPECT_EQ(f.exit_code, 1);
  EXPECT_EQ(run_.trainings_started, 0);
}

TEST_F(AttemptTest, StartUpTimeoutBlamesTheFirstRankMissing) {
  Start();
  Register(0);
  Turn();
  attempt_->CheckTimers();
  EXPECT_FALSE(attempt_->failure().has_value());
  ASSERT_TRUE(attempt_->NextDeadline(/*commit_in_flight=*/false).has_value());
  clock_.Advance(opts_.start_timeout);
  attempt_->CheckTimers();
  const RankFailure& f = Failure();
  EXPECT_EQ(f.rank, 1);
  EXPECT_EQ(f.cause, FailureCause::kStartUp);
  EXPECT_EQ(attempt_->phase(), Attempt::Phase::kStopping);
  ASSERT_TRUE(attempt_->failed_at().has_value());
  json record = attempt_->Record("ERRORED");
  EXPECT_EQ(record["failure"]["cause"], FailureCauseName(FailureCause::kStartUp));
  EXPECT_TRUE(record.contains("end_time"));
}

TEST_F(AttemptTest, BadFrameIsAProtocolErrorAndClosesTheConnection) {
  Start();
  RegisterAll();
  ranks_.Deliver(1, MessageType::kRegister, "{not json");
  Turn();
  const RankFailure& f = Failure();
  EXPECT_EQ(f.rank, 1);
  EXPECT_EQ(f.cause, FailureCause::kConnection);
  EXPECT_EQ(f.message.rfind("protocol error: ", 0), 0u) << f.message;
  EXPECT_FALSE(port_.connected(1));
}

// Stop() (an abort) fails nobody: the ranks' ends by its signals are the stop's.
TEST_F(AttemptTest, StopSignalsTheGroupAndBlamesNobody) {
  Start();
  RegisterAll();
  attempt_->Stop();
  EXPECT_EQ(attempt_->phase(), Attempt::Phase::kStopping);
  Turn();
  EXPECT_FALSE(attempt_->failure().has_value());
  EXPECT_EQ(processes_.signals(SIGTERM), 1);
  EXPECT_TRUE(attempt_->Drained());
}

// A rank that fails right after reports that another rank has not sent yet (its report() has
// returned, its part is still being staged): the group goes on until those rounds are complete,
// so that they are recorded (and their checkpoints committed), and is stopped then. The failed
// rank's own exit and closed connection do not cut the wait short.
TEST_F(AttemptTest, RoundsAFailedRankReportedAreCompletedBeforeTheGroupIsStopped) {
  Start(/*number=*/3, /*first_round=*/5);
  RegisterAll();
  ReportRound();
  ranks_.Deliver(0, MessageType::kReport, wire::EncodeReportBody(0, R"({"loss": 1})"));
  ranks_.Deliver(0, MessageType::kReport, wire::EncodeReportBody(0, R"({"loss": 2})"));
  ranks_.Deliver(0, MessageType::kError, json{{"message", "boom"}, {"traceback", ""}}.dump());
  Turn();
  EXPECT_EQ(Failure().rank, 0);
  EXPECT_EQ(attempt_->phase(), Attempt::Phase::kRunning);
  EXPECT_EQ(processes_.signals(SIGTERM), 0);
  ASSERT_TRUE(attempt_->NextDeadline(/*commit_in_flight=*/false).has_value());
  EXPECT_EQ(*attempt_->NextDeadline(false), clock_.Now() + opts_.finish_rounds_timeout);
  processes_.Exit(0, 1);
  ranks_.Disconnect(0);
  Turn();
  EXPECT_EQ(processes_.signals(SIGTERM), 0);
  ranks_.Deliver(1, MessageType::kReport, wire::EncodeReportBody(0, R"({"loss": 1})"));
  Turn();
  EXPECT_EQ(run_.rounds, (std::vector<uint64_t>{5, 6}));
  EXPECT_EQ(processes_.signals(SIGTERM), 0);
  ranks_.Deliver(1, MessageType::kReport, wire::EncodeReportBody(0, R"({"loss": 2})"));
  Turn();
  EXPECT_EQ(run_.rounds, (std::vector<uint64_t>{5, 6, 7}));
  EXPECT_EQ(attempt_->phase(), Attempt::Phase::kStopping);
  EXPECT_EQ(processes_.signals(SIGTERM), 1);
  const RankFailure& f = Failure();
  EXPECT_EQ(f.rank, 0);
  EXPECT_EQ(f.cause, FailureCause::kException);
  EXPECT_EQ(f.message, "boom");
  Turn();
  EXPECT_TRUE(attempt_->Drained());
}

// The wait for a failed rank's rounds is bounded: at the deadline the group is stopped, and the
// line says which rounds are lost and who did not report them.
TEST_F(AttemptTest, RoundsOfAFailedRankThatTheOthersDoNotReportInTimeAreGivenUp) {
  Start(/*number=*/3, /*first_round=*/5);
  RegisterAll();
  ranks_.Deliver(1, MessageType::kReport, wire::EncodeReportBody(0, R"({"loss": 1})"));
  ranks_.Deliver(1, MessageType::kError, json{{"message", "boom"}, {"traceback", ""}}.dump());
  Turn();
  attempt_->CheckTimers();
  EXPECT_EQ(processes_.signals(SIGTERM), 0);
  clock_.Advance(opts_.finish_rounds_timeout);
  attempt_->CheckTimers();
  EXPECT_EQ(processes_.signals(SIGTERM), 1);
  EXPECT_TRUE(run_.rounds.empty());
  ASSERT_FALSE(run_.said.empty());
  EXPECT_NE(run_.said.back().find("without round 5, which rank 1 reported"), std::string::npos)
      << run_.said.back();
  EXPECT_NE(run_.said.back().find("rank(s) 0 on host-0 did not report it within 30 s"),
            std::string::npos)
      << run_.said.back();
  EXPECT_EQ(Failure().rank, 1);
}

// Another rank's failure during the wait, or its return without the rounds, stops the group at
// once: those rounds cannot be completed any more.
TEST_F(AttemptTest, AnotherRankFailingWhileAFailedRanksRoundsAreAwaitedStopsTheGroup) {
  Start();
  RegisterAll();
  ranks_.Deliver(1, MessageType::kReport, wire::EncodeReportBody(0, R"({"loss": 1})"));
  ranks_.Deliver(1, MessageType::kError, json{{"message", "boom"}, {"traceback", ""}}.dump());
  Turn();
  EXPECT_EQ(processes_.signals(SIGTERM), 0);
  ranks_.Deliver(0, MessageType::kError, json{{"message", "peer lost"}, {"traceback", ""}}.dump());
  Turn();
  EXPECT_EQ(processes_.signals(SIGTERM), 1);
  EXPECT_EQ(Failure().rank, 1);
  EXPECT_EQ(Failure().message, "boom");
}

TEST_F(AttemptTest, ARankReturningWithoutAFailedRanksRoundsStopsTheGroup) {
  Start();
  RegisterAll();
  ranks_.Deliver(1, MessageType::kReport, wire::EncodeReportBody(0, R"({"loss": 1})"));
  ranks_.Deliver(1, MessageType::kError, json{{"message", "boom"}, {"traceback", ""}}.dump());
  Turn();
  EXPECT_EQ(processes_.signals(SIGTERM), 0);
  ranks_.Deliver(0, MessageType::kDone, "{}");
  Turn();
  EXPECT_EQ(processes_.signals(SIGTERM), 1);
  EXPECT_TRUE(run_.rounds.empty());
}

// A failure that leaves every reported round complete stops the group at once.
TEST_F(AttemptTest, AFailureWithNoRoundOwedStopsTheGroupAtOnce) {
  Start();
  RegisterAll();
  ReportRound();
  ranks_.Deliver(1, MessageType::kError, json{{"message", "boom"}, {"traceback", ""}}.dump());
  Turn();
  EXPECT_EQ(processes_.signals(SIGTERM), 1);
}

// An elastic run that can grow stops the group on purpose at the next checkpoint committed
// after the request, holding back the ranks that reported it; the attempt ends without a failure.
TEST_F(AttemptTest, AResizeStopsTheGroupAtTheNextCommittedCheckpointWithoutAFailure) {
  Start(/*number=*/3, /*first_round=*/5);
  RegisterAll();
  ReportRound();
  ASSERT_EQ(attempt_->next_round(), 6u);
  attempt_->RequestResize("host host2 can be reached again");
  attempt_->OnRecorded(5, "checkpoint_000005");  // reported before the request: goes on
  attempt_->OnSettled(0, 5);
  EXPECT_EQ(attempt_->phase(), Attempt::Phase::kRunning);
  EXPECT_TRUE(ranks_.WaitForSent(3, 0, MessageType::kCheckpointSettled, 0s).has_value());
  attempt_->OnSettled(0, 6);  // reported after it: held back until the group stops
  EXPECT_FALSE(ranks_.WaitForSent(3, 0, MessageType::kCheckpointSettled, 0s, 2).has_value());
  attempt_->OnRecorded(6, "");  // no checkpoint: goes on
  EXPECT_EQ(attempt_->phase(), Attempt::Phase::kRunning);
  attempt_->OnRecorded(7, "checkpoint_000007");
  EXPECT_EQ(attempt_->phase(), Attempt::Phase::kStopping);
  EXPECT_TRUE(attempt_->resized());
  EXPECT_EQ(processes_.signals(SIGTERM), 1);
  Turn();
  EXPECT_FALSE(attempt_->failure().has_value());
  EXPECT_TRUE(attempt_->Drained());
  EXPECT_EQ(attempt_->Record("RESIZED")["world_size"], kWorkers);
}

}  // namespace
}  // namespace jaxtrain::controller
