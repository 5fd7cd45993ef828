#include "controller/restore_verifier.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "storage/files.h"

namespace jaxtrain::controller {
namespace {

class RestoreVerifierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string dir = ::testing::TempDir() + "/restore_verifier_test.XXXXXX";
    ASSERT_NE(mkdtemp(dir.data()), nullptr);
    run_ = dir;
  }
  void TearDown() override { std::filesystem::remove_all(run_); }

  // Commits a one-file checkpoint `name` of `round` and returns its record.
  storage::CheckpointRecord Commit(const std::string& name, uint64_t round) {
    const std::string staged = storage::StagingPath(run_, 0, round, 0);
    std::filesystem::create_directories(staged);
    std::ofstream(staged + "/model.bin") << "weights";
    storage::RankCheckpoint part{.rank = 0, .staging_dir = staged};
    auto files = storage::StageDirectory(staged, staged + ".copy");
    EXPECT_TRUE(files.ok());
    part.files = *files;
    part.staging_dir = staged + ".copy";
    auto record = storage::CommitCheckpoint(run_, name, round, 1.0, "{}", {part});
    EXPECT_TRUE(record.ok()) << record.status().ToString();
    return *record;
  }

  std::string Dir(const std::string& name) const { return storage::JoinPath(run_, name); }

  // Makes the file of checkpoint `name` `size` bytes (sparse) and its manifest agree.
  void Grow(const std::string& name, uint64_t size) {
    ASSERT_EQ(truncate((Dir(name) + "/model.bin").c_str(), static_cast<off_t>(size)), 0);
    const std::string manifest_path = Dir(name) + "/" + storage::kManifestName;
    auto manifest = nlohmann::json::parse(*storage::ReadFile(manifest_path));
    manifest["file_list"][0]["size"] = size;
    ASSERT_TRUE(storage::WriteFileAtomically(manifest_path, manifest.dump()).ok());
  }

  std::string run_;
};

TEST_F(RestoreVerifierTest, ChoosesTheNewestCheckpointThatVerifies) {
  std::vector<storage::CheckpointRecord> records = {Commit("c1", 1), Commit("c2", 2)};
  RestoreVerifier::Result chosen = RestoreVerifier::Choose(run_, records, true);
  EXPECT_EQ(chosen.dir, Dir("c2"));
  EXPECT_TRUE(chosen.warnings.empty());
  EXPECT_FALSE(chosen.cancelled);
}

TEST_F(RestoreVerifierTest, FallsBackToAnOlderCheckpointWithAWarning) {
  std::vector<storage::CheckpointRecord> records = {Commit("c1", 1), Commit("c2", 2)};
  std::ofstream(Dir("c2") + "/model.bin") << "damaged";  // same size, other bytes
  RestoreVerifier::Result chosen = RestoreVerifier::Choose(run_, records, true);
  EXPECT_EQ(chosen.dir, Dir("c1"));
  ASSERT_EQ(chosen.warnings.size(), 1u);
  EXPECT_NE(chosen.warnings[0].find("not restoring checkpoint c2"), std::string::npos);
  EXPECT_NE(chosen.warnings[0].find("falling back"), std::string::npos);
}

TEST_F(RestoreVerifierTest, NoCheckpointThatVerifiesStartsFromScratch) {
  std::vector<storage::CheckpointRecord> records = {Commit("c1", 1)};
  std::filesystem::remove(Dir("c1") + "/model.bin");
  RestoreVerifier::Result chosen = RestoreVerifier::Choose(run_, records, true);
  EXPECT_EQ(chosen.dir, "");
  ASSERT_EQ(chosen.warnings.size(), 2u);
  EXPECT_NE(chosen.warnings[1].find("starts from scratch"), std::string::npos);
}

TEST_F(RestoreVerifierTest, PostsItsResultThroughTheReadyDescriptor) {
  std::vector<storage::CheckpointRecord> records = {Commit("c1", 1)};
  auto verifier = RestoreVerifier::Create();
  ASSERT_TRUE(verifier.ok());
  ASSERT_TRUE((*verifier)->Start(run_, records, true).ok());
  EXPECT_EQ((*verifier)->Start(run_, records, true).code(), StatusCode::kFailedPrecondition);
  pollfd p{(*verifier)->ready_fd(), POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 30'000), 1);
  auto result = (*verifier)->TakeResult();
  ASSERT_TRUE(result.has_value());
  EXPECT_EQ(result->dir, Dir("c1"));
  EXPECT_FALSE((*verifier)->TakeResult().has_value());
  EXPECT_EQ(poll(&p, 1, 0), 0) << "ready_fd stays readable after the result was taken";
  // Ready for the next one.
  ASSERT_TRUE((*verifier)->Start(run_, records, true).ok());
  ASSERT_EQ(poll(&p, 1, 30'000), 1);
  EXPECT_TRUE((*verifier)->TakeResult().has_value());
}

TEST_F(RestoreVerifierTest, CancelStopsAVerificationOfALargeCheckpointMidFile) {
  std::vector<storage::CheckpointRecord> records = {Commit("c1", 1)};
  Grow("c1", uint64_t{1} << 40);  // a sparse TiB: reading it all would take minutes
  auto verifier = RestoreVerifier::Create();
  ASSERT_TRUE(verifier.ok());
  ASSERT_TRUE((*verifier)->Start(run_, records, true).ok());
  (*verifier)->Cancel();
  pollfd p{(*verifier)->ready_fd(), POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 30'000), 1) << "the cancelled verification did not end";
  auto result = (*verifier)->TakeResult();
  ASSERT_TRUE(result.has_value());
  EXPECT_TRUE(result->cancelled);
  EXPECT_EQ(result->dir, "");
}

TEST_F(RestoreVerifierTest, WaitReturnsTheResultAskingWhetherToCancelAtEachWakeUp) {
  std::vector<storage::CheckpointRecord> records = {Commit("c1", 1)};
  auto verifier = RestoreVerifier::Create();
  ASSERT_TRUE(verifier.ok());
  int wake[2];
  ASSERT_EQ(pipe2(wake, O_NONBLOCK), 0);  // as the eventfd the controller passes
  ASSERT_TRUE((*verifier)->Start(run_, records, true).ok());
  int asked = 0;
  RestoreVerifier::Result result = (*verifier)->Wait(wake[0], [&] {
    ++asked;
    return false;
  });
  EXPECT_EQ(result.dir, Dir("c1"));
  EXPECT_FALSE(result.cancelled);
  EXPECT_GE(asked, 1);

  // A large checkpoint, and a wake-up that cancels it.
  Grow("c1", uint64_t{1} << 40);
  ASSERT_TRUE((*verifier)->Start(run_, records, true).ok());
  ASSERT_EQ(write(wake[1], "x", 1), 1);
  result = (*verifier)->Wait(wake[0], [&] {
    char c;
    return read(wake[0], &c, 1) == 1;  // woken: cancel
  });
  EXPECT_TRUE(result.cancelled);
  EXPECT_EQ(result.dir, "");
  close(wake[0]);
  close(wake[1]);
}

TEST_F(RestoreVerifierTest, DestroyingItStopsAVerificationInFlight) {
  std::vector<storage::CheckpointRecord> records = {Commit("c1", 1)};
  Grow("c1", uint64_t{1} << 40);
  auto verifier = RestoreVerifier::Create();
  ASSERT_TRUE(verifier.ok());
  ASSERT_TRUE((*verifier)->Start(run_, records, true).ok());
  verifier->reset();  // returns once the thread has stopped; the test would hang otherwise
}

}  // namespace
}  // namespace jaxtrain::controller
