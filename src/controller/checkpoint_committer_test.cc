// The committer against a real run directory in a temporary folder, and with a commit function
// that the test holds at a gate, so that a commit is "in flight" for as long as the test says,
// without sleeping.
#include "controller/checkpoint_committer.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <stdlib.h>

#include <atomic>
#include <filesystem>
#include <future>
#include <thread>

#include "storage/files.h"

namespace jaxtrain::controller {
namespace {

namespace fs = std::filesystem;
using Job = CheckpointCommitter::Job;

constexpr int kNoHangMs = 30'000;  // bounds each wait, so that a bug fails instead of hanging

class CheckpointCommitterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "committer-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    run_dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(run_dir_); }

  // One rank's checkpoint of `round`, staged the way a worker stages it.
  storage::RankCheckpoint Stage(uint64_t round, int rank, const std::string& contents) {
    const std::string src = storage::JoinPath(run_dir_, "src-" + std::to_string(rank));
    fs::create_directories(src);
    EXPECT_TRUE(storage::WriteFileAtomically(
                    storage::JoinPath(src, "shard-" + std::to_string(rank)), contents)
                    .ok());
    storage::RankCheckpoint part{.rank = rank,
                                 .staging_dir = storage::StagingPath(run_dir_, 0, round, rank)};
    auto files = storage::StageDirectory(src, part.staging_dir, /*durable=*/false);
    EXPECT_TRUE(files.ok()) << files.status().message();
    if (files.ok()) part.files = *files;
    fs::remove_all(src);
    return part;
  }

  Job TwoRankJob(uint64_t round) {
    return {.round = round,
            .dir_name = "checkpoint_" + std::to_string(round),
            .metrics_json = R"({"step": )" + std::to_string(round) + "}",
            .parts = {Stage(round, 0, "zero"), Stage(round, 1, "one")}};
  }

  std::unique_ptr<CheckpointCommitter> MakeCommitter(
      storage::RetentionPolicy retention = {},
      CheckpointCommitter::CommitFn commit = CheckpointCommitter::CommitToStorage) {
    std::vector<std::string> warnings;
    auto index = storage::CheckpointIndex::Load(run_dir_, &warnings);
    EXPECT_TRUE(index.ok());
    auto committer = CheckpointCommitter::Create(run_dir_, std::move(*index), retention, clock_,
                                                 std::move(commit));
    EXPECT_TRUE(committer.ok());
    return std::move(*committer);
  }

  // Waits, as the controller's loop does, for the committer's descriptor; then takes the result.
  static CheckpointCommitter::Result AwaitResult(CheckpointCommitter& committer) {
    pollfd p{committer.ready_fd(), POLLIN, 0};
    EXPECT_EQ(poll(&p, 1, kNoHangMs), 1) << "the commit did not end";
    auto result = committer.TakeResult();
    EXPECT_TRUE(result.has_value());
    if (result) return std::move(*result);
    return {.record = InternalError("no result"), .index = OkStatus()};
  }

  static bool Readable(int fd) {
    pollfd p{fd, POLLIN, 0};
    return poll(&p, 1, 0) == 1;
  }

  std::string run_dir_;
  FakeClock clock_;
};

// A commit function held at a gate until the test opens it.
struct Gate {
  std::promise<void> started;
  std::promise<void> open;
  std::shared_future<void> opened{open.get_future().share()};
  std::atomic<int> commits{0};

