#include "controller/stragglers.h"

#include <gtest/gtest.h>

namespace jaxtrain::controller {
namespace {

using std::chrono::milliseconds;

// Ranks that each report every `step[rank]` on a FakeClock, one round at a time: the slowest
// rank's step passes per round, and every rank reports as often as its step allows in it.
class Ranks {
 public:
  Ranks(StragglerDetector& d, std::vector<milliseconds> step) : d_(d), step_(std::move(step)) {
    next_.assign(step_.size(), clock_.Now());
  }
  // Advances by `ms` and delivers every report due by then, in time order; then one Evaluate().
  std::vector<StragglerChange> Round(milliseconds ms) {
    const TimePoint end = clock_.Now() + ms;
    for (;;) {
      size_t first = 0;
      for (size_t r = 1; r < next_.size(); ++r) {
        if (next_[r] < next_[first]) first = r;
      }
      if (next_[first] > end) break;
      clock_.Advance(next_[first] - clock_.Now());
      d_.Report(static_cast<int>(first), clock_.Now());
      next_[first] += step_[first];
    }
    clock_.Advance(end - clock_.Now());
    return d_.Evaluate();
  }
  void SetStep(int rank, milliseconds step) { step_[static_cast<size_t>(rank)] = step; }

 private:
  FakeClock clock_;
  StragglerDetector& d_;
  std::vector<milliseconds> step_;
  std::vector<TimePoint> next_;
};

constexpr StragglerRule kRule{
    .window = 3, .factor = 1.5, .min_excess = milliseconds(50), .rounds = 2};

TEST(StragglerDetectorTest, StepTimeIsTheMedianOfTheLastIntervals) {
  FakeClock clock;
  StragglerDetector d(1, kRule);
  d.Report(0, clock.Now());
  d.Evaluate();
  EXPECT_EQ(d.StepSeconds(0), std::nullopt);  // one report: no interval yet
  for (int ms : {100, 900, 200, 300}) {
    clock.Advance(milliseconds(ms));
    d.Report(0, clock.Now());
  }
  d.Evaluate();
  // The window holds the last 3 intervals: 900, 200, 300 ms.
  EXPECT_DOUBLE_EQ(*d.StepSeconds(0), 0.3);
}

TEST(StragglerDetectorTest, APersistentlySlowRankBecomesAStragglerAfterConsecutiveRounds) {
  StragglerDetector d(3, kRule);
  Ranks ranks(d, {milliseconds(100), milliseconds(100), milliseconds(400)});
  std::vector<StragglerChange> changes;
  int rounds = 0;
  while (changes.empty() && rounds < 20) {
    changes = ranks.Round(milliseconds(400));
    ++rounds;
    if (changes.empty()) {
      EXPECT_TRUE(d.Stragglers().empty());
    }
  }
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes[0].rank, 2);
  EXPECT_TRUE(changes[0].slow);
  EXPECT_DOUBLE_EQ(changes[0].step_s, 0.4);
  EXPECT_DOUBLE_EQ(changes[0].others_s, 0.1);
  EXPECT_EQ(d.Stragglers(), (std::vector<int>{2}));
  // Rank 2 reports at 0 and 400 ms in the first round: its window of 3 intervals is full in
  // round 3, the first slow round, and round 4 is the second consecutive one.
  EXPECT_EQ(rounds, 4);
  EXPECT_TRUE(ranks.Round(milliseconds(400)).empty());  // said once, not every round
}

TEST(StragglerDetectorTest, OneSlowRoundIsNoStraggler) {
  StragglerDetector d(2, kRule);
  Ranks ranks(d, {milliseconds(100), milliseconds(100)});
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(ranks.Round(milliseconds(400)).empty());
  ranks.SetStep(1, milliseconds(1000));  // one long step (a compilation, a GC pause)
  EXPECT_TRUE(ranks.Round(milliseconds(1000)).empty());
  ranks.SetStep(1, milliseconds(100));
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(ranks.Round(milliseconds(400)).empty());
  EXPECT_TRUE(d.Stragglers().empty());
}

TEST(StragglerDetectorTest, AStragglerThatCatchesUpIsSaidToStop) {
  StragglerDetector d(3, kRule);
  Ranks ranks(d, {milliseconds(100), milliseconds(100), milliseconds(500)});
  for (int i = 0; i < 6; ++i) ranks.Round(milliseconds(500));
  ASSERT_EQ(d.Stragglers(), (std::vector<int>{2}));
  ranks.SetStep(2, milliseconds(100));
  std::vector<StragglerChange> changes;
  int rounds = 0;
  while (changes.empty() && rounds < 20) {
    changes = ranks.Round(milliseconds(500));
    ++rounds;
  }
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes[0].rank, 2);
  EXPECT_FALSE(changes[0].slow);
  EXPECT_TRUE(d.Stragglers().empty());
}

TEST(StragglerDetectorTest, SmallDifferencesAreNotStragglers) {
  // 3x slower, but by 20 ms only: below min_excess, so noise, not a straggler.
  StragglerDetector d(2, kRule);
  Ranks ranks(d, {milliseconds(10), milliseconds(30)});
  for (int i = 0; i < 20; ++i) EXPECT_TRUE(ranks.Round(milliseconds(30)).empty());
  EXPECT_NEAR(*d.StepSeconds(1), 0.03, 1e-9);
}

TEST(StragglerDetectorTest, ASlowerMinorityIsMeasuredAgainstTheOthers) {
  // Two of five ranks are slow: each is compared with the median of the four others.
  StragglerDetector d(5, kRule);
  Ranks ranks(d, {milliseconds(100), milliseconds(300), milliseconds(100), milliseconds(300),
                  milliseconds(100)});
  for (int i = 0; i < 10; ++i) ranks.Round(milliseconds(300));
  EXPECT_EQ(d.Stragglers(), (std::vector<int>{1, 3}));
}

TEST(StragglerDetectorTest, ASingleRankIsNeverAStraggler) {
  StragglerDetector d(1, kRule);
  Ranks ranks(d, {milliseconds(500)});
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(ranks.Round(milliseconds(500)).empty());
}

}  // namespace
}  // namespace jaxtrain::controller
