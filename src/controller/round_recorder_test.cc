// The recorder against a real run directory (RunStore, CheckpointCommitter) in a temporary
// folder; the commit is held at a gate where a test needs one in flight, so nothing sleeps.
#include "controller/round_recorder.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>

#include "storage/checkpoint.h"
#include "storage/files.h"

namespace jaxtrain::controller {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int kNoHangMs = 30'000;  // bounds each wait, so that a bug fails instead of hanging

// What the recorder told its owner, in order: "recorded 3 checkpoint_000003", "settled 1",
// "failed rank 0 checkpoint: ...".
class Recording : public RoundRecorder::Delegate {
 public:
  void OnRecorded(const Round& round, const std::string& committed) override {
    events.push_back("recorded " + std::to_string(round.round) + " " + committed);
  }
  void OnSettled(int rank, uint64_t) override {
    events.push_back("settled " + std::to_string(rank));
  }
  void OnFailed(RoundFailure f) override {
    failures.push_back(f);
    events.push_back("failed rank " + std::to_string(f.rank));
  }
  void Say(const std::string& line) override { said.push_back(line); }

  std::vector<std::string> events;
  std::vector<RoundFailure> failures;
  std::vector<std::string> said;
};

class RoundRecorderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "recorder-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    auto store = storage::RunStore::Open(dir_ + "/run");
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    store_.emplace(std::move(*store));
  }
  void TearDown() override {
    recorder_.reset();
    store_.reset();
    fs::remove_all(dir_);
  }

  void MakeRecorder(CheckpointCommitter::CommitFn commit = CheckpointCommitter::CommitToStorage) {
    std::vector<std::string> warnings;
    auto index = storage::CheckpointIndex::Load(store_->dir(), &warnings);
    ASSERT_TRUE(index.ok());
    auto committer =
        CheckpointCommitter::Create(store_->dir(), std::move(*index), {}, clock_, commit);
    ASSERT_TRUE(committer.ok());
    recorder_ = std::make_unique<RoundRecorder>(*store_, std::move(*committer), clock_, recording_);
  }

  // Round `round` of rank 0's metrics, with a checkpoint part from each of `ranks` (named
  // `dir_name` when given), staged as workers stage them.
  Round MakeRound(uint64_t round, std::vector<int> ranks = {},
                  std::optional<std::string> dir_name = std::nullopt) {
    Round r{.round = round, .metrics_json = json{{"step", round}}.dump()};
    for (int rank : ranks) {
      const std::string src = dir_ + "/src-" + std::to_string(rank);
      fs::create_directories(src);
      std::ofstream(src + "/shard-" + std::to_string(rank)) << "round " << round;
      CheckpointPart part{
          .staged = {.rank = rank,
                     .staging_dir = storage::StagingPath(store_->dir(), 0, round, rank)},
          .dir_name = dir_name};
      auto files = storage::StageDirectory(src, part.staged.staging_dir, /*durable=*/false);
      EXPECT_TRUE(files.ok()) << files.status().ToString();
      if (files.ok()) part.staged.files = *files;
      fs::remove_all(src);
      r.checkpoints.push_back(std::move(part));
    }
    return r;
  }

  // Adds to `r` rank `rank`'s part holding one file, `name`, with `contents`.
  void AddPart(Round& r, int rank, const std::string& name, const std::string& contents) {
    const std::string src = dir_ + "/src-" + std::to_string(rank);
    fs::create_directories(src);
    std::ofstream(src + "/" + name) << contents;
    CheckpointPart part{
        .staged = {.rank = rank,
                   .staging_dir = storage::StagingPath(store_->dir(), 0, r.round, rank)}};
    auto files = storage::StageDirectory(src, part.staged.staging_dir, /*durable=*/false);
    ASSERT_TRUE(files.ok()) << files.status().ToString();
    part.staged.files = *files;
    fs::remove_all(src);
    r.checkpoints.push_back(std::move(part));
  }

  // Waits, as the loop does, for the commit to end; then hands its result to the recorder.
  void AwaitCommit() {
    pollfd p{recorder_->ready_fd(), POLLIN, 0};
    ASSERT_EQ(poll(&p, 1, kNoHangMs), 1) << "the commit did not end";
    recorder_->OnCommitReady();
  }

  // The rounds in result.jsonl: "<round> <checkpoint or ->".
  std::vector<std::string> ResultLines() const {
    std::ifstream in(store_->dir() + "/result.jsonl");
    std::vector<std::string> lines;
    for (std::string line; std::getline(in, line);) {
      json j = json::parse(line);
      lines.push_back(std::to_string(j["round"].get<int>()) + " " +
                      j.value("checkpoint", std::string("-")));
    }
    return lines;
  }

  std::string dir_;
  FakeClock clock_;
  std::optional<storage::RunStore> store_;
  Recording recording_;
  std::unique_ptr<RoundRecorder> recorder_;
};