  CheckpointCommitter::CommitFn Fn() {
    return [this](const std::string& run_dir, const Job& job,
                  double time) -> StatusOr<storage::CheckpointRecord> {
      if (commits++ == 0) started.set_value();
      opened.wait();
      return CheckpointCommitter::CommitToStorage(run_dir, job, time);
    };
  }
};

TEST_F(CheckpointCommitterTest, CommitsInTheBackgroundAndSignalsItsDescriptor) {
  auto committer = MakeCommitter();
  EXPECT_FALSE(committer->busy());
  ASSERT_TRUE(committer->Submit(TwoRankJob(1)).ok());
  EXPECT_TRUE(committer->busy());

  CheckpointCommitter::Result result = AwaitResult(*committer);
  ASSERT_TRUE(result.record.ok()) << result.record.status().message();
  EXPECT_TRUE(result.index.ok());
  EXPECT_EQ(result.round, 1u);
  EXPECT_EQ(result.record->dir_name, "checkpoint_1");
  EXPECT_FALSE(committer->busy());
  EXPECT_FALSE(Readable(committer->ready_fd())) << "the descriptor stays readable after the take";
  EXPECT_FALSE(committer->TakeResult().has_value());

  const std::string dir = storage::JoinPath(run_dir_, "checkpoint_1");
  EXPECT_TRUE(storage::VerifyCheckpoint(dir, /*checksums=*/true).ok());
  ASSERT_EQ(committer->records().size(), 1u);
  std::vector<std::string> warnings;
  auto reloaded = storage::CheckpointIndex::Load(run_dir_, &warnings);
  ASSERT_TRUE(reloaded.ok());
  EXPECT_TRUE(warnings.empty()) << "checkpoints.json was not saved by the commit";
  ASSERT_EQ(reloaded->records().size(), 1u);
  EXPECT_EQ(reloaded->records()[0].bytes, 7u);
}

TEST_F(CheckpointCommitterTest, RefusesASecondCommitUntilTheFirstOnesResultIsTaken) {
  Gate gate;
  auto committer = MakeCommitter({}, gate.Fn());
  ASSERT_TRUE(committer->Submit(TwoRankJob(1)).ok());
  gate.started.get_future().wait();

  Status second = committer->Submit(TwoRankJob(2));
  EXPECT_EQ(second.code(), StatusCode::kFailedPrecondition);
  EXPECT_FALSE(Readable(committer->ready_fd()));
  EXPECT_FALSE(committer->TakeResult().has_value()) << "a result before the commit ended";
  EXPECT_FALSE(fs::exists(storage::JoinPath(run_dir_, "checkpoint_1")))
      << "visible before the commit ended";

  gate.open.set_value();
  committer->WaitForCommit();
  // Ended, but its result not taken yet: still one commit's worth of back-pressure.
  EXPECT_EQ(committer->Submit(TwoRankJob(3)).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(AwaitResult(*committer).record.ok());
  ASSERT_TRUE(committer->Submit(TwoRankJob(2)).ok());
  ASSERT_TRUE(AwaitResult(*committer).record.ok());
  EXPECT_EQ(gate.commits.load(), 2);
  ASSERT_EQ(committer->records().size(), 2u);
  EXPECT_EQ(committer->records()[1].dir_name, "checkpoint_2");
}

TEST_F(CheckpointCommitterTest, ReportsAFailedCommitAndLeavesTheIndexAlone) {
  auto committer = MakeCommitter({}, [](const std::string&, const Job& job, double) {
    return StatusOr<storage::CheckpointRecord>(
        InternalError("cannot fsync round " + std::to_string(job.round)));
  });
  ASSERT_TRUE(committer->Submit(TwoRankJob(4)).ok());
  CheckpointCommitter::Result result = AwaitResult(*committer);
  EXPECT_EQ(result.round, 4u);
  EXPECT_EQ(result.record.status().code(), StatusCode::kInternal);
  EXPECT_EQ(result.record.status().message(), "cannot fsync round 4");
  EXPECT_TRUE(committer->records().empty());
  EXPECT_FALSE(fs::exists(storage::JoinPath(run_dir_, "checkpoints.json")));
  EXPECT_TRUE(committer->Submit(TwoRankJob(5)).ok()) << "a failure must not wedge the committer";
}

TEST_F(CheckpointCommitterTest, ReportsAPartThatStorageRefuses) {
  auto committer = MakeCommitter();
  Job job = TwoRankJob(1);
  job.parts[1].files[0].path = "../escape";
  ASSERT_TRUE(committer->Submit(std::move(job)).ok());
  CheckpointCommitter::Result result = AwaitResult(*committer);
  EXPECT_EQ(result.record.status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(fs::exists(storage::JoinPath(run_dir_, "checkpoint_1")));
}

TEST_F(CheckpointCommitterTest, AppliesRetentionAfterTheIndexIsSaved) {
  auto committer = MakeCommitter({.num_to_keep = 1});
  for (uint64_t round = 1; round <= 3; ++round) {
    ASSERT_TRUE(committer->Submit(TwoRankJob(round)).ok());
    CheckpointCommitter::Result result = AwaitResult(*committer);
    ASSERT_TRUE(result.record.ok());
    EXPECT_TRUE(result.warnings.empty());
  }
  ASSERT_EQ(committer->records().size(), 1u);
  EXPECT_EQ(committer->records()[0].dir_name, "checkpoint_3");
  EXPECT_FALSE(fs::exists(storage::JoinPath(run_dir_, "checkpoint_1")));
  EXPECT_FALSE(fs::exists(storage::JoinPath(run_dir_, "checkpoint_2")));
  EXPECT_TRUE(fs::exists(storage::JoinPath(run_dir_, "checkpoint_3")));
}

TEST_F(CheckpointCommitterTest, FinishesACommitInFlightWhenDestroyed) {
  Gate gate;
  auto committer = MakeCommitter({}, gate.Fn());
  ASSERT_TRUE(committer->Submit(TwoRankJob(1)).ok());
  gate.started.get_future().wait();
  std::thread destroyer([&] { committer.reset(); });
  gate.open.set_value();
  destroyer.join();
  EXPECT_TRUE(storage::VerifyCheckpoint(storage::JoinPath(run_dir_, "checkpoint_1"), true).ok());
  std::vector<std::string> warnings;
  auto index = storage::CheckpointIndex::Load(run_dir_, &warnings);
  ASSERT_TRUE(index.ok());
  EXPECT_TRUE(warnings.empty());
  EXPECT_EQ(index->records().size(), 1u);
}

TEST_F(CheckpointCommitterTest, CommitsAJobSubmittedJustBeforeDestruction) {
  auto committer = MakeCommitter();
  ASSERT_TRUE(committer->Submit(TwoRankJob(1)).ok());
  committer.reset();
  EXPECT_TRUE(storage::VerifyCheckpoint(storage::JoinPath(run_dir_, "checkpoint_1"), true).ok());
}

}  // namespace
}  // namespace jaxtrain::controller
