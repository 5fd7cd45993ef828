#include "controller/failure_policy.h"

#include <gtest/gtest.h>

#include <tuple>
#include <vector>

namespace jaxtrain::controller {
namespace {

using Action = FailureDecision::Action;

TEST(FailurePolicyTest, NoRestartsByDefault) {
  FailurePolicy p(0, 0);
  FailureDecision d = p.Decide(FailureCause::kException);
  EXPECT_EQ(d.action, Action::kRaise);
  EXPECT_NE(d.reason.find("FailureConfig.max_failures"), std::string::npos) << d.reason;
}

TEST(FailurePolicyTest, RestartsUntilTheBudgetIsSpent) {
  FailurePolicy p(2, 0);
  EXPECT_EQ(p.Decide(FailureCause::kSignal).reason, "restart 1 of 2 (FailureConfig.max_failures)");
  EXPECT_TRUE(p.Decide(FailureCause::kException).retry());
  EXPECT_EQ(p.Decide(FailureCause::kConnection).action, Action::kRaise);
  EXPECT_EQ(p.failures(), 3);
}

TEST(FailurePolicyTest, MinusOneMeansWithoutLimit) {
  FailurePolicy p(-1, 0);
  for (int i = 0; i < 1000; ++i) ASSERT_TRUE(p.Decide(FailureCause::kWatchdog).retry());
}

TEST(FailurePolicyTest, StartUpFailuresHaveTheirOwnBudget) {
  FailurePolicy p(0, 2);
  EXPECT_TRUE(p.Decide(FailureCause::kStartUp).retry());
  EXPECT_TRUE(p.Decide(FailureCause::kStartUp).retry());
  EXPECT_FALSE(p.Decide(FailureCause::kStartUp).retry());
  EXPECT_EQ(p.failures(), 0);
  EXPECT_FALSE(p.Decide(FailureCause::kException).retry());
}

// The whole table: each cause and code, with every budget generous, is retried or raised.
TEST(FailurePolicyTest, DecidesEachCauseAndCodeAsTheTableSays) {
  const std::vector<std::tuple<FailureCause, StatusCode, Action>> table = {
      {FailureCause::kException, StatusCode::kOk, Action::kRetry},
      {FailureCause::kExit, StatusCode::kOk, Action::kRetry},
      {FailureCause::kSignal, StatusCode::kOk, Action::kRetry},
      {FailureCause::kOom, StatusCode::kOk, Action::kRetry},
      {FailureCause::kConnection, StatusCode::kOk, Action::kRetry},
      {FailureCause::kWatchdog, StatusCode::kOk, Action::kRetry},
      {FailureCause::kStartUp, StatusCode::kOk, Action::kRetry},
      {FailureCause::kStorage, StatusCode::kResourceExhausted, Action::kRetry},  // ENOSPC
      {FailureCause::kStorage, StatusCode::kUnavailable, Action::kRetry},        // EIO
      {FailureCause::kStorage, StatusCode::kPermissionDenied, Action::kRaise},
      {FailureCause::kStorage, StatusCode::kInvalidArgument, Action::kRaise},
      {FailureCause::kStorage, StatusCode::kFailedPrecondition, Action::kRaise},
      {FailureCause::kStorage, StatusCode::kInternal, Action::kRaise},
      {FailureCause::kCheckpoint, StatusCode::kResourceExhausted, Action::kRetry},
      {FailureCause::kCheckpoint, StatusCode::kUnavailable, Action::kRetry},
      {FailureCause::kCheckpoint, StatusCode::kInvalidArgument, Action::kRaise},  // ranks disagree
      {FailureCause::kCheckpoint, StatusCode::kAlreadyExists, Action::kRaise},
      {FailureCause::kCheckpoint, StatusCode::kOk, Action::kRaise},  // committed, not indexed
      {FailureCause::kDriver, StatusCode::kOk, Action::kRaise},
  };
  for (const auto& [cause, code, action] : table) {
    FailurePolicy p(-1, -1);
    FailureDecision d = p.Decide(cause, code);
    EXPECT_EQ(d.action, action) << FailureCauseName(cause) << " " << StatusCodeName(code) << ": "
                                << d.reason;
    EXPECT_FALSE(d.reason.empty());
  }
}

TEST(FailurePolicyTest, TransientStorageErrorsAreRetriedABoundedNumberOfTimes) {
  FailurePolicy p(0, 0);  // no restarts asked for: a full disk is still retried, twice
  for (int i = 0; i < FailurePolicy::kMaxStorageFailures; ++i) {
    FailureDecision d = p.Decide(FailureCause::kStorage, StatusCode::kResourceExhausted);
    ASSERT_TRUE(d.retry()) << d.reason;
  }
  FailureDecision d = p.Decide(FailureCause::kStorage, StatusCode::kUnavailable);
  EXPECT_FALSE(d.retry());
  EXPECT_NE(d.reason.find("storage retry limit"), std::string::npos) << d.reason;
  EXPECT_EQ(p.failures(), 0);
  EXPECT_EQ(p.storage_failures(), 3);
}

TEST(FailurePolicyTest, APermissionErrorIsNeverRetried) {
  FailurePolicy p(-1, -1);
  FailureDecision d = p.Decide(FailureCause::kStorage, StatusCode::kPermissionDenied);
  EXPECT_FALSE(d.retry());
  EXPECT_EQ(d.reason, "retrying cannot help (a permission is missing)");
  EXPECT_EQ(p.storage_failures(), 0);
}

TEST(FailurePolicyTest, EveryCauseHasItsRunJsonName) {
  EXPECT_EQ(FailureCauseName(FailureCause::kStartUp), "start-up");
  EXPECT_EQ(FailureCauseName(FailureCause::kOom), "oom");
  EXPECT_EQ(FailureCauseName(FailureCause::kStorage), "storage");
  EXPECT_EQ(FailureActionName(Action::kRetry), "retry");
}

TEST(FailurePolicyTest, PreemptionsCountAgainstTheirOwnBudgetOnly) {
  FailurePolicy p(/*max_failures=*/0, /*max_start_failures=*/0, FailurePolicy::kMaxStorageFailures,
                  /*max_preemptions=*/1);
  EXPECT_TRUE(p.Decide(FailureCause::kPreemption).retry());
  EXPECT_EQ(p.failures(), 0);
  EXPECT_EQ(p.Decide(FailureCause::kPreemption).reason,
            "failure 2, over the 1 restarts that FailureConfig.max_preemption_failures allows");
  EXPECT_TRUE(IsTrainingFailure(FailureCause::kWatchdog));
  EXPECT_FALSE(IsTrainingFailure(FailureCause::kPreemption));
  EXPECT_FALSE(IsTrainingFailure(FailureCause::kStartUp));
}

}  // namespace
}  // namespace jaxtrain::controller
