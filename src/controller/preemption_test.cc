#include "controller/preemption.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace jaxtrain::controller {
namespace {

using nlohmann::json;

const TimePoint kDeadline = TimePoint{} + std::chrono::seconds(30);

TEST(PreemptionNoticeTest, AgreesOnePastTheMostCallsOnceEveryRankHasAnswered) {
  PreemptionNotice p(3);
  EXPECT_FALSE(p.open());
  EXPECT_TRUE(p.Notice(2, "node-2", {2}, "SIGTERM", kDeadline, 5000));
  EXPECT_TRUE(p.open());
  EXPECT_EQ(p.first_rank(), 2);
  EXPECT_FALSE(p.Answer(0, 7, 7));
  EXPECT_FALSE(p.Answer(2, 8, 8));
  EXPECT_FALSE(p.Answer(2, 8, 8)) << "an answer given twice counts once";
  std::optional<std::string> agreed = p.Answer(1, 6, 9);
  ASSERT_TRUE(agreed);
  json j = json::parse(*agreed);
  EXPECT_EQ(j["kind"], "agreed");
  EXPECT_EQ(j["sync_call"], 9);
  EXPECT_EQ(j["deadline_ms"], 5000);
  EXPECT_EQ(j["preempted_node_to_ranks"], json({{"node-2", {2}}}));
  EXPECT_TRUE(p.agreed());
  EXPECT_FALSE(p.Answer(0, 9, 9)) << "agreed once";
  // Rounds past the most any rank had reported were reported after the notice.
  EXPECT_FALSE(p.AfterNotice(9));
  EXPECT_TRUE(p.AfterNotice(10));
}

TEST(PreemptionNoticeTest, NothingIsAfterTheNoticeBeforeItIsAgreed) {
  PreemptionNotice p(2);
  p.Notice(0, "a", {0}, "SIGTERM", kDeadline, 1);
  EXPECT_FALSE(p.AfterNotice(100));
}

TEST(PreemptionNoticeTest, ASecondHostJoinsBeforeTheAgreementWithTheEarlierDeadline) {
  PreemptionNotice p(4);
  EXPECT_TRUE(p.Notice(3, "node-b", {3, 2}, "SIGTERM", kDeadline, 9000));
  EXPECT_FALSE(p.Notice(2, "node-b", {2, 3}, "SIGTERM", kDeadline, 9000)) << "its host is named";
  EXPECT_FALSE(
      p.Notice(0, "node-a", {1, 0}, "metadata", kDeadline - std::chrono::seconds(5), 4000));
  EXPECT_EQ(p.deadline(), kDeadline - std::chrono::seconds(5));
  EXPECT_EQ(p.Describe(), "host node-a (ranks 0, 1); host node-b (ranks 2, 3), by SIGTERM");
  std::optional<std::string> agreed;
  for (int rank = 0; rank < 4; ++rank) agreed = p.Answer(rank, 0, 0);
  ASSERT_TRUE(agreed);
  json j = json::parse(*agreed);
  EXPECT_EQ(j["sync_call"], 1);
  EXPECT_EQ(j["deadline_ms"], 4000);
  EXPECT_EQ(j["preempted_node_to_ranks"], json({{"node-a", {0, 1}}, {"node-b", {2, 3}}}));
  EXPECT_FALSE(p.Notice(1, "node-c", {1}, "SIGTERM", kDeadline, 1)) << "after it: only noted";
  EXPECT_EQ(json::parse(*agreed)["preempted_node_to_ranks"].size(), 2u);
}

TEST(PreemptionNoticeTest, AnAnswerWithoutANoticeOrFromNoRankIsIgnored) {
  PreemptionNotice p(1);
  EXPECT_FALSE(p.Answer(0, 1, 1));
  p.Notice(0, "h", {0}, "SIGTERM", kDeadline, 1);
  EXPECT_FALSE(p.Answer(5, 1, 1));
  EXPECT_FALSE(p.Answer(-1, 1, 1));
  EXPECT_TRUE(p.Answer(0, 1, 1));
}

TEST(PreemptionNoticeTest, OneRankIsNamedInTheSingular) {
  PreemptionNotice p(1);
  p.Notice(0, "vm", {0}, "SIGTERM", kDeadline, 1);
  EXPECT_EQ(p.Describe(), "host vm (rank 0), by SIGTERM");
}

}  // namespace
}  // namespace jaxtrain::controller
