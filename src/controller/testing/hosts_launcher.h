// HostsLauncher: an elastic run's launcher for the controller's tests. The hosts it cannot reach
// are the test's to say; it notes the world size of every plan it is handed and counts the
// controller's interrupts (Abort()). It launches no process: the tests' workers are fakes.
// UnreachableHosts and LeavingHosts are called from the capacity monitor's thread.
#pragma once

#include <atomic>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "launch/launcher.h"

namespace jaxtrain::controller {

class HostsLauncher : public launch::Launcher {
 public:
  explicit HostsLauncher(std::atomic<int>& interrupts) : interrupts_(interrupts) {}
  StatusOr<std::vector<launch::LaunchedProcess>> Launch(
      const std::vector<launch::ProcessSpec>&) override {
    return InternalError("the fake worker group launches nothing");
  }
  Status SignalGroup(int) override { return InternalError("the fake worker group signals"); }
  void Interrupt() override { ++interrupts_; }
  StatusOr<std::vector<std::string>> UnreachableHosts(const std::vector<std::string>& hosts,
                                                      Duration, int) override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> down;
    for (const auto& h : hosts) {
      if (down_.count(h)) down.push_back(h);
    }
    return down;
  }
  StatusOr<std::vector<std::string>> LeavingHosts(const std::vector<std::string>& hosts,
                                                  int) override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> leaving;
    for (const auto& h : hosts) {
      if (leaving_.count(h)) leaving.push_back(h);
    }
    return leaving;
  }
  Status UsePlan(const placement::Plan& plan) override {
    std::lock_guard<std::mutex> lock(mu_);
    sizes_.push_back(plan.workers.size());
    return OkStatus();
  }
  void SetDown(std::set<std::string> down) {
    std::lock_guard<std::mutex> lock(mu_);
    down_ = std::move(down);
  }
  // Hosts the cluster takes from the group while it trains (a Slurm node drained).
  void SetLeaving(std::set<std::string> leaving) {
    std::lock_guard<std::mutex> lock(mu_);
    leaving_ = std::move(leaving);
  }
  std::vector<size_t> sizes() {
    std::lock_guard<std::mutex> lock(mu_);
    return sizes_;
  }

 private:
  std::atomic<int>& interrupts_;
  std::mutex mu_;
  std::set<std::string> down_;
  std::set<std::string> leaving_;
  std::vector<size_t> sizes_;
};

}  // namespace jaxtrain::controller
