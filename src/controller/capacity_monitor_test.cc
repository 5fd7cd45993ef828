#include "controller/capacity_monitor.h"

#include <gtest/gtest.h>
#include <poll.h>

#include <atomic>

namespace jaxtrain::controller {
namespace {

using namespace std::chrono_literals;

// A launcher whose hosts come back after `probes_down` probes; counts the probes.
class ReturningHosts : public launch::Launcher {
 public:
  explicit ReturningHosts(int probes_down) : probes_down_(probes_down) {}
  StatusOr<std::vector<launch::LaunchedProcess>> Launch(
      const std::vector<launch::ProcessSpec>&) override {
    return std::vector<launch::LaunchedProcess>{};
  }
  Status SignalGroup(int) override { return OkStatus(); }
  StatusOr<std::vector<std::string>> UnreachableHosts(const std::vector<std::string>& hosts,
                                                      Duration, int) override {
    if (++probes_ <= probes_down_) return hosts;
    return std::vector<std::string>{hosts.begin() + 1, hosts.end()};  // the first is back
  }
  std::atomic<int> probes_{0};

 private:
  const int probes_down_;
};

bool Readable(int fd, int timeout_ms) {
  pollfd p{fd, POLLIN, 0};
  return poll(&p, 1, timeout_ms) == 1;
}

TEST(CapacityMonitorTest, HostsBackAreTheWatchedOnesNoLongerUnreachable) {
  EXPECT_EQ(HostsBack({"host2", "host3"}, {"host3"}), std::vector<std::string>{"host2"});
  EXPECT_TRUE(HostsBack({"host2"}, {"host2"}).empty());
}

TEST(CapacityMonitorTest, ReportsTheHostsThatAnswerAgainOnce) {
  ReturningHosts launcher(/*probes_down=*/2);
  auto monitor = CapacityMonitor::Create(launcher, 1ms);
  ASSERT_TRUE(monitor.ok());
  (*monitor)->Start({"host2", "host3"});
  ASSERT_TRUE(Readable((*monitor)->ready_fd(), 10'000));
  auto found = (*monitor)->TakeFound();
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->back, std::vector<std::string>{"host2"});
  EXPECT_TRUE(found->leaving.empty());
  EXPECT_EQ(launcher.probes_, 3);
  EXPECT_FALSE(Readable((*monitor)->ready_fd(), 0));
  EXPECT_FALSE((*monitor)->TakeFound().has_value());
}

// A launcher that says host1, where the group trains, is taken away (a Slurm node drained).
class DrainedHost : public ReturningHosts {
 public:
  DrainedHost() : ReturningHosts(1'000'000'000) {}
  StatusOr<std::vector<std::string>> LeavingHosts(const std::vector<std::string>& hosts,
                                                  int) override {
    ++leaving_asked_;
    return std::vector<std::string>{"host1"};
  }
  std::atomic<int> leaving_asked_{0};
};

TEST(CapacityMonitorTest, ReportsAHostOfTheGroupThatLeaves) {
  DrainedHost launcher;
  auto monitor = CapacityMonitor::Create(launcher, 1ms);
  ASSERT_TRUE(monitor.ok());
  (*monitor)->Start({"host3"}, {"host1", "host2"});
  ASSERT_TRUE(Readable((*monitor)->ready_fd(), 10'000));
  auto found = (*monitor)->TakeFound();
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->leaving, std::vector<std::string>{"host1"});
  EXPECT_TRUE(found->back.empty());
  EXPECT_EQ(launcher.leaving_asked_, 1);
}

TEST(CapacityMonitorTest, WatchesTheGroupAtMaxForHostsThatLeave) {
  DrainedHost launcher;
  auto monitor = CapacityMonitor::Create(launcher, 1ms);
  ASSERT_TRUE(monitor.ok());
  (*monitor)->Start({}, {"host1"});  // nothing missing
  ASSERT_TRUE(Readable((*monitor)->ready_fd(), 10'000));
  EXPECT_EQ((*monitor)->TakeFound()->leaving, std::vector<std::string>{"host1"});
  EXPECT_EQ(launcher.probes_, 0);
}

TEST(CapacityMonitorTest, StopEndsAWatchOfHostsThatNeverAnswer) {
  ReturningHosts launcher(/*probes_down=*/1'000'000'000);
  auto monitor = CapacityMonitor::Create(launcher, 24h);
  ASSERT_TRUE(monitor.ok());
  (*monitor)->Start({"host2"});
  (*monitor)->Stop();  // returns at once: the interval's wait is cut short
  EXPECT_EQ(launcher.probes_, 0);
  EXPECT_FALSE(Readable((*monitor)->ready_fd(), 0));
}

}  // namespace
}  // namespace jaxtrain::controller
