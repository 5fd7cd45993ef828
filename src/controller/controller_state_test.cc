// The controller's run state machine — attempts, restarts, failure budgets, the grace period, the
// watchdog — driven through fakes of its edges: the ranks' connections (FakeConnections), their
// processes (FakeProcesses) and the time (FakeClock, which wakes the loop when advanced). No
// process, socket or sleep: each test says exactly what the ranks do and in which order, and
// waits only for what the controller does in answer. The run directory is real.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "controller/controller.h"
#include "controller/testing/cpu_plan.h"
#include "controller/testing/fake_control_port.h"
#include "controller/testing/fake_worker_group.h"
#include "controller/testing/hosts_launcher.h"
#include "storage/checkpoint.h"
#include "storage/files.h"
#include "wire/frame.h"
#include "wire/handshake.h"
#include "wire/messages.h"

namespace jaxtrain::controller {
namespace {

using nlohmann::json;
using State = Outcome::State;
using wire::MessageType;
using namespace std::chrono_literals;

constexpr auto kNoHang = 30s;  // bounds every wait, so that a bug fails a test instead of hanging

// The processes are FakeProcesses': the launchers start none (testing/hosts_launcher.h). This one's
// Launch() waits in a queue (Kueue): what it says it waited.
class QueuingLauncher : public UnusedLauncher {
 public:
  QueuingLauncher(std::atomic<int>& interrupts, double wait)
      : UnusedLauncher(interrupts), wait_(wait) {}
  double QueueWait() const override { return wait_; }
  bool MayQueue() const override { return true; }

