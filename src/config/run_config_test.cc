#include "config/run_config.h"

#include <gtest/gtest.h>

#include <regex>

namespace jaxtrain::config {
namespace {

TEST(RunConfigTest, DefaultNameIsUtcTimestamp) {
  FakeClock clock;  // 1.7e9 s = 2023-11-14 22:13:20 UTC
  auto c = RunConfig::Create({}, clock);
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(std::regex_match(c->name(),
                               std::regex(R"(jaxtrain_run-2023-11-14_22-13-20\.000-[0-9a-f]{6})")))
      << c->name();
}

TEST(RunConfigTest, RunsStartedAtTheSameMomentGetTheirOwnNames) {
  FakeClock clock;  // the clock does not move between the two
  auto a = RunConfig::Create({}, clock);
  auto b = RunConfig::Create({}, clock);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->name(), b->name());
}

TEST(RunConfigTest, DefaultStoragePathIsUnderHome) {
  setenv("HOME", "/home/u", 1);
  auto c = RunConfig::Create({});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->storage_path(), "/home/u/jaxtrain_results");
}

TEST(RunConfigTest, KeepsGivenValues) {
  auto c = RunConfig::Create({.name = "exp1", .storage_path = "/mnt/nfs"});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->name(), "exp1");
  EXPECT_EQ(c->storage_path(), "/mnt/nfs");
}

TEST(RunConfigTest, RejectsNamesThatAreNotOneDirectory) {
  for (const char* bad : {"", ".", "..", "a/b"}) {
    auto c = RunConfig::Create({.name = std::string(bad)});
    ASSERT_FALSE(c.ok()) << bad;
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find("RunConfig.name='" + std::string(bad) + "'"),
              std::string::npos);
  }
}

TEST(RunConfigTest, RejectsEmptyStoragePath) {
  auto c = RunConfig::Create({.storage_path = std::string()});
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("RunConfig.storage_path=''"), std::string::npos);
}

TEST(CheckpointConfigTest, DefaultsKeepEverythingRankedByRecency) {
  auto c = CheckpointConfig::Create({});
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->input().num_to_keep.has_value());
  EXPECT_TRUE(c->higher_is_better());
}

TEST(CheckpointConfigTest, RejectsBadValuesNamingTheField) {
  auto keep = CheckpointConfig::Create({.num_to_keep = 0});
  EXPECT_EQ(keep.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(keep.status().message().find("CheckpointConfig.num_to_keep=0"), std::string::npos);
  auto order = CheckpointConfig::Create({.checkpoint_score_order = "best"});
  EXPECT_EQ(order.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(order.status().message().find("checkpoint_score_order='best'"), std::string::npos);
  auto attr = CheckpointConfig::Create({.checkpoint_score_attribute = ""});
  EXPECT_EQ(attr.status().code(), StatusCode::kInvalidArgument);
}

TEST(FailureConfigTest, AcceptsMinusOneAndRejectsLess) {
  EXPECT_TRUE(FailureConfig::Create({.max_failures = -1}).ok());
  auto bad = FailureConfig::Create({.max_failures = -2});
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("FailureConfig.max_failures=-2"), std::string::npos);
}

TEST(FailureConfigTest, PreemptionsHaveABudgetAndAGraceOfTheirOwn) {
  auto c = FailureConfig::Create({});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->max_preemption_failures(), -1);
  EXPECT_EQ(c->preemption_grace_s(), 30);
  auto budget = FailureConfig::Create({.max_preemption_failures = -3});
  EXPECT_EQ(budget.status().message(),
            "FailureConfig.max_preemption_failures=-3 is not allowed; use 0, a positive number, or "
            "-1 (without limit)");
  auto grace = FailureConfig::Create({.preemption_grace_s = 0});
  EXPECT_EQ(grace.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(grace.status().message().find("FailureConfig.preemption_grace_s=0"), std::string::npos);
}

TEST(FailureConfigTest, ARestartWaitsMinutesForAnUnreachableHostUnlessToldOtherwise) {
  auto c = FailureConfig::Create({});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->unreachable_host_timeout_s(), 300);
  EXPECT_TRUE(FailureConfig::Create({.unreachable_host_timeout_s = 0}).ok());
  auto negative = FailureConfig::Create({.unreachable_host_timeout_s = -1});
  EXPECT_EQ(negative.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(negative.status().message().find("FailureConfig.unreachable_host_timeout_s=-1"),
            std::string::npos);
  EXPECT_NE(negative.status().message().find("give a number of seconds >= 0"), std::string::npos);
}

TEST(FailureConfigTest, TheAutomaticProgressLimitExcludesAFixedOne) {
  EXPECT_TRUE(FailureConfig::Create({.progress_timeout_auto = true})->progress_timeout_auto());
  EXPECT_FALSE(FailureConfig::Create({})->progress_timeout_auto());
  StatusOr<FailureConfig> both =
      FailureConfig::Create({.progress_timeout_s = 5, .progress_timeout_auto = true});
  EXPECT_EQ(both.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(both.status().message(),
            "FailureConfig.progress_timeout_s=5 and the automatic limit cannot both be given; "
            "give one");
}

TEST(FailureConfigTest, SecondsInErrorsAreEchoedAsGiven) {
  EXPECT_EQ(FailureConfig::Create({.progress_timeout_s = -1}).status().message(),
            "FailureConfig.progress_timeout_s=-1 is not allowed; give a number of seconds > 0, "
            "or None to turn the progress watchdog off");
  EXPECT_EQ(FailureConfig::Create({.preemption_grace_s = 0}).status().message(),
            "FailureConfig.preemption_grace_s=0 is not allowed; give a number of seconds > 0");
  EXPECT_EQ(FailureConfig::Create({.unreachable_host_timeout_s = -1e-05}).status().message(),
            "FailureConfig.unreachable_host_timeout_s=-1e-05 is not allowed; give a number of "
            "seconds >= 0 (0: a restart fails at once when a host cannot be reached)");
  EXPECT_NE(FailureConfig::Create({.preemption_grace_s = -0.1234567})
                .status()
                .message()
                .find("preemption_grace_s=-0.1234567 is"),
            std::string::npos);
}

}  // namespace
}  // namespace jaxtrain::config
