#include "controller/status_line.h"

#include <gtest/gtest.h>

namespace jaxtrain::controller {
namespace {

TEST(StatusLineTest, StartsWithTheAttemptAndTheRanksUp) {
  EXPECT_EQ(FormatStatus({.attempt = 2, .ranks_up = 3, .world_size = 4}, 200),
            "[jaxtrain] attempt 2 | 3/4 ranks up");
}

TEST(StatusLineTest, ShowsTheLastRoundItsScalarMetricsAndTheRate) {
  StatusView v{.attempt = 0,
               .ranks_up = 4,
               .world_size = 4,
               .round = 12,
               .metrics_json = R"({"loss": 0.012345678, "step": 11, "phase": "warmup",)"
                               R"( "nested": {"a": 1}, "ok": true})",
               .rounds_per_s = 3.2};
  EXPECT_EQ(FormatStatus(v, 200),
            "[jaxtrain] attempt 0 | 4/4 ranks up | round 12 | loss=0.01235 step=11 "
            "phase=warmup ok=true | 3.2 rounds/s");
}

TEST(StatusLineTest, NamesTheStragglersAfterTheRanksUp) {
  StatusView v{.attempt = 0, .ranks_up = 4, .world_size = 4, .round = 3, .stragglers = {2}};
  EXPECT_EQ(FormatStatus(v, 200),
            "[jaxtrain] attempt 0 | 4/4 ranks up | straggler: rank 2 | round 3");
  v.stragglers = {1, 3};
  EXPECT_EQ(FormatStatus(v, 200),
            "[jaxtrain] attempt 0 | 4/4 ranks up | stragglers: ranks 1,3 | round 3");
}

TEST(StatusLineTest, IsCutToTheTerminalWidth) {
  StatusView v{.attempt = 0,
               .ranks_up = 1,
               .world_size = 1,
               .round = 1,
               .metrics_json = R"({"a_long_metric_name": 123456789})"};
  std::string line = FormatStatus(v, 30);
  EXPECT_EQ(line.size(), 30u);
  EXPECT_EQ(line.substr(27), "...");
  EXPECT_EQ(FormatStatus(v, 2), "");
}

TEST(StatusLineTest, IgnoresMetricsThatAreNotAnObject) {
  EXPECT_EQ(
      FormatStatus(
          {.attempt = 0, .ranks_up = 1, .world_size = 1, .round = 5, .metrics_json = "not json"},
          200),
      "[jaxtrain] attempt 0 | 1/1 ranks up | round 5");
}

}  // namespace
}  // namespace jaxtrain::controller
