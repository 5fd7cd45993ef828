#include "controller/run_placement.h"

#include <gtest/gtest.h>
#include <poll.h>

#include <atomic>
#include <string>
#include <vector>

#include "controller/testing/cpu_plan.h"
#include "controller/testing/hosts_launcher.h"

namespace jaxtrain::controller {
namespace {

using namespace std::chrono_literals;

class RunPlacementTest : public ::testing::Test {
 protected:
  RunPlacementTest() {
    options_.plan = TwoPerHost(4, {"host1", "host2"});
    command_ = {.argv = {"/bin/true"}, .run_dir = "/tmp/run", .experiment_name = "placement"};
  }
  void MakeElastic() {
    options_.elastic =
        ElasticOptions{.min_workers = 2,
                       .monitor_interval = 1ms,
                       .host_wait = 0s,
                       .plan_on = [](const std::vector<std::string>& hosts, int workers) {
                         return StatusOr<placement::Plan>(TwoPerHost(workers, hosts));
                       }};
  }
  RunPlacement Make() {
    return RunPlacement(options_, launcher_, [this](const std::string& l) { said_.push_back(l); });
  }

  ControllerOptions options_;
  WorkerCommand command_;
  std::atomic<int> interrupts_{0};
  HostsLauncher launcher_{interrupts_};
  std::vector<std::string> said_;
};

TEST_F(RunPlacementTest, AFixedSizeRunRunsTheOptionsPlanAndWatchesNothing) {
  RunPlacement placement = Make();
  ASSERT_TRUE(placement.Start(command_).ok());
  EXPECT_EQ(placement.plan()->workers.size(), 4u);
  EXPECT_EQ(placement.workers().specs.size(), 4u);
  EXPECT_TRUE(placement.TakeResize().is_null());
  EXPECT_EQ(placement.resizes(), 0);
  placement.WatchMissingHosts();
  EXPECT_EQ(placement.ready_fd(), -1);
  EXPECT_EQ(placement.TakeCapacityChange(), std::nullopt);
  EXPECT_TRUE(launcher_.sizes().empty()) << "the launcher keeps its own plan";
  EXPECT_TRUE(said_.empty());
}

TEST_F(RunPlacementTest, AnElasticRunStartsOnTheHostsThatAnswerAndSaysTheResizeOnce) {
  MakeElastic();
  launcher_.SetDown({"host2"});
  RunPlacement placement = Make();
  ASSERT_TRUE(placement.Start(command_).ok());
  EXPECT_EQ(placement.plan()->workers.size(), 2u);
  EXPECT_EQ(placement.workers().specs.size(), 2u);
  EXPECT_EQ(placement.resizes(), 1);
  EXPECT_EQ(launcher_.sizes(), (std::vector<size_t>{2}));
  nlohmann::json resize = placement.TakeResize();
  EXPECT_EQ(resize["from"], 4);
  EXPECT_EQ(resize["to"], 2);
  EXPECT_EQ(resize["reason"], "host host2 cannot be reached");
  EXPECT_TRUE(placement.TakeResize().is_null()) << "once";
  ASSERT_EQ(said_.size(), 1u);
  EXPECT_EQ(said_[0],
            "resizing the run from 4 to 2 workers (host host2 cannot be reached; "
            "ScalingConfig.num_workers=(2, 4)): hosts host1");
}

TEST_F(RunPlacementTest, AHostThatAnswersAgainIsFoundAndTheNextChoiceGrowsTheRun) {
  MakeElastic();
  launcher_.SetDown({"host2"});
  RunPlacement placement = Make();
  ASSERT_TRUE(placement.Start(command_).ok());
  placement.WatchMissingHosts();
  launcher_.SetDown({});
  pollfd p{placement.ready_fd(), POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 30000), 1) << "the monitor never found host2";
  EXPECT_EQ(placement.TakeCapacityChange(), "host host2 can be reached again");
  EXPECT_EQ(said_.back(),
            "host host2 can be reached again; the run grows at its next committed "
            "checkpoint");

  ASSERT_TRUE(placement.Choose(/*restart=*/true).ok());
  EXPECT_EQ(placement.plan()->workers.size(), 4u);
  EXPECT_EQ(placement.resizes(), 2);
  EXPECT_EQ(placement.TakeResize()["reason"], "host host2 can be reached again");
  EXPECT_EQ(launcher_.sizes(), (std::vector<size_t>{2, 4}));
  placement.StopWatching();
}

TEST_F(RunPlacementTest, TooFewHostsStartOnTheFullPlanWithAWarning) {
  MakeElastic();
  launcher_.SetDown({"host1", "host2"});
  RunPlacement placement = Make();
  ASSERT_TRUE(placement.Start(command_).ok());
  EXPECT_EQ(placement.plan()->workers.size(), 4u);
  EXPECT_EQ(placement.resizes(), 0);
  ASSERT_EQ(said_.size(), 1u);
  EXPECT_EQ(said_[0].rfind("warning: ", 0), 0u) << said_[0];
}

}  // namespace
}  // namespace jaxtrain::controller
