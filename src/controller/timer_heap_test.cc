#include "controller/timer_heap.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>

namespace jaxtrain::controller {
namespace {

using std::chrono::seconds;

TimePoint At(int s) { return TimePoint(seconds(s)); }

// Every key that has expired at `now`, in the order the heap gives them.
std::vector<int> PopAll(TimerHeap& t, TimePoint now) {
  std::vector<int> fired;
  while (auto k = t.PopExpired(now)) fired.push_back(*k);
  return fired;
}

TEST(TimerHeapTest, PopsExpiredTimersEarliestFirst) {
  TimerHeap t;
  t.Set(3, At(30));
  t.Set(1, At(10));
  t.Set(2, At(20));
  EXPECT_EQ(t.Next(), At(10));
  EXPECT_EQ(t.PopExpired(At(25)), 1);
  EXPECT_EQ(t.PopExpired(At(25)), 2);
  EXPECT_EQ(t.PopExpired(At(25)), std::nullopt);
  EXPECT_EQ(t.Next(), At(30));
  EXPECT_TRUE(t.armed(3));
  EXPECT_FALSE(t.armed(1));
}

TEST(TimerHeapTest, ADeadlineOfNowHasExpired) {
  TimerHeap t;
  t.Set(0, At(5));
  EXPECT_EQ(t.PopExpired(At(4)), std::nullopt);
  EXPECT_EQ(t.PopExpired(At(5)), 0);
  EXPECT_TRUE(t.empty());
}

TEST(TimerHeapTest, SettingAnArmedKeyMovesItsTimer) {
  TimerHeap t;
  t.Set(0, At(10));
  t.Set(1, At(20));
  t.Set(0, At(30));  // later
  EXPECT_EQ(t.size(), 2u);
  EXPECT_EQ(t.Next(), At(20));
  t.Set(0, At(5));  // earlier
  EXPECT_EQ(t.Next(), At(5));
  EXPECT_EQ(t.deadline(0), At(5));
  EXPECT_EQ(t.deadline(1), At(20));
}

TEST(TimerHeapTest, CancelledTimersNeverFire) {
  TimerHeap t;
  for (int k = 0; k < 5; ++k) t.Set(k, At(k));
  t.Cancel(0);
  t.Cancel(3);
  t.Cancel(3);   // not armed any more: nothing
  t.Cancel(42);  // never armed: nothing
  EXPECT_EQ(PopAll(t, At(100)), (std::vector<int>{1, 2, 4}));
}

TEST(TimerHeapTest, TiesFireInKeyOrder) {
  TimerHeap t;
  t.Set(7, At(1));
  t.Set(2, At(1));
  t.Set(5, At(1));
  EXPECT_EQ(PopAll(t, At(1)), (std::vector<int>{2, 5, 7}));
}

TEST(TimerHeapTest, ClearDisarmsEverything) {
  TimerHeap t;
  t.Set(0, At(1));
  t.Set(9, At(2));
  t.Clear();
  EXPECT_TRUE(t.empty());
  EXPECT_FALSE(t.armed(9));
  EXPECT_EQ(t.Next(), std::nullopt);
}

// Random sets, moves and cancels against a plain list: the heap always fires in deadline order.
TEST(TimerHeapTest, AgreesWithASortedListUnderRandomUse) {
  std::mt19937 rng(7);
  TimerHeap t;
  std::vector<std::optional<int>> model(64);
  for (int step = 0; step < 20000; ++step) {
    const int key = static_cast<int>(rng() % model.size());
    switch (rng() % 4) {
      case 0:
      case 1: {
        const int at = static_cast<int>(rng() % 1000);
        t.Set(key, At(at));
        model[static_cast<size_t>(key)] = at;
        break;
      }
      case 2:
        t.Cancel(key);
        model[static_cast<size_t>(key)].reset();
        break;
      case 3: {
        std::optional<std::pair<int, int>> first;  // (deadline, key)
        for (size_t k = 0; k < model.size(); ++k) {
          if (!model[k]) continue;
          std::pair<int, int> e{*model[k], static_cast<int>(k)};
          if (!first || e < *first) first = e;
        }
        const auto popped = t.PopExpired(At(500));
        if (first && first->first <= 500) {
          ASSERT_EQ(popped, first->second);
          model[static_cast<size_t>(first->second)].reset();
        } else {
          ASSERT_EQ(popped, std::nullopt);
        }
        break;
      }
    }
    const size_t armed = static_cast<size_t>(
        std::count_if(model.begin(), model.end(), [](const auto& m) { return m.has_value(); }));
    ASSERT_EQ(t.size(), armed);
  }
}

}  // namespace
}  // namespace jaxtrain::controller
