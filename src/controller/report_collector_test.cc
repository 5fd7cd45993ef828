#include "controller/report_collector.h"

#include <gtest/gtest.h>

namespace jaxtrain::controller {
namespace {

TEST(ReportCollectorTest, ARoundCompletesWhenEveryRankReported) {
  ReportCollector c(3, 1);
  EXPECT_TRUE(c.Add(1, "{\"r\":1}").empty());
  EXPECT_TRUE(c.Add(0, "{\"r\":0}").empty());
  auto rounds = c.Add(2, "{\"r\":2}");
  ASSERT_EQ(rounds.size(), 1u);
  EXPECT_EQ(rounds[0].round, 1u);
  EXPECT_EQ(rounds[0].metrics_json, "{\"r\":0}");
  EXPECT_EQ(c.next_round(), 2u);
}

TEST(ReportCollectorTest, AFastRankRunsAheadWithoutLosingOrder) {
  ReportCollector c(2, 5);
  c.Add(0, "a");
  c.Add(0, "b");
  c.Add(0, "c");
  auto rounds = c.Add(1, "x");
  ASSERT_EQ(rounds.size(), 1u);
  EXPECT_EQ(rounds[0].round, 5u);
  EXPECT_EQ(rounds[0].metrics_json, "a");
  rounds = c.Add(1, "y");
  ASSERT_EQ(rounds.size(), 1u);
  EXPECT_EQ(rounds[0].metrics_json, "b");
  EXPECT_NE(c.CountMismatchWarning().find("rank 0: 3"), std::string::npos);
  auto rest = c.TakeUnmatchedRank0();
  ASSERT_EQ(rest.size(), 1u);
  EXPECT_EQ(rest[0].round, 7u);
  EXPECT_EQ(rest[0].metrics_json, "c");
}

TEST(ReportCollectorTest, NamesTheRanksThatReportedDifferently) {
  ReportCollector c(4, 1);
  for (int r = 0; r < 4; ++r) c.Add(r, "{}");
  c.Add(0, "{}");
  c.Add(2, "{}");
  EXPECT_EQ(c.CountMismatchWarning(),
            "ranks called report() different numbers of times (ranks 1,3: 1; ranks 0,2: 2); every "
            "rank must call report() the same number of times, in the same order");
}

TEST(ReportCollectorTest, NoWarningWhenCountsAgree) {
  ReportCollector c(2, 1);
  c.Add(0, "{}");
  c.Add(1, "{}");
  EXPECT_EQ(c.CountMismatchWarning(), "");
}

}  // namespace
}  // namespace jaxtrain::controller
