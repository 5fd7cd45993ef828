#include "controller/failure_policy.h"

#include <gtest/gtest.h>

namespace jaxtrain::controller {
namespace {

TEST(FailurePolicyTest, NoRestartsByDefault) {
  FailurePolicy p(0, 0);
  EXPECT_FALSE(p.ShouldRestart("exception"));
}

TEST(FailurePolicyTest, RestartsUntilTheBudgetIsSpent) {
  FailurePolicy p(2, 0);
  EXPECT_TRUE(p.ShouldRestart("signal"));
  EXPECT_TRUE(p.ShouldRestart("exception"));
  EXPECT_FALSE(p.ShouldRestart("connection"));
  EXPECT_EQ(p.failures(), 3);
}

TEST(FailurePolicyTest, MinusOneMeansWithoutLimit) {
  FailurePolicy p(-1, 0);
  for (int i = 0; i < 1000; ++i) ASSERT_TRUE(p.ShouldRestart("watchdog"));
}

TEST(FailurePolicyTest, StartUpFailuresHaveTheirOwnBudget) {
  FailurePolicy p(0, 2);
  EXPECT_TRUE(p.ShouldRestart("start-up"));
  EXPECT_TRUE(p.ShouldRestart("start-up"));
  EXPECT_FALSE(p.ShouldRestart("start-up"));
  EXPECT_EQ(p.failures(), 0);
  EXPECT_FALSE(p.ShouldRestart("exception"));
}

TEST(FailurePolicyTest, ACheckpointConflictIsNeverRetried) {
  FailurePolicy p(-1, -1);
  EXPECT_FALSE(p.ShouldRestart("checkpoint"));
}

}  // namespace
}  // namespace jaxtrain::controller
