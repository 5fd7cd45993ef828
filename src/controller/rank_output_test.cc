#include "controller/rank_output.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <map>
#include <string>

#include "launch/slurm_launcher.h"

namespace jaxtrain::controller {
namespace {

// A RankOutput whose logs are strings, reading srun's lines as the Slurm launcher does.
struct Split {
  explicit Split(std::vector<int> ranks, bool echo = true)
      : output(
            std::move(ranks), echo, [this](int rank, std::string_view text) { logs[rank] += text; },
            [](std::string_view line) { return launch::ParseSrunTaskEnd(line); }) {}
  std::map<int, std::string> logs;
  RankOutput output;
};

TEST(StripRankLabelTest, ReadsPaddedNumbersAndLeavesOtherLinesWhole) {
  int rank = 0;
  EXPECT_EQ(StripRankLabel("12: hello\n", &rank), "hello\n");
  EXPECT_EQ(rank, 12);
  EXPECT_EQ(StripRankLabel(" 3: x", &rank), "x");
  EXPECT_EQ(rank, 3);
  for (const char* other : {"hello", "12:x", ": x", "a1: x", "12345678: too long", "", "  "}) {
    EXPECT_EQ(StripRankLabel(other, &rank), other) << other;
    EXPECT_EQ(rank, -1) << other;
  }
}

TEST(RankOutputTest, OneRanksOutputGoesToItsLogAsItComesAndToTheConsoleByLine) {
  Split s({2});
  EXPECT_EQ(s.output.Take("step 1\nstep"), "(rank=2) step 1\n");
  EXPECT_EQ(s.logs[2], "step 1\nstep");  // the log has it at once, the unended line too
  EXPECT_EQ(s.output.Take(" 2\n"), "(rank=2) step 2\n");
  EXPECT_EQ(s.output.Take("no newline at the end"), "");
  EXPECT_EQ(s.output.Close(), "(rank=2) no newline at the end\n");
  EXPECT_EQ(s.logs[2], "step 1\nstep 2\nno newline at the end");
  EXPECT_EQ(s.output.Close(), "");
}

TEST(RankOutputTest, AProgressBarIsShownAtEachCarriageReturn) {
  Split s({0});
  EXPECT_EQ(s.output.Take(" 10%|#\r"), "(rank=0)  10%|#\r");
  EXPECT_EQ(s.output.Take(" 20%|##\r"), "(rank=0)  20%|##\r");
  // The '\n' of a "\r\n" that arrives on its own ends the line shown, without a new prefix.
  EXPECT_EQ(s.output.Take("\n"), "\n");
  EXPECT_EQ(s.output.Take("done\r\n"), "(rank=0) done\r\n");
}

TEST(RankOutputTest, ALineLongerThanTheCapIsShownInPieces) {
  Split s({1});
  const std::string big(RankOutput::kLineCap, 'x');
  std::string shown = s.output.Take(big);
  EXPECT_EQ(shown, "(rank=1) " + big);
  EXPECT_EQ(s.output.Take("y\n"), "(rank=1) y\n");
}

TEST(RankOutputTest, WithoutEchoNothingIsMadeForTheConsoleButTheLogsGetEverything) {
  Split one({0}, /*echo=*/false);
  EXPECT_EQ(one.output.Take("a\nb"), "");
  EXPECT_EQ(one.output.Close(), "");
  EXPECT_EQ(one.logs[0], "a\nb");
  Split step({0, 1}, /*echo=*/false);
  EXPECT_EQ(step.output.Take("0: a\n1: b\n"), "");
  EXPECT_EQ(step.logs[0], "a\n");
  EXPECT_EQ(step.logs[1], "b\n");
}

TEST(RankOutputTest, LabelledLinesGoToTheirRanksAndTheLaunchersOwnToTheRanksTheyName) {
  Split s({0, 1, 2});
  std::string shown = s.output.Take("0: loss 1\n 1: loss 2\n2: par");
  EXPECT_EQ(shown, "(rank=0) loss 1\n(rank=1) loss 2\n");
  shown = s.output.Take("tial\nsrun: error: node2: task 1: Killed\n");
  EXPECT_EQ(shown, "(rank=2) partial\nsrun: error: node2: task 1: Killed\n");
  EXPECT_EQ(s.logs[0], "loss 1\n");
  EXPECT_EQ(s.logs[1], "loss 2\nsrun: error: node2: task 1: Killed\n");
  EXPECT_EQ(s.logs[2], "partial\n");
  ASSERT_EQ(s.output.task_ends().size(), 1u);
  EXPECT_EQ(s.output.task_ends()[0].first, 1);
  EXPECT_EQ(s.output.task_ends()[0].second.node, "node2");
  EXPECT_EQ(s.output.task_ends()[0].second.exit.signal, SIGKILL);
  // A task-end line is not an error line of the launcher's own.
  EXPECT_EQ(s.output.launcher_error(), "");
}

TEST(RankOutputTest, AnUnlabelledLineNamingNoneOfItsRanksGoesToEveryRanksLog) {
  Split s({4, 5});
  EXPECT_EQ(s.output.Take("srun: job step 8.0 started\n7: not one of ours\n"),
            "srun: job step 8.0 started\n7: not one of ours\n");
  EXPECT_EQ(s.logs[4], "srun: job step 8.0 started\n7: not one of ours\n");
  EXPECT_EQ(s.logs[5], s.logs[4]);
  // A task end that names only other ranks is kept for none of them.
  s.output.Take("srun: error: n1: task 9: Killed\n");
  EXPECT_TRUE(s.output.task_ends().empty());
}

TEST(RankOutputTest, TheLaunchersFirstErrorLineIsKeptUntilTheGroupIsStopped) {
  Split s({0, 1});
  s.output.Take("0: slurmstepd-node1: error: *** STEP 8.0 ON node1 CANCELLED ***\n");
  EXPECT_EQ(s.output.launcher_error(),
            "slurmstepd-node1: error: *** STEP 8.0 ON node1 CANCELLED ***");
  s.output.Take("srun: error: Unable to create step\n");
  EXPECT_EQ(s.output.launcher_error(),
            "slurmstepd-node1: error: *** STEP 8.0 ON node1 CANCELLED ***");

  Split unlabelled({0, 1});
  unlabelled.output.Take("srun: error: Unable to create step for job 12: Invalid\n");
  EXPECT_EQ(unlabelled.output.launcher_error(),
            "srun: error: Unable to create step for job 12: Invalid");

  Split stopped({0, 1});
  stopped.output.Stopping();  // what the launcher says once the group is stopped is no cause
  stopped.output.Take("srun: error: forcing job termination\n");
  stopped.output.Take("1: slurmstepd-node2: error: *** STEP 8.0 CANCELLED ***\n");
  EXPECT_EQ(stopped.output.launcher_error(), "");
}

TEST(RankOutputTest, ALabelledLineLongerThanTheCapIsTakenAsEnded) {
  Split s({0, 1});
  const std::string big(RankOutput::kLineCap, 'x');
  EXPECT_EQ(s.output.Take("1: " + big), "(rank=1) " + big + "\n");
  EXPECT_EQ(s.logs[1], big + "\n");
  // What follows of that line is no rank's: it goes to every log.
  EXPECT_EQ(s.output.Take("tail\n"), "tail\n");
  EXPECT_EQ(s.logs[0], "tail\n");
}

TEST(RankOutputTest, AnUnendedLabelledLineIsEndedAtClose) {
  Split s({0, 1});
  EXPECT_EQ(s.output.Take("0: last words"), "");
  EXPECT_EQ(s.output.Close(), "(rank=0) last words\n");
  EXPECT_EQ(s.logs[0], "last words\n");
}

}  // namespace
}  // namespace jaxtrain::controller