 private:
  double wait_;
};

class ControllerStateTest : public testing::Test {
 protected:
  void SetUp() override {
    std::string dir = testing::TempDir() + "/controller_state_test.XXXXXX";
    ASSERT_NE(mkdtemp(dir.data()), nullptr);
    dir_ = dir;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  ControllerOptions Options(int workers) {
    ControllerOptions options;
    options.run_dir = RunDir();
    options.experiment_name = "state_test";
    options.plan = CpuPlan(workers);
    options.worker_argv = {"/nonexistent/worker"};
    options.console_fd = -1;
    options.terminate_grace = 5s;
    options.start_timeout = 60s;
    return options;
  }

  std::unique_ptr<Controller> Start(ControllerOptions options,
                                    std::unique_ptr<launch::Launcher> launcher = nullptr) {
    if (launcher == nullptr) launcher = std::make_unique<UnusedLauncher>(interrupts_);
    auto controller = std::make_unique<Controller>(
        std::move(options), std::move(launcher), clock_,
        ControllerSeams{.open_port = ranks_.Opener(), .make_group = processes_.Maker()});
    Status s = controller->Start();
    EXPECT_TRUE(s.ok()) << s.ToString();
    return controller;
  }

  // An elastic run of (2, 4) on host1 and host2, 2 workers each (docs/elastic.md).
  ControllerOptions ElasticOnTwoHosts(Duration host_wait) {
    ControllerOptions options = Options(4);
    options.plan = TwoPerHost(4, {"host1", "host2"});
    options.elastic =
        ElasticOptions{.min_workers = 2,
                       .monitor_interval = 1ms,
                       .host_wait = host_wait,
                       .plan_on = [](const std::vector<std::string>& hosts, int workers) {
                         return StatusOr<placement::Plan>(TwoPerHost(workers, hosts));
                       }};
    return options;
  }

  // Rounds with checkpoints by `ranks` of `attempt` until the group is stopped to resize (the
  // ranks of the round at which it stops are not told to go on); the last round.
  uint64_t CheckpointUntilStopped(int attempt, const std::vector<int>& ranks) {
    const int terms = processes_.signals(SIGTERM);
    const auto deadline = std::chrono::steady_clock::now() + kNoHang;
    uint64_t round = 0;
    while (processes_.signals(SIGTERM) == terms) {
      EXPECT_LT(std::chrono::steady_clock::now(), deadline) << "the run never resized";
      if (std::chrono::steady_clock::now() >= deadline) break;
      ++round;
      for (int rank : ranks) ReportCheckpoint(attempt, rank, round);
      while (processes_.signals(SIGTERM) == terms &&
             !ranks_.WaitForSent(ranks.back(), 0, MessageType::kCheckpointSettled, 0s, round)) {
        if (std::chrono::steady_clock::now() >= deadline) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    return round;
  }

  // A controller of `workers` ranks with a 30 s progress watchdog, every rank registered.
  std::unique_ptr<Controller> StartWatched(int workers) {
    ControllerOptions options = Options(workers);
    options.progress_timeout = 30s;
    auto controller = Start(std::move(options));
    WaitForStart(1);
    RegisterAll(/*attempt=*/0, workers);
    return controller;
  }

  // Waits for the group's `start`-th start (1 = the first attempt).
  void WaitForStart(int start) {
    ASSERT_TRUE(processes_.WaitForStarts(start, kNoHang)) << "start " << start << " never came";
  }

  // Every rank of `attempt` registers (rank 0 publishing a coordinator); the kStart each gets.
  std::vector<json> RegisterAll(int attempt, int workers) {
    for (int rank = 0; rank < workers; ++rank) {
      json body = {{"host", "host-" + std::to_string(rank)},
                   {"coordinator", rank == 0 ? "127.0.0.1:8476" : ""}};
      ranks_.Deliver(rank, MessageType::kRegister, body.dump());
    }
    std::vector<json> starts;
    for (int rank = 0; rank < workers; ++rank) {
      auto start = ranks_.WaitForSent(attempt, rank, MessageType::kStart, kNoHang);
      EXPECT_TRUE(start.has_value()) << "rank " << rank << " got no start in attempt " << attempt;
      starts.push_back(start ? json::parse(start->body) : json());
    }
    return starts;
  }

  void Report(int rank, uint64_t round, json metrics) {
    ranks_.Deliver(rank, MessageType::kReport, wire::EncodeReportBody(round, metrics.dump()));
  }

  // `rank` stages one file as its part of round `round`'s checkpoint and reports it.
  // `copy_id`: the id of the part's copy in host memory, "" for none.
  // `rank` reports `round` with a part its host uploaded to object storage itself.
  void ReportStoredCheckpoint(int rank, uint64_t round) {
    json description = {
        {"store", true},
        {"files", {{{"path", "shard-" + std::to_string(rank)}, {"size", 3}, {"crc32c", 7}}}}};
    auto body =
        wire::EncodeCheckpointReportBody(round, description.dump(), json{{"round", round}}.dump());
    ASSERT_TRUE(body.ok());
    ranks_.Deliver(rank, MessageType::kReportCheckpoint, *body);
  }

  void ReportCheckpoint(int attempt, int rank, uint64_t round, const std::string& copy_id = "") {
    const std::string src = dir_ + "/src-" + std::to_string(rank);
    std::filesystem::create_directories(src);
    std::ofstream(src + "/shard-" + std::to_string(rank)) << "weights of rank " << rank;
    const std::string staging = storage::StagingPath(RunDir(), attempt, round, rank);
    auto files = storage::StageDirectory(src, staging);
    ASSERT_TRUE(files.ok()) << files.status().ToString();
    json description = {{"staging", staging}, {"files", json::array()}};
    if (!copy_id.empty()) description["copy_id"] = copy_id;
    for (const auto& f : *files) {
      description["files"].push_back(
          {{"path", f.path}, {"size", f.size}, {"crc32c", f.crc32c}, {"mode", f.mode}});
    }
    auto body =
        wire::EncodeCheckpointReportBody(round, description.dump(), json{{"round", round}}.dump());
    ASSERT_TRUE(body.ok());
    ranks_.Deliver(rank, MessageType::kReportCheckpoint, *body);
  }

  // `rank`'s training function returns and its process exits 0.
  void Finish(int rank) {
    ranks_.Deliver(rank, MessageType::kDone, "{}");
    processes_.Exit(rank, 0);
  }

  // `rank`'s training function raises.
  void Raise(int rank, const std::string& message) {
    ranks_.Deliver(rank, MessageType::kError,
                   json{{"message", message}, {"traceback", "Traceback: " + message}}.dump());
  }

  static const Outcome& WaitForOutcome(Controller& controller) {
    EXPECT_TRUE(controller.Wait(kNoHang)) << "the run did not end";
    return controller.outcome();
  }

  std::string RunDir() const { return dir_ + "/run"; }
  static std::string ReadAll(const std::string& path) {
    StatusOr<std::string> text = storage::ReadFile(path);
    return text.ok() ? *text : "";
  }
  json RunState() const {
    std::ifstream in(RunDir() + "/run.json");
    return json::parse(in, nullptr, false);
  }

  std::string dir_;
  std::atomic<int> interrupts_{0};  // Launcher::Interrupt() calls
  FakeClock clock_;
  FakeConnections ranks_;
  FakeProcesses processes_;
};

// Rank 1 fails right after its report of round 2, while rank 0's checkpoint of round 1 is still
// on its way and its round 2 waits for that commit (report(checkpoint=) does): the group is not
// stopped until both rounds are complete, their checkpoints are committed before the attempt
// ends, and the restart restores from round 2's.
TEST_F(ControllerStateTest, RoundsEveryRankReportedAreCommittedWhenARankFailsRightAfter) {
  ControllerOptions options = Options(2);
  options.max_failures = 1;
  auto controller = Start(std::move(options));
  WaitForStart(1);
  RegisterAll(/*attempt=*/0, 2);
  Report(1, 1, {{"step", 0}});
  Report(1, 2, {{"step", 1}});
  Raise(1, "injected right after its report");
  processes_.Exit(1, 1);
  ReportCheckpoint(/*attempt=*/0, 0, /*round=*/1);
  ASSERT_TRUE(ranks_.WaitForSent(0, 0, MessageType::kCheckpointSettled, kNoHang))
      << "round 1 was not committed";
  EXPECT_EQ(processes_.signals(SIGTERM), 0) << "the group was stopped before round 2";
  ReportCheckpoint(/*attempt=*/0, 0, /*round=*/2);

  WaitForStart(2);
  EXPECT_EQ(processes_.signals(SIGTERM), 1);
  std::vector<json> second = RegisterAll(/*attempt=*/1, 2);
  EXPECT_EQ(second[0]["checkpoint"], RunDir() + "/checkpoint_000002");
  EXPECT_EQ(second[0]["first_round"], 3);
  for (int rank : {0, 1}) Finish(rank);
  const Outcome& out = WaitForOutcome(*controller);
  EXPECT_EQ(out.state, State::kSucceeded);
  ASSERT_EQ(out.failures.size(), 1u);
  EXPECT_EQ(out.failures[0].rank, 1);
  EXPECT_EQ(out.failures[0].cause, FailureCause::kException);
  const std::string results = ReadAll(RunDir() + "/result.jsonl");
  EXPECT_NE(results.find(R"("round":1,)"), std::string::npos) << results;
  EXPECT_NE(results.find(R"("checkpoint":"checkpoint_000002")"), std::string::npos) << results;
}

TEST_F(ControllerStateTest, ARankKilledBySignalRestartsTheGroupFromTheLatestCommittedCheckpoint) {
  ControllerOptions options = Options(2);
  options.max_failures = 1;
  auto controller = Start(std::move(options));
  WaitForStart(1);
  std::vector<json> first = RegisterAll(/*attempt=*/0, 2);
  EXPECT_EQ(first[0]["attempt"], 0);
  EXPECT_TRUE(first[0]["checkpoint"].is_null());
  EXPECT_EQ(first[1]["coordinator"], "127.0.0.1:8476");
  EXPECT_TRUE(ranks_.WaitForSent(0, 1, MessageType::kPayload, kNoHang).has_value());

  ReportCheckpoint(/*attempt=*/0, 0, /*round=*/1);
  ReportCheckpoint(/*attempt=*/0, 1, /*round=*/1);
  for (int rank : {0, 1}) {  // the commit has ended: its ranks are told
    ASSERT_TRUE(ranks_.WaitForSent(0, rank, MessageType::kCheckpointSettled, kNoHang));
  }
  processes_.Kill(1, SIGSEGV);

  WaitForStart(2);
  EXPECT_GE(processes_.signals(SIGTERM), 1) << "the rest of the group was not stopped";
  std::vector<json> second = RegisterAll(/*attempt=*/1, 2);
  EXPECT_EQ(second[1]["attempt"], 1);
  EXPECT_EQ(second[1]["checkpoint"], RunDir() + "/checkpoint_000001");
  for (int rank : {0, 1}) Report(rank, 2, {{"loss", 0.5}, {"rank", rank}});
  for (int rank : {0, 1}) Finish(rank);

  const Outcome& out = WaitForOutcome(*controller);
  EXPECT_EQ(out.state, State::kSucceeded);
  EXPECT_EQ(out.attempts, 2);
  EXPECT_EQ(out.rounds, 2u);
  EXPECT_EQ(json::parse(out.last_metrics_json)["rank"], 0);
  ASSERT_EQ(out.failures.size(), 1u);
  const RankFailure& f = out.failures[0];
  EXPECT_EQ(f.rank, 1);
  EXPECT_EQ(f.attempt, 0);
  EXPECT_EQ(f.cause, FailureCause::kSignal);
  EXPECT_EQ(f.signal, SIGSEGV);
  EXPECT_EQ(f.host, "host-1");
  EXPECT_TRUE(f.retried);
  json state = RunState();
  EXPECT_EQ(state["status"], "FINISHED");
  ASSERT_EQ(state["attempts"].size(), 2u);
  EXPECT_EQ(state["attempts"][0]["status"], "ERRORED");
  EXPECT_EQ(state["attempts"][0]["failure"]["cause"], "signal");
  EXPECT_EQ(state["attempts"][1]["restored_from"], RunDir() + "/checkpoint_000001");
}

// An attempt whose launch waits in a queue shows as queued in run.json while it waits, then
// records the wait as its queue_wait_s (goodput's `queue`).
TEST_F(ControllerStateTest, RunJsonShowsAQueuedAttemptAndRecordsItsQueueWait) {
  json while_queued;
  std::string state_while_queued;
  // Made here, not by Start(), so that the launch (which Start() may run itself) can read it.
  auto controller = std::make_unique<Controller>(
      Options(2), std::make_unique<QueuingLauncher>(interrupts_, 7.5), clock_,
      ControllerSeams{.open_port = ranks_.Opener(), .make_group = processes_.Maker()});
  processes_.OnNextStart([&] {
    while_queued = RunState();
    state_while_queued = controller->metrics().state;
    return OkStatus();
  });
  ASSERT_TRUE(controller->Start().ok());
  WaitForStart(1);
  ASSERT_EQ(while_queued["attempts"].size(), 1u) << while_queued.dump();
  EXPECT_EQ(while_queued["attempts"][0].value("phase", ""), "queued");
  EXPECT_EQ(while_queued["attempts"][0]["status"], "RUNNING");
  EXPECT_EQ(state_while_queued, "QUEUED");  // jaxtrain_run_state{state="QUEUED"}
  RegisterAll(/*attempt=*/0, 2);
  for (int rank : {0, 1}) Finish(rank);
  EXPECT_EQ(WaitForOutcome(*controller).state, State::kSucceeded);
  json state = RunState();
  ASSERT_EQ(state["attempts"].size(), 1u) << state.dump();
  EXPECT_FALSE(state["attempts"][0].contains("phase"));
  EXPECT_EQ(state["attempts"][0].value("queue_wait_s", 0.0), 7.5);
  // The driver's own queue wait (a Slurm allocation before the run) is the run's, not this.
  EXPECT_EQ(state.value("queue_wait_s", -1.0), 0.0);
}

// The times goodput accounting splits a run by (python/jaxtrain/goodput.py): the run's queue
// wait, each attempt's start, the moment every rank had registered, when its failure was noticed
// and when every rank's function had returned.
TEST_F(ControllerStateTest, RunJsonRecordsWhenEachAttemptWasReadyAndWhenItFailed) {
  ControllerOptions options = Options(2);
  options.max_failures = 1;
  options.queue_wait_s = 12.5;
  auto controller = Start(std::move(options));
  WaitForStart(1);
  clock_.Advance(3s);
  RegisterAll(/*attempt=*/0, 2);
  clock_.Advance(2s);
  for (int rank : {0, 1}) ReportCheckpoint(/*attempt=*/0, rank, /*round=*/1);
  for (int rank : {0, 1}) {
    ASSERT_TRUE(ranks_.WaitForSent(0, rank, MessageType::kCheckpointSettled, kNoHang));
  }
  // The ranks hear of the commit just before the round is recorded, on the loop's thread.
  const auto deadline = std::chrono::steady_clock::now() + kNoHang;
  auto recorded = [this] {
    std::error_code missing;
    const auto size = std::filesystem::file_size(RunDir() + "/result.jsonl", missing);
    return !missing && size > 0;
  };
  while (!recorded()) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "round 1 was never recorded";
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  clock_.Advance(4s);
  processes_.Kill(1, SIGKILL);
  WaitForStart(2);
  clock_.Advance(1s);
  RegisterAll(/*attempt=*/1, 2);
  clock_.Advance(2s);
  for (int rank : {0, 1}) Finish(rank);
  EXPECT_EQ(WaitForOutcome(*controller).state, State::kSucceeded);

  json state = RunState();
  const double t0 = state.value("start_time", 0.0);
  EXPECT_EQ(state.value("queue_wait_s", 0.0), 12.5);
  ASSERT_EQ(state["attempts"].size(), 2u) << state.dump();
  const json& failed = state["attempts"][0];
  EXPECT_DOUBLE_EQ(failed.value("start_time", 0.0), t0);
  EXPECT_DOUBLE_EQ(failed.value("ready_time", 0.0), t0 + 3);
  EXPECT_DOUBLE_EQ(failed["failure"].value("time", 0.0), t0 + 9);
  EXPECT_DOUBLE_EQ(failed.value("end_time", 0.0), t0 + 9);
  const json& restarted = state["attempts"][1];
  EXPECT_DOUBLE_EQ(restarted.value("start_time", 0.0), t0 + 9);
  EXPECT_DOUBLE_EQ(restarted.value("ready_time", 0.0), t0 + 10);
  // When the last rank's function returned: the end of training, before the group's shutdown.
  EXPECT_DOUBLE_EQ(restarted.value("returned_time", 0.0), t0 + 12);
  EXPECT_FALSE(failed.contains("returned_time")) << failed.dump();
  EXPECT_FALSE(restarted.contains("failure")) << restarted.dump();
  std::ifstream rounds(RunDir() + "/result.jsonl");
  std::string line;
  ASSERT_TRUE(std::getline(rounds, line));
  EXPECT_DOUBLE_EQ(json::parse(line).value("time", 0.0), t0 + 5);
}

// The outcome carries run.json and rank 0's return value as the run directory has them at the end:
// fit() builds its Result from them without reading them back.
TEST_F(ControllerStateTest, TheOutcomeCarriesRunJsonAndTheReturnValueAsTheRunDirectoryHasThem) {
  auto controller = Start(Options(2));
  WaitForStart(1);
  RegisterAll(/*attempt=*/0, 2);
  ranks_.Deliver(0, MessageType::kDone, json{{"return_value", wire::ToHex("pickled")}}.dump());
  processes_.Exit(0, 0);
  Finish(1);
  const Outcome& out = WaitForOutcome(*controller);
  EXPECT_EQ(out.state, State::kSucceeded);
  EXPECT_EQ(out.run_state, RunState());
  EXPECT_EQ(out.run_state["status"], "FINISHED");
  EXPECT_EQ(out.return_value, "pickled");
  std::ifstream file(RunDir() + "/return_value.pkl");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(file), {}), "pickled");
}

// The checkpoint a restart names when the latest one's contents no longer match its checksums
// (same sizes): the one before it, unless every part of it has its copy in the host's memory
// store, where its ranks restore from (sizes are checked then).
class RestartVerificationTest : public ControllerStateTest {
 public:
  std::string RestartsFromAfterCorruption(const std::vector<int>& held_ranks) {
    const std::string store = dir_ + "/store";
    std::filesystem::create_directories(store);
    std::filesystem::permissions(store, std::filesystem::perms::owner_all);
    ControllerOptions options = Options(2);
    options.max_failures = 1;
    options.memory_store = store;
    auto controller = Start(std::move(options));
    WaitForStart(1);
    RegisterAll(/*attempt=*/0, 2);
    for (uint64_t round : {1, 2}) {
      for (int rank : {0, 1}) {
        const std::string id = "r" + std::to_string(round) + "-" + std::to_string(rank);
        ReportCheckpoint(/*attempt=*/0, rank, round, id);
        if (std::count(held_ranks.begin(), held_ranks.end(), rank) != 0) {
          const std::string copy = store + "/rank" + std::to_string(rank);
          std::filesystem::create_directories(copy);
          std::ofstream(copy + "/a0-r" + std::to_string(round) + ".json") << json{{"id", id}};
        }
      }
      for (int rank : {0, 1}) {
        EXPECT_TRUE(ranks_.WaitForSent(0, rank, MessageType::kCheckpointSettled, kNoHang, round));
      }
    }
    std::ofstream(RunDir() + "/checkpoint_000002/shard-0") << "WEIGHTS of rank 0";  // same size
    processes_.Kill(1, SIGKILL);
    WaitForStart(2);
    std::vector<json> second = RegisterAll(/*attempt=*/1, 2);
    controller->Abort("done");
    WaitForOutcome(*controller);
    // The ranks are told when checksums were skipped: one that reads storage checks them.
    EXPECT_EQ(second[0].value("checkpoint_checksums_skipped", false), held_ranks.size() == 2);
    return second[0]["checkpoint"];
  }
};

TEST_F(ControllerStateTest, PartsInTheStoreCommitAManifestAndARestartIsToldWhereRoundsGoOn) {
  ControllerOptions options = Options(2);
  options.max_failures = 1;
  auto controller = Start(std::move(options));
  WaitForStart(1);
  std::vector<json> first = RegisterAll(/*attempt=*/0, 2);
  EXPECT_EQ(first[0]["first_round"], 1);
  EXPECT_EQ(first[0]["committed"], json::array());
  for (int rank : {0, 1}) Report(rank, 1, {{"loss", 1.0}});
  for (int rank : {0, 1}) ReportStoredCheckpoint(rank, 2);
  for (int rank : {0, 1}) {
    ASSERT_TRUE(ranks_.WaitForSent(0, rank, MessageType::kCheckpointSettled, kNoHang));
  }
  for (int rank : {0, 1}) Report(rank, 3, {{"loss", 0.5}});  // a round the restart does not undo
  processes_.Kill(1, SIGKILL);
  WaitForStart(2);
  std::vector<json> second = RegisterAll(/*attempt=*/1, 2);
  // The checkpoint's files are in the store: here only its manifest, which the restart accepts.
  EXPECT_EQ(second[0]["checkpoint"], RunDir() + "/checkpoint_000002");
  EXPECT_EQ(second[0]["first_round"], 4);
  EXPECT_EQ(second[0]["committed"], json::array({"checkpoint_000002"}));
  controller->Abort("done");
  WaitForOutcome(*controller);
  json manifest = json::parse(
      std::ifstream(RunDir() + "/checkpoint_000002/" + std::string(storage::kManifestName)),
      nullptr, false);
  EXPECT_EQ(manifest["location"], "store");
  EXPECT_EQ(manifest["file_list"].size(), 2u);
}

TEST_F(RestartVerificationTest, ARestartChecksOnlySizesWhenEveryPartHasItsCopyInHostMemory) {
  EXPECT_EQ(RestartsFromAfterCorruption({0, 1}), RunDir() + "/checkpoint_000002");
}

TEST_F(RestartVerificationTest, ARestartChecksChecksumsWhenAPartHasNoCopyInHostMemory) {
  EXPECT_EQ(RestartsFromAfterCorruption({1}), RunDir() + "/checkpoint_000001");
}

TEST_F(ControllerStateTest, ACheckpointWithAMalformedCopyIdIsAProtocolErrorOfItsRank) {
  auto controller = Start(Options(2));
  WaitForStart(1);
  RegisterAll(/*attempt=*/0, 2);
  ReportCheckpoint(/*attempt=*/0, 1, /*round=*/1, "../elsewhere");
  const Outcome& out = WaitForOutcome(*controller);
  EXPECT_EQ(out.state, State::kFailed);
  ASSERT_EQ(out.failures.size(), 1u);
  EXPECT_EQ(out.failures[0].rank, 1);
  EXPECT_EQ(out.failures[0].message,
            "protocol error: malformed message of type 10 (report with checkpoint): copy_id is "
            "\"../elsewhere\", not 1 to 64 letters, digits and '-'");
}

TEST_F(ControllerStateTest, ARestartCreatesNoLogForSilentRanksAndTheRunsEndHeadsThemAll) {
  ControllerOptions options = Options(3);
  options.max_failures = 1;
  auto controller = Start(std::move(options));
  WaitForStart(1);
  RegisterAll(/*attempt=*/0, 3);
  processes_.Kill(1, SIGKILL);  // no rank printed anything
  WaitForStart(2);
  RegisterAll(/*attempt=*/1, 3);
  const std::string logs = RunDir() + "/logs/rank-";
  // The failed rank's log holds its attempt's header (its tail is the failure's); the silent
  // ranks have none yet.
  EXPECT_EQ(ReadAll(logs + "1.log"), "===== jaxtrain: attempt 0 =====\n");
  EXPECT_FALSE(std::filesystem::exists(logs + "0.log"));
  EXPECT_FALSE(std::filesystem::exists(logs + "2.log"));
  for (int rank : {0, 1, 2}) Finish(rank);
  EXPECT_EQ(WaitForOutcome(*controller).state, State::kSucceeded);
  for (int rank : {0, 1, 2}) {
    EXPECT_EQ(ReadAll(logs + std::to_string(rank) + ".log"),
              "===== jaxtrain: attempt 0 =====\n===== jaxtrain: attempt 1 =====\n");
  }
}

TEST_F(ControllerStateTest, TrainingFailuresAreRestartedUntilMaxFailuresIsSpentThenTheRunRaises) {
  ControllerOptions options = Options(2);
  options.max_failures = 2;
  auto controller = Start(std::move(options));
  for (int attempt = 0; attempt < 3; ++attempt) {
    WaitForStart(attempt + 1);
    RegisterAll(attempt, 2);
    Raise(attempt % 2, "failure " + std::to_string(attempt));
  }

  const Outcome& out = WaitForOutcome(*controller);
  EXPECT_EQ(out.state, State::kFailed);
  EXPECT_EQ(out.attempts, 3);
  EXPECT_EQ(processes_.starts(), 3);
  ASSERT_EQ(out.failures.size(), 3u);
  for (int attempt = 0; attempt < 3; ++attempt) {
    const RankFailure& f = out.failures[static_cast<size_t>(attempt)];
    EXPECT_EQ(f.attempt, attempt);
    EXPECT_EQ(f.rank, attempt % 2);
    EXPECT_EQ(f.cause, FailureCause::kException);
    EXPECT_EQ(f.message, "failure " + std::to_string(attempt));
    EXPECT_EQ(f.retried, attempt < 2) << "attempt " << attempt << ": " << f.decision;
  }
  ASSERT_TRUE(out.failure.has_value());
  EXPECT_EQ(out.failure->message, "failure 0");  // the first failure is the run's
  EXPECT_EQ(RunState()["status"], "ERRORED");
}

TEST_F(ControllerStateTest, StartUpFailuresSpendTheirOwnBudgetNotMaxFailures) {
  ControllerOptions options = Options(2);
  options.max_failures = 0;
  options.max_start_failures = 1;
  auto controller = Start(std::move(options));
  WaitForStart(1);
  // Only rank 0 registers; rank 1 never connects.
  ranks_.Deliver(0, MessageType::kRegister, json{{"coordinator", "127.0.0.1:8476"}}.dump());
  ASSERT_TRUE(ranks_.WaitUntilHandled(kNoHang));
  clock_.Advance(61s);  // past the start-up timeout

  WaitForStart(2);  // restarted although max_failures is 0
  RegisterAll(/*attempt=*/1, 2);
  Raise(0, "a training failure");  // max_failures = 0: not restarted

  const Outcome& out = WaitForOutcome(*controller);
  EXPECT_EQ(out.state, State::kFailed);
  EXPECT_EQ(processes_.starts(), 2);
  ASSERT_EQ(out.failures.size(), 2u);
  EXPECT_EQ(out.failures[0].cause, FailureCause::kStartUp);
  EXPECT_EQ(out.failures[0].rank, 1);  // the rank that did not register is named
  EXPECT_TRUE(out.failures[0].retried);
  EXPECT_NE(out.failures[0].message.find("start-up timeout"), std::string::npos);
  EXPECT_EQ(out.failures[1].cause, FailureCause::kException);
  EXPECT_FALSE(out.failures[1].retried);
}

TEST_F(ControllerStateTest, WorkersThatIgnoreSigtermAreKilledOnlyWhenTheGracePeriodEnds) {
  processes_.IgnoreSigterm();
  auto controller = Start(Options(3));
  WaitForStart(1);
  RegisterAll(/*attempt=*/0, 3);
  Raise(2, "boom");

  ASSERT_TRUE(processes_.WaitForSignal(SIGTERM, 1, kNoHang));
  // Time has not moved: the grace period cannot have ended.
  EXPECT_EQ(processes_.signals(SIGKILL), 0);
  clock_.Advance(5s);
  ASSERT_TRUE(processes_.WaitForSignal(SIGKILL, 1, kNoHang));

  const Outcome& out = WaitForOutcome(*controller);
  EXPECT_EQ(out.state, State::kFailed);
  ASSERT_TRUE(out.failure.has_value());
  EXPECT_EQ(out.failure->rank, 2);  // the cause, not the SIGKILL that ended the group
  EXPECT_EQ(out.failure->cause, FailureCause::kException);
  EXPECT_EQ(out.failure->traceback, "Traceback: boom");
}

TEST_F(ControllerStateTest, TheWatchdogBlamesOnlyTheRankThatStoppedReporting) {
  auto controller = StartWatched(2);
  for (int rank : {0, 1}) Report(rank, 1, {{"rank", rank}});
  ASSERT_TRUE(ranks_.WaitUntilHandled(kNoHang));
  clock_.Advance(20s);
  Report(0, 2, {{"rank", 0}});  // rank 1 is stuck in round 2
  ASSERT_TRUE(ranks_.WaitUntilHandled(kNoHang));
  clock_.Advance(15s);  // rank 1: 35 s without a report; rank 0: 15 s
  ASSERT_TRUE(ranks_.WaitForSent(0, 1, MessageType::kPing, kNoHang));
  ranks_.Deliver(1, MessageType::kPong, "");  // alive: stuck, not stopped

  const Outcome& out = WaitForOutcome(*controller);
  EXPECT_EQ(out.state, State::kFailed);
  ASSERT_TRUE(out.failure.has_value());
  EXPECT_EQ(out.failure->cause, FailureCause::kWatchdog);
  EXPECT_EQ(out.failure->rank, 1);
  EXPECT_NE(out.failure->message.find("from rank(s) 1 on host-1, alive but stuck"),
            std::string::npos)
      << out.failure->message;
  EXPECT_EQ(out.rounds, 1u);
}

TEST_F(ControllerStateTest, RanksStaleTogetherArePingedAndTheOnesThatDoNotAnswerAreBlamed) {
  auto controller = StartWatched(3);
  for (int rank : {0, 1, 2}) Report(rank, 1, {{"rank", rank}});
  ASSERT_TRUE(ranks_.WaitUntilHandled(kNoHang));
  // Ranks 2 and 1 report round 2 at 5 s and 10 s, then stall; rank 0 goes on reporting.
  for (auto [advance, rank, round] : {std::tuple{5s, 2, 2}, {5s, 1, 2}, {10s, 0, 2}, {10s, 0, 3}}) {
    clock_.Advance(advance);
    Report(rank, static_cast<uint64_t>(round), {{"rank", rank}});
    ASSERT_TRUE(ranks_.WaitUntilHandled(kNoHang));
  }
  clock_.Advance(15s);  // at 45 s: rank 2 40 s without a report, rank 1 35 s; both are pinged
  for (int rank : {1, 2}) {
    ASSERT_TRUE(ranks_.WaitForSent(0, rank, MessageType::kPing, kNoHang)) << rank;
  }
  EXPECT_FALSE(ranks_.WaitForSent(0, 0, MessageType::kPing, std::chrono::seconds(0)));
  ranks_.Deliver(2, MessageType::kPong, "");  // rank 2 is alive (waiting); rank 1 is silent
  ASSERT_TRUE(ranks_.WaitUntilHandled(kNoHang));
  EXPECT_EQ(controller->metrics().state, "RUNNING");  // rank 1 may yet answer
  clock_.Advance(2s);

  const Outcome& out = WaitForOutcome(*controller);
  ASSERT_TRUE(out.failure.has_value());
  EXPECT_EQ(out.failure->cause, FailureCause::kWatchdog);
  EXPECT_EQ(out.failure->rank, 1);  // not rank 2, stale longer: it answered
  EXPECT_EQ(out.failure->host, "host-1");
  EXPECT_EQ(out.failure->message,
            "no report() for 30 s (the progress watchdog's limit) from rank(s) 1 on host-1; 2 on "
            "host-2; rank(s) 1 on host-1 did not answer a ping within 2 s: stopped (SIGSTOP), "
            "frozen or cut off; rank(s) 2 on host-2 answered");
}

TEST_F(ControllerStateTest, TheAutomaticLimitIsAMultipleOfTheStepTimeAndAtLeastItsFloor) {
  ControllerOptions options = Options(2);
  options.progress_auto = AutoLimit{.floor = 60s, .multiple = 10};
  auto controller = Start(std::move(options));
  WaitForStart(1);
  RegisterAll(/*attempt=*/0, 2);
  // Steps of 10 s: the limit becomes 100 s, over the floor.
  for (uint64_t round = 1; round <= 3; ++round) {
    for (int rank : {0, 1}) Report(rank, round, {{"rank", rank}});
    ASSERT_TRUE(ranks_.WaitUntilHandled(kNoHang));
    clock_.Advance(10s);
  }
  clock_.Advance(80s);  // 90 s since the last reports: over the floor, under the limit
  ASSERT_TRUE(ranks_.WaitUntilHandled(kNoHang));
  EXPECT_FALSE(ranks_.WaitForSent(0, 0, MessageType::kPing, std::chrono::seconds(0)));
  clock_.Advance(10s);
  for (int rank : {0, 1}) {
    ASSERT_TRUE(ranks_.WaitForSent(0, rank, MessageType::kPing, kNoHang)) << rank;
    ranks_.Deliver(rank, MessageType::kPong, "");
  }
  const Outcome& out = WaitForOutcome(*controller);
  ASSERT_TRUE(out.failure.has_value());
  EXPECT_EQ(out.failure->cause, FailureCause::kWatchdog);
  EXPECT_EQ(out.failure->message,
            "no report() for 100 s (the progress watchdog's automatic limit: 10 x the median step "
            "time (10 s), at least 60 s; FailureConfig(progress_timeout_s=...) sets another) from "
            "rank(s) 0 on host-0; 1 on host-1, alive but stuck");
}

TEST_F(ControllerStateTest, StacksOnDemandAreWrittenForEveryRankWithoutStoppingTheRun) {
  auto controller = StartWatched(2);
  for (int rank : {0, 1}) Report(rank, 1, {{"rank", rank}});
  ASSERT_TRUE(ranks_.WaitUntilHandled(kNoHang));
  std::optional<StatusOr<std::string>> taken;
  std::thread asker([&] { taken = controller->TakeStacks(kNoHang); });
  for (int rank : {0, 1}) {
    auto sent = ranks_.WaitForSent(0, rank, MessageType::kPing, kNoHang);
    ASSERT_TRUE(sent.has_value()) << rank;
    EXPECT_EQ(sent->body, "stacks");
  }
  ranks_.Deliver(
      0, MessageType::kPong,
      R"({"stacks":"Thread 0x0000000000000007 (most recent call first):\n","thread":7})");
  ranks_.Deliver(1, MessageType::kPong, "");  // a worker that cannot take stacks
  asker.join();
  ASSERT_TRUE(taken.has_value() && taken->ok()) << taken->status().ToString();
  EXPECT_EQ(**taken, RunDir() + "/stacks/attempt-0/live-1");
  auto rank0 = storage::ReadFile(**taken + "/rank-0.txt");
  auto rank1 = storage::ReadFile(**taken + "/rank-1.txt");
  ASSERT_TRUE(rank0.ok() && rank1.ok());
  EXPECT_NE(rank0->find("# report() calls in this attempt: 1\n"), std::string::npos) << *rank0;
  EXPECT_NE(rank0->find("Thread 0x0000000000000007 (most recent call first):"), std::string::npos);
  EXPECT_NE(rank1->find("(no stacks: its worker cannot take them)"), std::string::npos) << *rank1;
  EXPECT_EQ(controller->metrics().state, "RUNNING");
  controller->Abort("done");
  WaitForOutcome(*controller);
}

TEST_F(ControllerStateTest, AProfileIsAskedOfEveryRankIntoAFolderOfTheRunDirectory) {
  auto controller = StartWatched(2);
  for (int rank : {0, 1}) Report(rank, 1, {{"rank", rank}});
  ASSERT_TRUE(ranks_.WaitUntilHandled(kNoHang));
  EXPECT_EQ(controller->StartProfile(0, kNoHang).status().code(), StatusCode::kInvalidArgument);
  StatusOr<std::string> dir = controller->StartProfile(3, kNoHang);
  ASSERT_TRUE(dir.ok()) << dir.status().ToString();
  EXPECT_EQ(*dir, RunDir() + "/profiles/attempt-0/profile-1");
  EXPECT_TRUE(std::filesystem::is_directory(*dir));
  for (int rank : {0, 1}) {
    auto sent = ranks_.WaitForSent(0, rank, MessageType::kPing, kNoHang);
    ASSERT_TRUE(sent.has_value()) << rank;
    EXPECT_EQ(sent->body, "profile {\"dir\":\"" + *dir + "\",\"steps\":3}");
  }
  controller->Abort("done");
  WaitForOutcome(*controller);
}

TEST_F(ControllerStateTest, RanksStaleTogetherThatAllAnswerFailAtOnceBlamingTheStalest) {
  auto controller = StartWatched(2);
  Report(0, 1, {{"rank", 0}});
  ASSERT_TRUE(ranks_.WaitUntilHandled(kNoHang));
  clock_.Advance(5s);
  Report(1, 1, {{"rank", 1}});
  ASSERT_TRUE(ranks_.WaitUntilHandled(kNoHang));
  clock_.Advance(31s);
  for (int rank : {0, 1}) {
    ASSERT_TRUE(ranks_.WaitForSent(0, rank, MessageType::kPing, kNoHang)) << rank;
    ranks_.Deliver(rank, MessageType::kPong, "");
  }

  const Outcome& out = WaitForOutcome(*controller);  // no wait for the ping's deadline
  ASSERT_TRUE(out.failure.has_value());
  EXPECT_EQ(out.failure->rank, 0);
  EXPECT_EQ(out.failure->message,
            "no report() for 30 s (the progress watchdog's limit) from rank(s) 0 on host-0; 1 on "
            "host-1, alive but stuck");
}

TEST_F(ControllerStateTest, ASlowRankIsRecordedAsAStragglerAndEveryRanksStepTimeIsPublished) {
  auto controller = Start(Options(3));
  WaitForStart(1);
  clock_.Advance(2s);  // the group takes 2 s to register
  RegisterAll(/*attempt=*/0, 3);
  // The start is sent before the group start is timed: the clock moves on only after it.
  ASSERT_TRUE(ranks_.WaitUntilHandled(kNoHang));
  // Ranks 0 and 1 run ahead, a report every 100 ms; rank 2 reports every 400 ms, and each of its
  // reports completes a round.
  for (uint64_t round = 1; round <= 10; ++round) {
    clock_.Advance(100ms);
    for (int rank : {0, 1}) Report(rank, round, {{"rank", rank}});
    ASSERT_TRUE(ranks_.WaitUntilHandled(kNoHang));
  }
  for (uint64_t round = 1; round <= 10; ++round) {
    clock_.Advance(400ms);
    Report(2, round, {{"rank", 2}});
    ASSERT_TRUE(ranks_.WaitUntilHandled(kNoHang));
  }
  RunMetrics m = controller->metrics();
  EXPECT_EQ(m.state, "RUNNING");
  EXPECT_EQ(m.ranks_up, 3);
  EXPECT_EQ(m.reports, 30u);
  EXPECT_EQ(m.rounds, 10u);
  EXPECT_EQ(m.attempts_by_cause, (std::map<std::string, uint64_t>{{"start", 1}}));
  EXPECT_EQ(m.group_start.count, 1u);
  EXPECT_DOUBLE_EQ(m.group_start.last_s, 2.0);
  ASSERT_EQ(m.rank_step_s.size(), 3u);
  EXPECT_NEAR(*m.rank_step_s[0], 0.1, 1e-9);
  EXPECT_NEAR(*m.rank_step_s[2], 0.4, 1e-9);
  EXPECT_EQ(m.stragglers, (std::vector<int>{2}));
  // Said once, in run.json's attempt: rank 2's window of 5 intervals is full at its 6th report
  // (round 6), and round 8 is its third consecutive slow round.
  json events = RunState()["attempts"][0]["stragglers"];
  ASSERT_EQ(events.size(), 1u) << events.dump();
  EXPECT_EQ(events[0]["rank"], 2);
  EXPECT_EQ(events[0]["slow"], true);
  EXPECT_NEAR(events[0]["step_time_s"].get<double>(), 0.4, 1e-9);
  EXPECT_NEAR(events[0]["median_step_time_s"].get<double>(), 0.1, 1e-9);
  EXPECT_DOUBLE_EQ(events[0]["time"].get<double>(), clock_.UnixSeconds() - 0.8);
  // Every rank's step time, as of run.json's last write (the straggler's change, round 8).
  json step_times = RunState()["attempts"][0]["step_time_s"];
  ASSERT_EQ(step_times.size(), 3u) << step_times.dump();
  EXPECT_NEAR(step_times[0].get<double>(), 0.1, 1e-9);
  EXPECT_NEAR(step_times[2].get<double>(), 0.4, 1e-9);

  for (int rank : {0, 1, 2}) Finish(rank);
  EXPECT_EQ(WaitForOutcome(*controller).state, State::kSucceeded);
  EXPECT_EQ(controller->metrics().state, "FINISHED");
  EXPECT_EQ(RunState()["attempts"][0]["stragglers"].size(), 1u);  // kept when the attempt ends
}

// run.json's attempt carries every rank's step time, which reports refresh at most every 10 s
// (the dashboard shows it; docs/observability.md).
TEST_F(ControllerStateTest, RunJsonCarriesEveryRanksStepTimeRefreshedAtMostEvery10Seconds) {
  auto controller = Start(Options(2));
  WaitForStart(1);
  RegisterAll(/*attempt=*/0, 2);
  auto rounds = [&](uint64_t first, uint64_t last, std::chrono::seconds apart) {
    for (uint64_t round = first; round <= last; ++round) {
      clock_.Advance(apart);
      for (int rank : {0, 1}) Report(rank, round, {{"rank", rank}});
      ASSERT_TRUE(ranks_.WaitUntilHandled(kNoHang));
    }
  };
  auto step_times = [&] { return RunState()["attempts"][0]["step_time_s"]; };
  rounds(1, 3, 11s);
  EXPECT_EQ(step_times(), json::parse("[11.0, 11.0]"));
  rounds(4, 6, 1s);  // the median interval is 1 s now, but run.json was written 3 s ago
  EXPECT_EQ(step_times(), json::parse("[11.0, 11.0]"));
  rounds(7, 7, 10s);
  EXPECT_EQ(step_times(), json::parse("[1.0, 1.0]"));
  for (int rank : {0, 1}) Finish(rank);
  EXPECT_EQ(WaitForOutcome(*controller).state, State::kSucceeded);
  EXPECT_EQ(step_times(), json::parse("[1.0, 1.0]"));
}

TEST_F(ControllerStateTest, RestartsAreCountedByCauseAndTimedUntilTheNewGroupRegistered) {
  ControllerOptions options = Options(2);
  options.max_failures = 1;
  auto controller = Start(std::move(options));
  WaitForStart(1);
  RegisterAll(/*attempt=*/0, 2);
  processes_.Kill(1, SIGKILL);
  WaitForStart(2);
  EXPECT_EQ(controller->metrics().state, "RESTARTING");
  clock_.Advance(3s);
  RegisterAll(/*attempt=*/1, 2);
  ASSERT_TRUE(ranks_.WaitUntilHandled(kNoHang));
  RunMetrics m = controller->metrics();
  EXPECT_EQ(m.state, "RUNNING");
  EXPECT_EQ(m.attempt, 1);
  EXPECT_EQ(m.attempts_by_cause, (std::map<std::string, uint64_t>{{"start", 1}, {"signal", 1}}));
  EXPECT_EQ(m.restart.count, 1u);
  EXPECT_GE(m.restart.last_s, 3.0);  // the grace period may have moved the clock too
  EXPECT_EQ(m.group_start.count, 2u);
  controller->Abort("done");
  WaitForOutcome(*controller);
  EXPECT_EQ(controller->metrics().state, "ABORTED");
}

TEST_F(ControllerStateTest, AConnectionLostJustBeforeItsProcessDiedIsBlamedOnTheSignal) {
  auto controller = Start(Options(2));
  WaitForStart(1);
  RegisterAll(/*attempt=*/0, 2);
  // What a crash often looks like: the process is gone, its socket's close is seen first, and
  // its exit only after the controller has begun to stop the group.
  processes_.Die(0, {.signal = SIGABRT});
  ranks_.Disconnect(0);

  const Outcome& out = WaitForOutcome(*controller);
  EXPECT_EQ(out.state, State::kFailed);
  ASSERT_TRUE(out.failure.has_value());
  EXPECT_EQ(out.failure->rank, 0);
  EXPECT_EQ(out.failure->cause, FailureCause::kSignal);
  EXPECT_EQ(out.failure->signal, SIGABRT);
}

TEST_F(ControllerStateTest, AGroupThatCannotBeStartedAgainEndsTheRunSayingWhy) {
  ControllerOptions options = Options(2);
  options.max_failures = 3;
  auto controller = Start(std::move(options));
  WaitForStart(1);
  RegisterAll(/*attempt=*/0, 2);
  processes_.FailStarts(1, UnavailableError("host-1 does not answer"));
  Raise(1, "boom");

  const Outcome& out = WaitForOutcome(*controller);
  EXPECT_EQ(out.state, State::kFailed);
  EXPECT_EQ(processes_.starts(), 1);
  ASSERT_EQ(out.failures.size(), 2u);
  EXPECT_EQ(out.failures[0].cause, FailureCause::kException);
  EXPECT_EQ(out.failures[1].cause, FailureCause::kStartUp);
  EXPECT_EQ(out.failures[1].attempt, 1);
  EXPECT_NE(out.failures[1].message.find("host-1 does not answer"), std::string::npos)
      << out.failures[1].message;
  json state = RunState();
  EXPECT_EQ(state["status"], "ERRORED");
  EXPECT_EQ(state["attempts"].back()["status"], "ERRORED");
}

TEST_F(ControllerStateTest, AnAbortWhileRanksAreStartingStopsTheGroupWithoutARestart) {
  ControllerOptions options = Options(2);
  options.max_failures = 3;
  auto controller = Start(std::move(options));
  WaitForStart(1);
  ranks_.Deliver(0, MessageType::kRegister, json{{"coordinator", "127.0.0.1:8476"}}.dump());
  ASSERT_TRUE(ranks_.WaitUntilHandled(kNoHang));
  controller->Abort("interrupted by the user");

  const Outcome& out = WaitForOutcome(*controller);
  EXPECT_EQ(out.state, State::kAborted);
  EXPECT_EQ(out.abort_reason, "interrupted by the user");
  EXPECT_TRUE(out.failures.empty());
  EXPECT_EQ(processes_.starts(), 1);
  EXPECT_GE(processes_.signals(SIGTERM), 1);
  EXPECT_EQ(RunState()["status"], "ABORTED");
}

TEST_F(ControllerStateTest, AnAbortWhileARestartStartsItsGroupEndsTheRunAbortedNotFailed) {
  ControllerOptions options = Options(2);
  options.max_failures = 3;
  auto controller = Start(std::move(options));
  WaitForStart(1);
  RegisterAll(/*attempt=*/0, 2);
  // Ctrl-C while the launcher starts the restart's group: Abort() interrupts it, and the
  // interrupted launch fails as SshLauncher's does.
  processes_.OnNextStart([&] {
    controller->Abort("interrupted by the user");
    return interrupts_ > 0 ? CancelledError("the run is being stopped") : OkStatus();
  });
  Raise(0, "boom");

  const Outcome& out = WaitForOutcome(*controller);
  EXPECT_EQ(out.state, State::kAborted);
  EXPECT_EQ(out.abort_reason, "interrupted by the user");
  EXPECT_EQ(interrupts_, 1);
  ASSERT_EQ(out.failures.size(), 1u);  // the exception; the interrupted start is no failure
  EXPECT_EQ(out.failures[0].cause, FailureCause::kException);
  EXPECT_EQ(processes_.starts(), 1);
  json state = RunState();
  EXPECT_EQ(state["status"], "ABORTED");
  ASSERT_EQ(state["attempts"].size(), 2u);
  EXPECT_EQ(state["attempts"][1]["status"], "ABORTED");
}

TEST_F(ControllerStateTest, AnExitWithoutAFailureAfterEveryRankReturnedSucceeds) {
  auto controller = Start(Options(3));
  WaitForStart(1);
  RegisterAll(/*attempt=*/0, 3);
  for (int round = 1; round <= 3; ++round) {
    for (int rank = 0; rank < 3; ++rank) Report(rank, round, {{"step", round}});
  }
  for (int rank = 0; rank < 3; ++rank) Finish(rank);

  const Outcome& out = WaitForOutcome(*controller);
  EXPECT_EQ(out.state, State::kSucceeded);
  EXPECT_EQ(out.attempts, 1);
  EXPECT_EQ(out.rounds, 3u);
  EXPECT_EQ(json::parse(out.last_metrics_json)["step"], 3);
  EXPECT_EQ(processes_.signals(SIGTERM), 0);  // nothing had to be stopped
}

// `rank` makes its collective call `sequence`.
void Call(FakeConnections& ranks, int rank, uint64_t sequence, wire::CollectiveKind kind,
          std::string_view data = "") {
  ranks.Deliver(rank, MessageType::kCollective,
                wire::EncodeCollectiveBody(sequence, static_cast<uint8_t>(kind), data));
}

TEST_F(ControllerStateTest, CollectiveCallsAreReleasedWithRankZerosDataAndNumberedAfreshOnRestart) {
  ControllerOptions options = Options(3);
  options.max_failures = 1;
  auto controller = Start(std::move(options));
  WaitForStart(1);
  RegisterAll(/*attempt=*/0, 3);
  using wire::CollectiveKind;
  Call(ranks_, 2, 1, CollectiveKind::kBroadcast);
  Call(ranks_, 0, 1, CollectiveKind::kBroadcast, "rank 0's seed");
  Call(ranks_, 1, 1, CollectiveKind::kBroadcast);
  for (int rank = 0; rank < 3; ++rank) {
    auto release = ranks_.WaitForSent(0, rank, MessageType::kCollectiveRelease, kNoHang);
    ASSERT_TRUE(release) << "rank " << rank << " was not released";
    auto decoded = wire::DecodeCollectiveRelease({release->type, release->body});
    ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
    EXPECT_EQ(*decoded,
              (wire::Collective{
                  .sequence = 1, .kind = CollectiveKind::kBroadcast, .data = "rank 0's seed"}));
  }
  // Two of three wait in a barrier when the third dies: the group restarts, and the new
  // processes number their calls from 1 again.
  Call(ranks_, 0, 2, CollectiveKind::kBarrier);
  Call(ranks_, 2, 2, CollectiveKind::kBarrier);
  processes_.Kill(1, SIGKILL);
  WaitForStart(2);
  RegisterAll(/*attempt=*/1, 3);
  for (int rank = 0; rank < 3; ++rank) Call(ranks_, rank, 1, CollectiveKind::kBarrier);
  for (int rank = 0; rank < 3; ++rank) {
    auto release = ranks_.WaitForSent(1, rank, MessageType::kCollectiveRelease, kNoHang);
    ASSERT_TRUE(release) << "rank " << rank << " was not released in attempt 1";
    EXPECT_EQ(release->body,
              wire::EncodeCollectiveRelease({.sequence = 1, .kind = CollectiveKind::kBarrier}));
  }
  for (int rank = 0; rank < 3; ++rank) Finish(rank);
  const Outcome& out = WaitForOutcome(*controller);
  EXPECT_EQ(out.state, State::kSucceeded);
  EXPECT_EQ(out.attempts, 2);
}

TEST_F(ControllerStateTest, RanksMakingDifferentCollectiveCallsFailTheAttemptNamingThem) {
  auto controller = Start(Options(3));
  WaitForStart(1);
  RegisterAll(/*attempt=*/0, 3);
  Call(ranks_, 0, 1, wire::CollectiveKind::kBroadcast, "x");
  Call(ranks_, 1, 1, wire::CollectiveKind::kBroadcast);
  Call(ranks_, 2, 1, wire::CollectiveKind::kBarrier);
  const Outcome& out = WaitForOutcome(*controller);
  EXPECT_EQ(out.state, State::kFailed);
  ASSERT_EQ(out.failures.size(), 1u);
  EXPECT_EQ(out.failures[0].rank, 2);
  EXPECT_EQ(out.failures[0].cause, FailureCause::kException);
  EXPECT_EQ(out.failures[0].message,
            "the ranks made different collective calls as their call 1: ranks 0, 1 called "
            "broadcast_from_rank_zero(), rank 2 called barrier(); every rank must make the same "
            "jaxtrain.collective calls in the same order");
}

// An elastic run (docs/elastic.md) that loses host2 goes on with host1's 2 workers from its
// checkpoint; once host2 answers again it stops at its next committed checkpoint, a resize and no
// failure, and goes on with all 4.
TEST_F(ControllerStateTest, AnElasticRunShrinksToTheHostsLeftAndGrowsBackAtACheckpoint) {
  ControllerOptions options = ElasticOnTwoHosts(0s);
  options.max_failures = 1;
  auto owned = std::make_unique<HostsLauncher>(interrupts_);
  HostsLauncher& launcher = *owned;
  auto controller = Start(std::move(options), std::move(owned));
  WaitForStart(1);
  EXPECT_EQ(RegisterAll(/*attempt=*/0, 4)[3]["world_size"], 4);

  launcher.SetDown({"host2"});
  processes_.Kill(2, SIGKILL);  // host2 is gone
  WaitForStart(2);
  std::vector<json> shrunk = RegisterAll(/*attempt=*/1, 2);
  EXPECT_EQ(shrunk[0]["world_size"], 2);
  launcher.SetDown({});  // host2 answers again: the monitor finds it

  const uint64_t round = CheckpointUntilStopped(/*attempt=*/1, {0, 1});  // to grow
  WaitForStart(3);
  std::vector<json> grown = RegisterAll(/*attempt=*/2, 4);
  EXPECT_EQ(grown[3]["world_size"], 4);
  EXPECT_EQ(grown[3]["checkpoint"], RunDir() + "/checkpoint_" +
                                        std::string(6 - std::to_string(round).size(), '0') +
                                        std::to_string(round));
  for (int rank = 0; rank < 4; ++rank) Finish(rank);

  const Outcome& out = WaitForOutcome(*controller);
  EXPECT_EQ(out.state, State::kSucceeded);
  EXPECT_EQ(out.attempts, 3);
  EXPECT_EQ(out.failures.size(), 1u) << "a resize is no failure";
  EXPECT_EQ(launcher.sizes(), (std::vector<size_t>{4, 2, 4}));
  json state = RunState();
  EXPECT_EQ(state["resizes"], 2);
  ASSERT_EQ(state["attempts"].size(), 3u);
  EXPECT_EQ(state["attempts"][0]["status"], "ERRORED");
  EXPECT_EQ(state["attempts"][1]["status"], "RESIZED");
  EXPECT_FALSE(state["attempts"][1].contains("failure"));
  EXPECT_EQ(state["attempts"][2]["status"], "FINISHED");
  EXPECT_EQ(state["attempts"][1]["world_size"], 2);
  EXPECT_EQ(state["attempts"][1]["resize"]["reason"], "host host2 cannot be reached");
  EXPECT_EQ(state["attempts"][2]["resize"]["reason"], "host host2 can be reached again");
  EXPECT_EQ(state["attempts"][2]["world_size"], 4);
}

// A host the cluster takes from a group that trains on it (a Slurm node drained) is left at the
// next committed checkpoint: a planned resize, no failure, and the restart waits for no host.
TEST_F(ControllerStateTest, AnElasticRunLeavesAHostTakenFromItAtACheckpoint) {
  ControllerOptions options = ElasticOnTwoHosts(24h);
  auto owned = std::make_unique<HostsLauncher>(interrupts_);
  HostsLauncher& launcher = *owned;
  auto controller = Start(std::move(options), std::move(owned));
  WaitForStart(1);
  RegisterAll(/*attempt=*/0, 4);
  launcher.SetDown({"host2"});  // drained: not usable, and leaving the group
  launcher.SetLeaving({"host2"});

  CheckpointUntilStopped(/*attempt=*/0, {0, 1, 2, 3});  // to shrink
  WaitForStart(2);
  std::vector<json> shrunk = RegisterAll(/*attempt=*/1, 2);
  EXPECT_EQ(shrunk[1]["world_size"], 2);
  for (int rank = 0; rank < 2; ++rank) Finish(rank);

  const Outcome& out = WaitForOutcome(*controller);
  EXPECT_EQ(out.state, State::kSucceeded);
  EXPECT_TRUE(out.failures.empty()) << "a resize is no failure";
  EXPECT_EQ(launcher.sizes(), (std::vector<size_t>{4, 2}));
  EXPECT_EQ(controller->metrics().attempts_by_cause,
            (std::map<std::string, uint64_t>{{"start", 1}, {"resize", 1}}));
  json state = RunState();
  EXPECT_EQ(state["resizes"], 1);
  ASSERT_EQ(state["attempts"].size(), 2u);
  EXPECT_EQ(state["attempts"][0]["status"], "RESIZED");
  EXPECT_EQ(state["attempts"][1]["resize"]["reason"], "host host2 is being taken from the run");
  EXPECT_EQ(state["attempts"][1]["resize"]["hosts_left_out"], json::array({"host2"}));
  EXPECT_EQ(state["attempts"][1]["world_size"], 2);
}

}  // namespace
}  // namespace jaxtrain::controller
