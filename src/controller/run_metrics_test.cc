#include "controller/run_metrics.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "controller/stragglers.h"

namespace jaxtrain::controller {
namespace {

using namespace std::chrono_literals;

TEST(MetricsBookTest, CountsAttemptsReportsRoundsAndCommits) {
  MetricsBook book;
  book.CountAttempt("start");
  book.CountAttempt("exit");
  book.CountAttempt("exit");
  book.CountReport();
  book.CountReport();
  book.CountRound(7);
  book.CountCommit(1500ms, 100);
  book.CountRound(8);
  book.CountCommit(500ms, 40);
  StragglerDetector stragglers(2);
  const RunMetrics& m = book.Update("RUNNING", 2, 2, 1, stragglers);
  EXPECT_EQ(m.state, "RUNNING");
  EXPECT_EQ(m.attempt, 2);
  EXPECT_EQ(m.world_size, 2);
  EXPECT_EQ(m.ranks_up, 1);
  EXPECT_EQ(m.attempts_by_cause, (std::map<std::string, uint64_t>{{"exit", 2}, {"start", 1}}));
  EXPECT_EQ(m.reports, 2u);
  EXPECT_EQ(m.rounds, 2u);
  EXPECT_EQ(m.last_round, 8u);
  EXPECT_EQ(m.checkpoint_commit.count, 2u);
  EXPECT_DOUBLE_EQ(m.checkpoint_commit.sum_s, 2.0);
  EXPECT_DOUBLE_EQ(m.checkpoint_commit.last_s, 0.5);
  EXPECT_EQ(m.checkpoint_bytes, 140u);
  EXPECT_EQ(m.last_checkpoint_bytes, 40u);
  EXPECT_EQ(m.rank_step_s, (std::vector<std::optional<double>>{std::nullopt, std::nullopt}));
}

TEST(MetricsBookTest, ARestartIsTimedFromTheFirstFailureNoticedUntilTheNextGroupRegistered) {
  MetricsBook book;
  const TimePoint t0{};
  book.TrainingStarted(2s, t0 + 2s);  // the first group: no restart
  book.NoticeFailure(std::nullopt);   // an attempt that did not fail
  book.NoticeFailure(t0 + 10s);
  book.NoticeFailure(t0 + 12s);  // a later failure before training ran again: the first counts
  book.TrainingStarted(3s, t0 + 15s);
  book.NoticeFailure(t0 + 20s);
  book.TrainingStarted(1s, t0 + 21s);
  StragglerDetector stragglers(1);
  const RunMetrics& m = book.Update("RUNNING", 2, 1, 1, stragglers);
  EXPECT_EQ(m.group_start.count, 3u);
  EXPECT_DOUBLE_EQ(m.group_start.sum_s, 6.0);
  EXPECT_EQ(m.restart.count, 2u);
  EXPECT_DOUBLE_EQ(m.restart.sum_s, 6.0);
  EXPECT_DOUBLE_EQ(m.restart.last_s, 1.0);
}

TEST(MetricsBookTest, UpdateShowsTheAttemptsStepTimesAndStragglers) {
  MetricsBook book;
  StragglerDetector stragglers(3, {.window = 1, .rounds = 1});
  const TimePoint t0{};
  for (int i = 0; i <= 2; ++i) {
    for (int r = 0; r < 3; ++r) stragglers.Report(r, t0 + (r == 2 ? 3s : 1s) * i);
    stragglers.Evaluate();
  }
  RunMetrics m = book.Update("RUNNING", 0, 3, 3, stragglers);
  ASSERT_EQ(m.rank_step_s.size(), 3u);
  EXPECT_DOUBLE_EQ(m.rank_step_s[0].value_or(0), 1.0);
  EXPECT_DOUBLE_EQ(m.rank_step_s[2].value_or(0), 3.0);
  EXPECT_EQ(m.stragglers, std::vector<int>{2});
  m = book.Update("FINISHED", 0, 3, 3, stragglers);
  EXPECT_EQ(nlohmann::json::parse(RunMetricsJson(m))["state"], "FINISHED");
}

}  // namespace
}  // namespace jaxtrain::controller