TEST_F(RoundRecorderTest, RoundsWithoutCheckpointsAreRecordedAtOnce) {
  MakeRecorder();
  recorder_->Add(MakeRound(1));
  recorder_->Add(MakeRound(2));
  EXPECT_EQ(recording_.events, (std::vector<std::string>{"recorded 1 ", "recorded 2 "}));
  EXPECT_EQ(ResultLines(), (std::vector<std::string>{"1 -", "2 -"}));
  EXPECT_FALSE(recorder_->busy());
}

TEST_F(RoundRecorderTest, RoundsCompletedDuringACommitWaitAndAreRecordedAfterItInOrder) {
  std::promise<void> open;
  std::shared_future<void> opened = open.get_future().share();
  MakeRecorder(
      [opened](const std::string& run_dir, const CheckpointCommitter::Job& job, double time) {
        opened.wait();  // the commit stays in flight until the test opens the gate
        return CheckpointCommitter::CommitToStorage(run_dir, job, time);
      });
  recorder_->Add(MakeRound(1, {0, 1}));
  recorder_->Add(MakeRound(2));
  recorder_->Add(MakeRound(3));
  EXPECT_TRUE(recorder_->busy());
  EXPECT_TRUE(recording_.events.empty()) << "recorded before the checkpoint ahead was committed";
  EXPECT_TRUE(ResultLines().empty());

  open.set_value();
  AwaitCommit();
  EXPECT_EQ(recording_.events,
            (std::vector<std::string>{"settled 0", "settled 1", "recorded 1 checkpoint_000001",
                                      "recorded 2 ", "recorded 3 "}));
  EXPECT_EQ(ResultLines(), (std::vector<std::string>{"1 checkpoint_000001", "2 -", "3 -"}));
  EXPECT_TRUE(storage::VerifyCheckpoint(store_->dir() + "/checkpoint_000001", true).ok());
  ASSERT_EQ(recorder_->records().size(), 1u);
}

TEST_F(RoundRecorderTest, ACheckpointWaitingBehindAnotherIsCommittedWhenItsTurnComes) {
  MakeRecorder();
  recorder_->Add(MakeRound(1, {0}));
  recorder_->Add(MakeRound(2, {0}, "named"));
  AwaitCommit();
  EXPECT_TRUE(recorder_->busy()) << "round 2's commit did not start after round 1's ended";
  AwaitCommit();
  EXPECT_EQ(ResultLines(), (std::vector<std::string>{"1 checkpoint_000001", "2 named"}));
  EXPECT_TRUE(recording_.failures.empty());
}

TEST_F(RoundRecorderTest, RanksThatNameDifferentCheckpointsFailTheRoundAndCommitNothing) {
  MakeRecorder();
  Round round = MakeRound(1, {0, 1}, "step-10");
  round.checkpoints[1].dir_name = "step-11";
  recorder_->Add(std::move(round));
  recorder_->Add(MakeRound(2));

  ASSERT_EQ(recording_.failures.size(), 1u);
  const RoundFailure& f = recording_.failures[0];
  EXPECT_EQ(f.cause, FailureCause::kCheckpoint);
  EXPECT_EQ(f.code, StatusCode::kInvalidArgument);
  EXPECT_NE(f.message.find("rank 0 names it 'step-10' and rank 1 'step-11'"), std::string::npos)
      << f.message;
  // The ranks are released all the same, and the round behind it is recorded.
  EXPECT_EQ(recording_.events,
            (std::vector<std::string>{"settled 0", "settled 1", "failed rank -1", "recorded 2 "}));
  EXPECT_FALSE(fs::exists(store_->dir() + "/step-10"));
  EXPECT_FALSE(fs::exists(store_->dir() + "/step-11"));
}

