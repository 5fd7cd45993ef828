#include "controller/rank_stacks.h"

#include <gtest/gtest.h>

namespace jaxtrain::controller {
namespace {

constexpr uint64_t kMain = 0x7f0000001000;

// A dump as faulthandler.dump_traceback(all_threads=True) writes it from a thread that is not
// Python's: a helper thread first, then the training thread.
std::string Dump(const std::string& training_frames) {
  return "Thread 0x00007f0000002000 (most recent call first):\n"
         "  File \"/usr/lib/python3.11/threading.py\", line 331 in wait\n"
         "  File \"/app/loader.py\", line 9 in _fill\n"
         "\n"
         "Thread 0x00007f0000001000 (most recent call first):\n" +
         training_frames + "\n";
}

const std::string kWaitsInAllgather =
    "  File \"/venv/lib/python3.11/site-packages/jax/_src/array.py\", line 610 in _value\n"
    "  File \"/venv/lib/python3.11/site-packages/jax/experimental/multihost_utils.py\", line 235 "
    "in process_allgather\n"
    "  File \"/app/train.py\", line 20 in loop\n"
    "  File \"/venv/lib/python3.11/site-packages/jaxtrain/worker/entry.py\", line 900 in main\n";
const std::string kBlocked =
    "  File \"/usr/lib/python3.11/threading.py\", line 629 in wait\n"
    "  File \"/app/train.py\", line 12 in block_forever\n"
    "  File \"/app/train.py\", line 19 in loop\n";

RankStacks Rank(int rank, uint64_t reports, const std::string& frames) {
  return {.rank = rank,
          .host = "vm",
          .reports = reports,
          .pong = {.has_stacks = true, .stacks = Dump(frames), .thread = kMain}};
}

TEST(ThreadFramesTest, ReadsTheNamedThreadsFramesInnermostFirst) {
  std::vector<StackFrame> frames = ThreadFrames(Dump(kBlocked), kMain);
  ASSERT_EQ(frames.size(), 3u);
  EXPECT_EQ(frames[0], (StackFrame{"/usr/lib/python3.11/threading.py", 629, "wait"}));
  EXPECT_EQ(frames[2], (StackFrame{"/app/train.py", 19, "loop"}));
  EXPECT_EQ(ThreadFrames(Dump(kBlocked), 0x7f0000002000).size(), 2u);
  EXPECT_TRUE(ThreadFrames(Dump(kBlocked), 0x1234).empty());
  EXPECT_TRUE(ThreadFrames("Current thread 0x0000000000001000 (most recent call first):\n"
                           "  <no Python frame>\n",
                           0x1000)
                  .empty());
}

TEST(DescribeWhereTest, NamesTheCallIntoJaxOrTheOwnFrameAndWhatItWaitsIn) {
  EXPECT_EQ(DescribeWhere(Rank(0, 4, kWaitsInAllgather)),
            "in JAX at multihost_utils.py:235 in process_allgather, called from train.py:20 in "
            "loop");
  EXPECT_EQ(DescribeWhere(Rank(1, 4, kBlocked)),
            "at train.py:12 in block_forever (threading.py:629 in wait)");
  RankStacks barrier = Rank(2, 4, kBlocked);
  barrier.pong.collective = "barrier() call 3";
  EXPECT_EQ(DescribeWhere(barrier), "in barrier() call 3 (a jaxtrain collective)");
  EXPECT_EQ(DescribeWhere({.rank = 3}), "(no stacks: its worker cannot take them)");
}

TEST(FindBehindTest, BlamesTheRankNotInACollectiveWhileTheOthersWaitInOne) {
  std::optional<Behind> b = FindBehind({Rank(0, 4, kWaitsInAllgather), Rank(1, 4, kBlocked)});
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->ranks, std::vector<int>{1});
  EXPECT_EQ(b->why,
            "rank(s) 1 on vm are not in a collective (rank 1 at train.py:12 in block_forever "
            "(threading.py:629 in wait)) while rank(s) 0 on vm wait in one (rank 0 in JAX at "
            "multihost_utils.py:235 in process_allgather, called from train.py:20 in loop)");
}

TEST(FindBehindTest, BlamesTheRanksWithFewerReportsFirst) {
  // Rank 0 stuck in its own code after a report rank 1 never made: rank 1 is behind.
  std::optional<Behind> b = FindBehind({Rank(0, 5, kBlocked), Rank(1, 4, kWaitsInAllgather)});
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->ranks, std::vector<int>{1});
  EXPECT_NE(b->why.find("rank(s) 1 on vm made 4 report() call(s) in this attempt, the others up "
                        "to 5"),
            std::string::npos)
      << b->why;
}

TEST(FindBehindTest, SinglesOutNoneWhenEveryRankWaitsOrNoneDoes) {
  EXPECT_FALSE(FindBehind({Rank(0, 4, kWaitsInAllgather), Rank(1, 4, kWaitsInAllgather)}));
  EXPECT_FALSE(FindBehind({Rank(0, 4, kBlocked), Rank(1, 4, kBlocked)}));
  EXPECT_FALSE(FindBehind({Rank(0, 4, kBlocked), {.rank = 1, .reports = 4}}));
}

TEST(StacksFileTextTest, SaysWhatJaxtrainKnowsThenTheDump) {
  RankStacks r = Rank(1, 4, kBlocked);
  r.pong.settling = true;
  const std::string text = StacksFileText(r, 2);
  EXPECT_TRUE(
      text.starts_with("# rank 1 on vm, attempt 2\n"
                       "# report() calls in this attempt: 4\n"
                       "# jaxtrain collective: none\n"
                       "# waiting for a checkpoint's commit: yes\n"
                       "# training thread: Thread 0x00007f0000001000\n"))
      << text;
  EXPECT_TRUE(text.ends_with(r.pong.stacks));
}

}  // namespace
}  // namespace jaxtrain::controller
