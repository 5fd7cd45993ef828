// Launchers for the controller's tests, which start no process (their workers are fakes).
// UnusedLauncher launches nothing and counts the controller's interrupts (Abort()). HostsLauncher,
// an elastic run's: the hosts it cannot reach and those leaving are the test's to say, and it
// notes the world size of every plan it is handed; UnreachableHosts and LeavingHosts are called
// from the capacity monitor's thread.
#pragma once

#include <atomic>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "launch/launcher.h"

namespace jaxtrain::controller {

class UnusedLauncher : public launch::Launcher {
 public:
  explicit UnusedLauncher(std::atomic<int>& interrupts) : interrupts_(interrupts) {}
  StatusOr<std::vector<launch::LaunchedProcess>> Launch(
      const std::vector<launch::ProcessSpec>&) override {
    return InternalError("the fake worker group launches nothing");
  }
  Status SignalGroup(int) override { return InternalError("the fake worker group signals"); }
  void Interrupt() override { ++interrupts_; }

 private:
  std::atomic<int>& interrupts_;
};

class HostsLauncher : public UnusedLauncher {
 public:
  using UnusedLauncher::UnusedLauncher;
  StatusOr<std::vector<std::string>> UnreachableHosts(const std::vector<std::string>& hosts,
                                                      Duration, int) override {
    return Among(hosts, down_);
  }
  StatusOr<std::vector<std::string>> LeavingHosts(const std::vector<std::string>& hosts,
                                                  int) override {
    return Among(hosts, leaving_);
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
  // `hosts` that are in `set`, in their order.
  std::vector<std::string> Among(const std::vector<std::string>& hosts,
                                 const std::set<std::string>& set) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> found;
    for (const auto& h : hosts) {
      if (set.count(h)) found.push_back(h);
    }
    return found;
  }

  std::mutex mu_;
  std::set<std::string> down_;
  std::set<std::string> leaving_;
  std::vector<size_t> sizes_;
};

}  // namespace jaxtrain::controller