// Ray merges the ranks' directories: a file that several ranks wrote alike is one file.
TEST_F(RoundRecorderTest, AFileSeveralRanksWroteWithTheSameContentsIsCommittedOnce) {
  MakeRecorder();
  Round round{.round = 1, .metrics_json = "{}"};
  AddPart(round, 0, "config.json", "same");
  AddPart(round, 1, "config.json", "same");
  AddPart(round, 1, "shard-1", "weights");
  recorder_->Add(std::move(round));
  AwaitCommit();
  EXPECT_TRUE(recording_.failures.empty());
  EXPECT_EQ(ResultLines(), std::vector<std::string>{"1 checkpoint_000001"});
  json manifest = json::parse(
      std::ifstream(store_->dir() + "/checkpoint_000001/" + std::string(storage::kManifestName)));
  ASSERT_EQ(manifest["file_list"].size(), 2u) << manifest.dump();
  EXPECT_EQ(manifest["file_list"][0]["path"], "config.json");
  EXPECT_EQ(manifest["file_list"][0]["rank"], 0);
  EXPECT_EQ(manifest["file_list"][1]["path"], "shard-1");
  std::ifstream config(store_->dir() + "/checkpoint_000001/config.json");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(config), {}), "same");
  EXPECT_FALSE(fs::exists(storage::StagingPath(store_->dir(), 0, 1, 1)));
}

// Different contents under one name cannot be merged: the failure names the file and both ranks,
// and blames neither (rank -1), and nothing of the checkpoint is committed.
TEST_F(RoundRecorderTest, AFileTwoRanksWroteWithDifferentContentsFailsTheRoundNamingBoth) {
  MakeRecorder();
  Round round{.round = 1, .metrics_json = "{}"};
  AddPart(round, 0, "config.json", "rank 0's");
  AddPart(round, 2, "config.json", "rank 2's!");
  recorder_->Add(std::move(round));
  ASSERT_EQ(recording_.failures.size(), 1u);
  const RoundFailure& f = recording_.failures[0];
  EXPECT_EQ(f.rank, -1);
  EXPECT_EQ(f.cause, FailureCause::kCheckpoint);
  EXPECT_EQ(f.code, StatusCode::kInvalidArgument);
  EXPECT_NE(f.message.find("rank 0 and rank 2 both wrote 'config.json' to the checkpoint of "
                           "round 1 with different contents (rank 0's: 8 bytes"),
            std::string::npos)
      << f.message;
  EXPECT_NE(f.message.find("rank 2's: 9 bytes"), std::string::npos) << f.message;
  EXPECT_FALSE(recorder_->busy());
  EXPECT_FALSE(fs::exists(store_->dir() + "/checkpoint_000001"));
}

TEST_F(RoundRecorderTest, ACommitThatFailsIsBlamedOnItsFirstPartWithItsCode) {
  MakeRecorder();
  Round round = MakeRound(1, {2});
  fs::remove_all(round.checkpoints[0].staged.staging_dir);  // the staged files are gone
  recorder_->Add(std::move(round));
  AwaitCommit();
  ASSERT_EQ(recording_.failures.size(), 1u);
  EXPECT_EQ(recording_.failures[0].rank, 2);
  EXPECT_EQ(recording_.failures[0].cause, FailureCause::kCheckpoint);
  EXPECT_NE(recording_.failures[0].code, StatusCode::kOk);
  EXPECT_NE(recording_.failures[0].message.find("round 1 could not be committed"),
            std::string::npos)
      << recording_.failures[0].message;
  EXPECT_EQ(recording_.events, (std::vector<std::string>{"settled 2", "failed rank 2"}));
  EXPECT_TRUE(ResultLines().empty());  // a round whose checkpoint failed is not recorded
}

}  // namespace
}  // namespace jaxtrain::controller
