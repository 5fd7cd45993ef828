#include "controller/rank_logs.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <filesystem>
#include <vector>

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

TEST_F(RankLogsTest, EachAttemptIsHeadedOnceBeforeItsFirstText) {
  RankLogs logs = Make(2);
  logs.BeginAttempt(3);  // a resumed run: its first attempt is 3
  ASSERT_TRUE(logs.Write(0, "a").ok());
  ASSERT_TRUE(logs.Write(0, "b\n").ok());
  EXPECT_EQ(Read(0), "===== jaxtrain: attempt 3 =====\nab\n");
  logs.BeginAttempt(4);  // rank 0 prints nothing in attempt 4: no file is touched for it
  logs.BeginAttempt(5);
  EXPECT_EQ(Read(0), "===== jaxtrain: attempt 3 =====\nab\n");
  EXPECT_FALSE(fs::exists(Path(1)));
  ASSERT_TRUE(logs.Write(0, "c\n").ok());  // the silent attempt's header comes first
  ASSERT_TRUE(logs.Write(1, "").ok());     // an empty write creates the log with its headers
  EXPECT_EQ(Read(0),
            "===== jaxtrain: attempt 3 =====\nab\n===== jaxtrain: attempt 4 =====\n"
            "===== jaxtrain: attempt 5 =====\nc\n");
  EXPECT_EQ(Read(1),
            "===== jaxtrain: attempt 3 =====\n===== jaxtrain: attempt 4 =====\n"
            "===== jaxtrain: attempt 5 =====\n");
}

TEST_F(RankLogsTest, AHeaderStartsALineAfterALastLineLeftOpen) {
  {
    RankLogs logs = Make(1);
    logs.BeginAttempt(0);
    ASSERT_TRUE(logs.Write(0, "step 1\nstep 2").ok());  // killed between a print and its newline
    logs.BeginAttempt(1);
    ASSERT_TRUE(logs.Write(0, "resumed\nhalf").ok());
  }
  // A later driver resuming the run, and a log closed and opened again, see the file's end.
  RankLogs later = Make(1);
  later.set_max_open(1);
  later.BeginAttempt(2);
  ASSERT_TRUE(later.Write(0, "again\n").ok());
  later.CloseAll();
  later.BeginAttempt(3);
  ASSERT_TRUE(later.Write(0, "").ok());
  EXPECT_EQ(Read(0),
            "===== jaxtrain: attempt 0 =====\nstep 1\nstep 2\n===== jaxtrain: attempt 1 =====\n"
            "resumed\nhalf\n===== jaxtrain: attempt 2 =====\nagain\n"
            "===== jaxtrain: attempt 3 =====\n");
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

// While it lives, the process can open exactly `free` more descriptors.
class FewDescriptors {
 public:
  explicit FewDescriptors(int free) {
    getrlimit(RLIMIT_NOFILE, &old_);
    rlimit low = old_;
    low.rlim_cur = 256;
    setrlimit(RLIMIT_NOFILE, &low);
    for (int fd; (fd = open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) fillers_.push_back(fd);
    for (int i = 0; i < free && !fillers_.empty(); ++i) {
      close(fillers_.back());
      fillers_.pop_back();
    }
  }
  ~FewDescriptors() {
    for (int fd : fillers_) close(fd);
    setrlimit(RLIMIT_NOFILE, &old_);
  }

 private:
  rlimit old_{};
  std::vector<int> fillers_;
};

TEST_F(RankLogsTest, WhenTheProcessRunsOutOfDescriptorsTheOldestLogsAreClosed) {
  RankLogs logs = Make(8);
  logs.set_max_open(100);  // a budget the process cannot give
  std::vector<Status> written;
  size_t open_at_limit = 0;
  {
    FewDescriptors few(3);
    for (int round = 0; round < 2; ++round) {
      for (int r = 0; r < 8; ++r) written.push_back(logs.Write(r, std::to_string(round)));
    }
    open_at_limit = logs.open_count();
    logs.CloseAll();
  }
  for (const Status& s : written) EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(open_at_limit, 3u);
  for (int r = 0; r < 8; ++r) EXPECT_EQ(Read(r), "===== jaxtrain: attempt 0 =====\n01");
}

TEST_F(RankLogsTest, WithNoLogLeftToCloseRunningOutOfDescriptorsIsResourceExhausted) {
  RankLogs logs = Make(1);
  Status s = OkStatus();
  {
    FewDescriptors few(0);
    s = logs.Write(0, "x");
  }
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  EXPECT_NE(s.message().find(Path(0)), std::string::npos) << s.message();
}

TEST_F(RankLogsTest, ALogThatCannotBeOpenedIsAnErrorNamingItsPath) {
  RankLogs logs([this](int) { return dir_ + "/missing/rank-0.log"; }, 1);
  Status s = logs.Write(0, "x");
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.ToString();  // ENOENT, as ErrnoCode says
  EXPECT_NE(s.message().find(dir_ + "/missing/rank-0.log"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace jaxtrain::controller
