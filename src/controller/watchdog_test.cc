#include "controller/watchdog.h"

#include <gtest/gtest.h>

namespace jaxtrain::controller {
namespace {

using std::chrono::seconds;

// The rank Check() blames now, or -1 when no rank is stale.
int Blamed(Watchdog& w) {
  std::optional<Watchdog::Stale> stale = w.Check();
  return stale ? stale->blamed : -1;
}

TEST(WatchdogTest, ARankIsArmedByItsFirstProgress) {
  FakeClock clock;
  Watchdog w(clock, 3, seconds(10));
  EXPECT_EQ(w.NextDeadline(), std::nullopt);
  clock.Advance(seconds(100));
  EXPECT_EQ(w.Check(), std::nullopt);  // nobody has reported: nobody is stale
  w.Progress(1);
  EXPECT_EQ(w.NextDeadline(), clock.Now() + seconds(10));
  clock.Advance(seconds(9));
  EXPECT_EQ(w.Check(), std::nullopt);
  clock.Advance(seconds(1));
  auto stale = w.Check();
  ASSERT_TRUE(stale.has_value());
  EXPECT_EQ(stale->blamed, 1);
  EXPECT_EQ(stale->ranks, (std::vector<int>{1}));
}

TEST(WatchdogTest, ProgressPostponesStaleness) {
  FakeClock clock;
  Watchdog w(clock, 2, seconds(10));
  w.Progress(0);
  for (int i = 0; i < 5; ++i) {
    clock.Advance(seconds(6));
    w.Progress(0);
    EXPECT_EQ(w.Check(), std::nullopt);
  }
  // The timer may have fired early; it is never later than the real deadline.
  ASSERT_TRUE(w.NextDeadline().has_value());
  EXPECT_LE(*w.NextDeadline(), clock.Now() + seconds(10));
  clock.Advance(seconds(10));
  EXPECT_EQ(Blamed(w), 0);
}

TEST(WatchdogTest, NamesEveryStaleRankAndBlamesTheOneStaleLongest) {
  FakeClock clock;
  Watchdog w(clock, 4, seconds(10));
  w.Progress(2);  // armed first, then reports again: stale second
  clock.Advance(seconds(1));
  w.Progress(3);  // stale longest
  clock.Advance(seconds(1));
  w.Progress(2);
  w.Progress(0);
  clock.Advance(seconds(30));
  w.Progress(1);  // fresh
  auto stale = w.Check();
  ASSERT_TRUE(stale.has_value());
  EXPECT_EQ(stale->blamed, 3);
  EXPECT_EQ(stale->ranks, (std::vector<int>{0, 2, 3}));
  // Still stale when asked again.
  auto again = w.Check();
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->ranks, stale->ranks);
}

TEST(WatchdogTest, TiedRanksBlameTheLowest) {
  FakeClock clock;
  Watchdog w(clock, 3, seconds(5));
  w.Progress(2);
  w.Progress(1);
  clock.Advance(seconds(5));
  EXPECT_EQ(Blamed(w), 1);
}

TEST(WatchdogTest, ADoneRankIsNeverStale) {
  FakeClock clock;
  Watchdog w(clock, 2, seconds(5));
  w.Progress(0);
  w.Progress(1);
  w.Done(0);
  w.Progress(0);  // a late report after done re-arms nothing
  clock.Advance(seconds(60));
  auto stale = w.Check();
  ASSERT_TRUE(stale.has_value());
  EXPECT_EQ(stale->ranks, (std::vector<int>{1}));
  w.Done(1);
  EXPECT_EQ(w.Check(), std::nullopt);
  EXPECT_EQ(w.NextDeadline(), std::nullopt);
}

TEST(WatchdogTest, OffWithAZeroTimeout) {
  FakeClock clock;
  Watchdog w(clock, 2, Duration::zero());
  w.Progress(0);
  EXPECT_EQ(w.NextDeadline(), std::nullopt);
  clock.Advance(seconds(3600));
  EXPECT_EQ(w.Check(), std::nullopt);
}

// Many ranks reporting steadily: timers fire about once per timeout each, never every report.
TEST(WatchdogTest, SteadyReportsMoveEachTimerAboutOncePerTimeout) {
  FakeClock clock;
  constexpr int kRanks = 1000;
  Watchdog w(clock, kRanks, seconds(10));
  int wakes = 0;
  for (int tick = 0; tick < 100; ++tick) {  // 100 s, every rank reporting every second
    for (int r = 0; r < kRanks; ++r) w.Progress(r);
    clock.Advance(seconds(1));
    if (w.NextDeadline() && *w.NextDeadline() <= clock.Now()) {
      ++wakes;
      EXPECT_EQ(w.Check(), std::nullopt);
    }
    ASSERT_GT(*w.NextDeadline(), clock.Now());
  }
  EXPECT_LE(wakes, 11);
}

TEST(WatchdogTest, TheAutomaticLimitIsTheFloorUntilAMultipleOfTheStepTimeExceedsIt) {
  FakeClock clock;
  Watchdog w(clock, 2, AutoLimit{.floor = seconds(60), .multiple = 10});
  EXPECT_TRUE(w.enabled());
  EXPECT_EQ(w.timeout(), seconds(60));
  w.SetStepTime(seconds(2));  // 10 x 2 s is under the floor
  EXPECT_EQ(w.timeout(), seconds(60));
  w.Progress(0);
  clock.Advance(seconds(59));  // a slow step, a checkpoint: far over 10 steps, under the floor
  EXPECT_EQ(w.Check(), std::nullopt);
  w.Progress(0);
  w.SetStepTime(seconds(9));
  EXPECT_EQ(w.timeout(), seconds(90));
  clock.Advance(seconds(89));
  EXPECT_EQ(w.Check(), std::nullopt);  // the timer set under 60 s moved to the longer limit
  clock.Advance(seconds(1));
  EXPECT_EQ(Blamed(w), 0);
}

TEST(WatchdogTest, AFixedLimitIgnoresTheStepTime) {
  FakeClock clock;
  Watchdog w(clock, 1, seconds(10));
  w.SetStepTime(seconds(5));
  EXPECT_EQ(w.timeout(), seconds(10));
  EXPECT_FALSE(w.auto_limit().has_value());
}

}  // namespace
}  // namespace jaxtrain::controller
