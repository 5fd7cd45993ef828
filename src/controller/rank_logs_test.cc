#include "controller/rank_logs.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <filesystem>

#include "storage/files.h"

namespace jaxtrain::controller {
namespace {

namespace fs = std::filesystem;

class RankLogsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "rank_logs_test.XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Path(int rank) const { return dir_ + "/rank-" + std::to_string(rank) + ".log"; }
  std::string Read(int rank) const {
    auto text = storage::ReadFile(Path(rank));
    return text.ok() ? *text : "<missing>";
  }
  RankLogs Make(int world_size) const {
    return RankLogs([this](int r) { return Path(r); }, world_size);
  }

  std::string dir_;
};

TEST_F(RankLogsTest, NothingIsCreatedUntilARankWrites) {
  RankLogs logs = Make(3);
  logs.BeginAttempt(0);
  EXPECT_FALSE(fs::exists(Path(0)));
  ASSERT_TRUE(logs.Write(1, "hello\n").ok());
  EXPECT_EQ(Read(1), "===== jaxtrain: attempt 0 =====\nhello\n");
  EXPECT_FALSE(fs::exists(Path(0)));
  EXPECT_FALSE(fs::exists(Path(2)));
}

TEST_F(RankLogsTest, EachAttemptIsHeadedBeforeItsFirstTextOnly) {
  RankLogs logs = Make(2);
  logs.BeginAttempt(0);
  ASSERT_TRUE(logs.Write(0, "a").ok());
  ASSERT_TRUE(logs.Write(0, "b\n").ok());
  logs.BeginAttempt(1);  // rank 0 prints nothing in attempt 1
  logs.BeginAttempt(2);
  ASSERT_TRUE(logs.Write(0, "c\n").ok());
  ASSERT_TRUE(logs.Write(1, "").ok());  // an empty write creates the log with its header
  EXPECT_EQ(Read(0), "===== jaxtrain: attempt 0 =====\nab\n===== jaxtrain: attempt 2 =====\nc\n");
  EXPECT_EQ(Read(1), "===== jaxtrain: attempt 2 =====\n");
}

TEST_F(RankLogsTest, HeadAllGivesTheSilentRanksTheAttemptsHeader) {
  RankLogs logs = Make(3);
  logs.set_max_open(1);
  logs.BeginAttempt(0);
  ASSERT_TRUE(logs.Write(1, "out\n").ok());
  ASSERT_TRUE(logs.HeadAll().ok());
  logs.BeginAttempt(1);
  ASSERT_TRUE(logs.HeadAll().ok());
  EXPECT_EQ(Read(0), "===== jaxtrain: attempt 0 =====\n===== jaxtrain: attempt 1 =====\n");
  EXPECT_EQ(Read(1), "===== jaxtrain: attempt 0 =====\nout\n===== jaxtrain: attempt 1 =====\n");
  EXPECT_EQ(Read(2), Read(0));
  EXPECT_LE(logs.open_count(), 1u);
}

TEST_F(RankLogsTest, AnExistingLogIsAppendedTo) {
  ASSERT_TRUE(storage::AppendToFile(Path(0), "earlier run\n").ok());
  RankLogs logs = Make(1);
  logs.BeginAttempt(3);
  ASSERT_TRUE(logs.Write(0, "x\n").ok());
  EXPECT_EQ(Read(0), "earlier run\n===== jaxtrain: attempt 3 =====\nx\n");
}

TEST_F(RankLogsTest, HoldsAtMostMaxOpenAndReopensTheOthers) {
  RankLogs logs = Make(5);
  logs.set_max_open(2);
  for (int round = 0; round < 3; ++round) {
    for (int r = 0; r < 5; ++r) {
      ASSERT_TRUE(logs.Write(r, std::to_string(round)).ok());
      EXPECT_LE(logs.open_count(), 2u);
    }
  }
  for (int r = 0; r < 5; ++r) EXPECT_EQ(Read(r), "===== jaxtrain: attempt 0 =====\n012");
  logs.set_max_open(1);
  EXPECT_EQ(logs.open_count(), 1u);
  logs.CloseAll();
  EXPECT_EQ(logs.open_count(), 0u);
}

TEST_F(RankLogsTest, ALogThatCannotBeOpenedIsAnErrorNamingItsPath) {
  RankLogs logs([this](int) { return dir_ + "/missing/rank-0.log"; }, 1);
  Status s = logs.Write(0, "x");
  EXPECT_EQ(s.code(), StatusCode::kInternal) << s.ToString();  // ENOENT
  EXPECT_NE(s.message().find(dir_ + "/missing/rank-0.log"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace jaxtrain::controller
