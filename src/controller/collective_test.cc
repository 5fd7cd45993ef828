#include "controller/collective.h"

#include <gtest/gtest.h>

namespace jaxtrain::controller {
namespace {

using wire::CollectiveKind;

const TimePoint kT0{};

wire::Collective Barrier(uint64_t sequence) {
  return {.sequence = sequence, .kind = CollectiveKind::kBarrier};
}

wire::Collective Broadcast(uint64_t sequence, std::string_view data = "") {
  return {.sequence = sequence, .kind = CollectiveKind::kBroadcast, .data = data};
}

// Arrive() that is expected to succeed; its release, if any.
std::optional<Collectives::Release> Arrived(Collectives& c, int rank, const wire::Collective& call,
                                            TimePoint now = kT0) {
  auto r = c.Arrive(rank, call, now);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? *r : std::nullopt;
}

TEST(CollectivesTest, ReleasesACallOnceEveryRankHasMadeIt) {
  Collectives c(3);
  EXPECT_FALSE(Arrived(c, 2, Barrier(1)));
  EXPECT_FALSE(Arrived(c, 0, Barrier(1)));
  auto release = Arrived(c, 1, Barrier(1));
  ASSERT_TRUE(release);
  EXPECT_EQ(release->sequence, 1u);
  EXPECT_EQ(release->kind, CollectiveKind::kBarrier);
  EXPECT_EQ(release->data, "");
  EXPECT_EQ(c.next(), 2u);
}

TEST(CollectivesTest, ABroadcastReleasesRankZerosDataWhoeverArrivesLast) {
  Collectives c(3);
  EXPECT_FALSE(Arrived(c, 1, Broadcast(1)));
  EXPECT_FALSE(Arrived(c, 0, Broadcast(1, "rank 0's")));
  auto release = Arrived(c, 2, Broadcast(1, "ignored: not rank 0's"));
  ASSERT_TRUE(release);
  EXPECT_EQ(release->kind, CollectiveKind::kBroadcast);
  EXPECT_EQ(release->data, "rank 0's");
  // The next call starts afresh: no data is left from the last.
  EXPECT_FALSE(Arrived(c, 1, Broadcast(2)));
  EXPECT_FALSE(Arrived(c, 2, Broadcast(2)));
  EXPECT_EQ(Arrived(c, 0, Broadcast(2))->data, "");
}

TEST(CollectivesTest, OneRankIsReleasedAtOnce) {
  Collectives c(1);
  EXPECT_EQ(Arrived(c, 0, Broadcast(1, "x"))->data, "x");
  EXPECT_TRUE(Arrived(c, 0, Barrier(2)));
}

TEST(CollectivesTest, DifferentCallsUnderOneNumberFailNamingTheRanksAndCalls) {
  Collectives c(4);
  Arrived(c, 0, Barrier(1));
  Arrived(c, 3, Barrier(1));
  auto r = c.Arrive(2, Broadcast(1), kT0);
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.status().message(),
            "the ranks made different collective calls as their call 1: ranks 0, 3 called "
            "barrier(), rank 2 called broadcast_from_rank_zero(); every rank must make the same "
            "jaxtrain.collective calls in the same order");
}

TEST(CollectivesTest, ACallOutOfOrderIsAProtocolError) {
  Collectives c(2);
  auto ahead = c.Arrive(1, Barrier(2), kT0);
  EXPECT_EQ(ahead.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ahead.status().message(), "rank 1 made collective call 2 while call 1 was pending");
  Arrived(c, 1, Barrier(1));
  auto twice = c.Arrive(1, Barrier(1), kT0);
  EXPECT_EQ(twice.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(twice.status().message(),
            "rank 1 made collective call 1 while call 1 was pending, which it had made already");
}

TEST(CollectivesTest, ARankThatReturnsWhileOthersWaitFailsTheCall) {
  Collectives c(3);
  Arrived(c, 0, Barrier(1));
  Arrived(c, 2, Barrier(1));
  Status s = c.Done(1);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "rank 1's training function returned without calling barrier() (collective call 1); "
            "waiting in it: ranks 0, 2; every rank must make the same jaxtrain.collective calls "
            "in the same order");
}

TEST(CollectivesTest, ACallAfterARankReturnedFails) {
  Collectives c(2);
  EXPECT_TRUE(Arrived(c, 0, Barrier(1)) == std::nullopt);
  EXPECT_TRUE(Arrived(c, 1, Barrier(1)));
  EXPECT_TRUE(c.Done(1).ok());  // nobody waits: every rank may return now
  auto r = c.Arrive(0, Broadcast(2, "x"), kT0);
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.status().message(),
            "rank 0 called broadcast_from_rank_zero() (collective call 2) after rank 1's training "
            "function had returned without making it; every rank must make the same "
            "jaxtrain.collective calls in the same order");
}

TEST(CollectivesTest, EveryRankReturningAfterItsCallsIsFine) {
  Collectives c(2);
  Arrived(c, 0, Barrier(1));
  Arrived(c, 1, Barrier(1));
  EXPECT_TRUE(c.Done(0).ok());
  EXPECT_TRUE(c.Done(1).ok());
}

TEST(CollectivesTest, WarnsEveryIntervalWhileRanksWaitNamingTheMissing) {
  Collectives c(3);
  EXPECT_EQ(c.NextWarning(), std::nullopt);
  const TimePoint t = kT0 + std::chrono::seconds(5);
  Arrived(c, 0, Broadcast(1, "x"), t);
  Arrived(c, 2, Broadcast(1), t + std::chrono::seconds(1));
  ASSERT_EQ(c.NextWarning(), t + Collectives::kWarnInterval);
  EXPECT_EQ(c.TakeWarning(t + std::chrono::seconds(59)), "");
  EXPECT_EQ(c.TakeWarning(t + std::chrono::seconds(61)),
            "ranks 0, 2 have waited 61 s in broadcast_from_rank_zero() (collective call 1) for "
            "rank 1 to make it; every rank must make the same jaxtrain.collective calls in the "
            "same order (said every 60 s while they wait)");
  EXPECT_EQ(c.TakeWarning(t + std::chrono::seconds(62)), "");  // said once per interval
  EXPECT_EQ(c.NextWarning(), t + 2 * Collectives::kWarnInterval);
  Arrived(c, 1, Broadcast(1), t + std::chrono::seconds(70));
  EXPECT_EQ(c.NextWarning(), std::nullopt);  // released: nobody waits
}

TEST(RankListTest, NamesFewRanksAndCountsMany) {
  EXPECT_EQ(RankList({3}), "rank 3");
  EXPECT_EQ(RankList({0, 1, 2}), "ranks 0, 1, 2");
  std::vector<int> many;
  for (int r = 0; r < 40; ++r) many.push_back(r);
  EXPECT_EQ(RankList(many), "ranks 0, 1, 2, 3, 4, 5, 6, 7, ... (40 ranks)");
}

}  // namespace
}  // namespace jaxtrain::controller
