// RunRecord against a real run directory: run.json's attempts (an earlier driver's that never
// ended marked CRASHED, the attempt in progress shown as RUNNING), error.txt's text and
// return_value.pkl, and what it keeps of them for the run's outcome.
#include "controller/run_record.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>

#include "controller/testing/cpu_plan.h"
#include "storage/files.h"

namespace jaxtrain::controller {
namespace {

using nlohmann::json;

class RunRecordTest : public testing::Test {
 protected:
  void SetUp() override {
    std::string dir = testing::TempDir() + "/run_record_test.XXXXXX";
    ASSERT_NE(mkdtemp(dir.data()), nullptr);
    dir_ = dir;
    opts_.experiment_name = "record_test";
    opts_.plan = CpuPlan(2);
    opts_.run_config = {{"name", "record_test"}};
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  storage::RunStore Open() {
    auto store = storage::RunStore::Open(dir_ + "/run");
    EXPECT_TRUE(store.ok()) << store.status().ToString();
    return std::move(*store);
  }
  json RunJson() const {
    auto text = storage::ReadFile(dir_ + "/run/run.json");
    return text.ok() ? json::parse(*text) : json();
  }

  static std::string ReadOr(const std::string& path) {
    auto text = storage::ReadFile(path);
    return text.ok() ? *text : "<missing>";
  }

  std::string dir_;
  ControllerOptions opts_;
  FakeClock clock_;
};

TEST_F(RunRecordTest, WritesTheAttemptInProgressAndThoseThatEnded) {
  storage::RunStore store = Open();
  RunRecord record(store, opts_, clock_);
  EXPECT_EQ(record.Resume(), 0);
  record.AddAttempt({{"attempt", 0}, {"status", "ERRORED"}});
  ASSERT_TRUE(record.Write("RUNNING", 7, {{"attempt", 1}, {"status", "RUNNING"}}).ok());
  json run = RunJson();
  EXPECT_EQ(run["name"], "record_test");
  EXPECT_EQ(run["status"], "RUNNING");
  EXPECT_EQ(run["world_size"], 2);
  EXPECT_EQ(run["rounds"], 7);
  EXPECT_EQ(run["config"]["name"], "record_test");
  ASSERT_EQ(run["attempts"].size(), 2u);
  EXPECT_EQ(run["attempts"][1]["status"], "RUNNING");
  EXPECT_FALSE(run.contains("end_time"));
  EXPECT_EQ(record.SinceWritten(), Duration::zero());
  clock_.Advance(std::chrono::seconds(3));
  EXPECT_EQ(record.SinceWritten(), std::chrono::seconds(3));

  ASSERT_TRUE(record.Write("FINISHED", 7, json()).ok());
  run = RunJson();
  EXPECT_EQ(run["status"], "FINISHED");
  EXPECT_EQ(run["attempts"].size(), 1u);
  EXPECT_TRUE(run.contains("end_time"));
  EXPECT_EQ(record.state(), run) << "the outcome carries run.json as written";
}

TEST_F(RunRecordTest, KeepsRunJsonOnlyAsLastWrittenSuccessfully) {
  storage::RunStore store = Open();
  RunRecord record(store, opts_, clock_);
  EXPECT_TRUE(record.state().is_null());
  ASSERT_TRUE(record.Write("RUNNING", 1, json()).ok());
  const json written = RunJson();
  // A directory in run.json's place: it cannot be replaced.
  std::filesystem::remove(dir_ + "/run/run.json");
  std::filesystem::create_directories(dir_ + "/run/run.json/in-the-way");
  EXPECT_FALSE(record.Write("FINISHED", 2, json()).ok());
  EXPECT_EQ(record.state(), written);
}

TEST_F(RunRecordTest, TheReturnValueIsWrittenReplacedAndRemoved) {
  storage::RunStore store = Open();
  RunRecord record(store, opts_, clock_);
  const std::string path = dir_ + "/run/return_value.pkl";
  EXPECT_EQ(record.return_value(), std::nullopt);
  ASSERT_TRUE(record.WriteReturnValue(std::string("one")).ok());
  EXPECT_EQ(ReadOr(path), "one");
  ASSERT_TRUE(record.WriteReturnValue(std::string("two")).ok());
  EXPECT_EQ(ReadOr(path), "two");
  EXPECT_EQ(record.return_value(), "two");
  ASSERT_TRUE(record.WriteReturnValue(std::nullopt).ok());
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_EQ(record.return_value(), std::nullopt);
  ASSERT_TRUE(record.WriteReturnValue(std::nullopt).ok()) << "none to remove is no error";
}

// A driver that ended without recording how its attempt ended: the next one marks it CRASHED.
TEST_F(RunRecordTest, ResumeMarksAnUnfinishedAttemptCrashed) {
  {
    storage::RunStore store = Open();
    RunRecord record(store, opts_, clock_);
    record.AddAttempt({{"attempt", 0}, {"status", "ERRORED"}});
    ASSERT_TRUE(record.Write("RUNNING", 3, {{"attempt", 1}, {"status", "RUNNING"}}).ok());
  }
  storage::RunStore store = Open();
  RunRecord record(store, opts_, clock_);
  EXPECT_EQ(record.Resume(), 2);
  ASSERT_TRUE(record.Write("RUNNING", 3, {{"attempt", 2}, {"status", "RUNNING"}}).ok());
  json attempts = RunJson()["attempts"];
  ASSERT_EQ(attempts.size(), 3u);
  EXPECT_EQ(attempts[0]["status"], "ERRORED");
  EXPECT_EQ(attempts[1]["status"], "CRASHED");
  EXPECT_EQ(attempts[1]["failure"]["cause"], FailureCauseName(FailureCause::kDriver));
  EXPECT_EQ(attempts[2]["status"], "RUNNING");
}

TEST_F(RunRecordTest, ErrorTextNamesEveryFailureAndTheFirstOnesTraceback) {
  storage::RunStore store = Open();
  RunRecord record(store, opts_, clock_);
  std::vector<RankFailure> failures = {{.rank = 1,
                                        .host = "host-1",
                                        .attempt = 0,
                                        .cause = FailureCause::kException,
                                        .message = "boom",
                                        .traceback = "Traceback: boom",
                                        .log_path = "/run/logs/rank-1.log",
                                        .log_tail = "last words\n"},
                                       {.rank = -1,
                                        .host = "driver",
                                        .attempt = 1,
                                        .cause = FailureCause::kStartUp,
                                        .message = "no start"}};
  ASSERT_TRUE(record.WriteError(failures).ok());
  auto text = storage::ReadFile(dir_ + "/run/error.txt");
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text,
            "attempt 0: rank 1 (host host-1), " +
                std::string(FailureCauseName(FailureCause::kException)) +
                ": boom\nattempt 1: rank -1 (host driver), " +
                std::string(FailureCauseName(FailureCause::kStartUp)) +
                ": no start\n\nTraceback: boom\n--- last lines of /run/logs/rank-1.log ---\nlast "
                "words\n");
}

TEST_F(RunRecordTest, FailureJsonHasTheFieldsOfItsCause) {
  json j = FailureJson({.rank = 2,
                        .host = "h",
                        .cause = FailureCause::kSignal,
                        .signal = 9,
                        .retried = true,
                        .decision = "within the budget",
                        .message = "killed"});
  EXPECT_EQ(j["rank"], 2);
  EXPECT_EQ(j["signal"], 9);
  EXPECT_TRUE(j["exit_code"].is_null());
  EXPECT_FALSE(j.contains("status_code"));
  EXPECT_EQ(j["decision"]["action"], "retry");
  EXPECT_EQ(j["decision"]["reason"], "within the budget");
}

}  // namespace
}  // namespace jaxtrain::controller
