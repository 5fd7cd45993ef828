// RunPlacement: where the run's attempts train, and the processes each attempt starts there
// (worker_specs.h). A fixed-size run's every attempt runs ControllerOptions::plan. An elastic run
// (ControllerOptions::elastic, docs/elastic.md) chooses its hosts before each attempt (Choose()):
// the units of the full plan the launcher can reach, at a restart a host that cannot be reached
// waited for up to host_wait first; min_workers at least, else the full plan (its launch then
// waits and fails as a fixed-size run's). A choice of another number of workers than the plan
// before it is a resize: counted (resizes(), run.json's "resizes") and described for the next
// attempt's record (TakeResize()).
//
// While an elastic run trains, the hosts it lacks are watched for their return and those it trains
// on for the cluster taking them away (WatchMissingHosts(), CapacityMonitor: a Slurm node
// drained); once either happens, ready_fd() is readable and TakeCapacityChange() says why the run
// resizes (the attempt then stops at its next committed checkpoint: Attempt::RequestResize).
//
// Threads: the controller's event-loop thread (and the thread of Controller::Start, before the
// loop runs); the monitor probes on its own.
#pragma once

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "controller/capacity_monitor.h"
#include "controller/controller.h"
#include "controller/worker_specs.h"
#include "launch/launcher.h"
#include "placement/plan.h"

namespace jaxtrain::controller {

class RunPlacement {
 public:
  // `opts` and `launcher` outlive the placement; `say` writes one of jaxtrain's console lines.
  RunPlacement(const ControllerOptions& opts, launch::Launcher& launcher,
               std::function<void(const std::string&)> say);
  RunPlacement(const RunPlacement&) = delete;
  RunPlacement& operator=(const RunPlacement&) = delete;

  // The processes are made with `command`; an elastic run chooses the first attempt's hosts,
  // those that answer now (Choose(false)). Errors: kInternal when the capacity monitor cannot be
  // made; as Choose().
  Status Start(WorkerCommand command);

  // Elastic runs: the plan of the next attempt, on the units (hosts, TPU slices) of the full plan
  // that the launcher can reach now; at a restart (`restart`) a host that cannot be reached is
  // waited for up to host_wait first. Fewer than min_workers reachable: the full plan.
  // Errors: kCancelled when the run is being stopped meanwhile; those of plan_on and
  // Launcher::UsePlan.
  Status Choose(bool restart);

  // The plan of the attempt in progress (or of the next one) and its processes.
  const std::shared_ptr<const placement::Plan>& plan() const { return plan_; }
  const WorkerSpecs& workers() const { return workers_; }
  // The resize the next attempt starts with ({"from", "to", "reason", "hosts_left_out"}; null
  // for none), once.
  nlohmann::json TakeResize() { return std::exchange(next_resize_, nlohmann::json()); }
  // The resizes so far.
  int resizes() const { return resizes_; }

  // Elastic runs below max: the hosts the plan lacks are watched from now on; none lacking (or
  // a fixed-size run): nothing is watched.
  void WatchMissingHosts();
  void StopWatching();
  // Readable once watched hosts answered or are leaving; -1 when nothing can be watched.
  int ready_fd() const { return monitor_ ? monitor_->ready_fd() : -1; }
  // Why the run resizes ("host h3 can be reached again", "host h2 is being taken from the run"),
  // once capacity changed; said on the console, and a shrink's reason kept for the resize record
  // of the next Choose(). nullopt while nothing changed.
  std::optional<std::string> TakeCapacityChange();

 private:
  Status UsePlan(placement::Plan next);

  const ControllerOptions& opts_;
  launch::Launcher& launcher_;
  const std::function<void(const std::string&)> say_;
  WorkerCommand command_;
  std::shared_ptr<const placement::Plan> plan_;
  WorkerSpecs workers_;
  std::unique_ptr<CapacityMonitor> monitor_;  // elastic runs only
  std::string leaving_why_;  // why the group stops to leave hosts (TakeCapacityChange)
  nlohmann::json next_resize_;
  int resizes_ = 0;
};

// The hosts of `plan`, in rank order (by its resize units).
std::vector<std::string> HostsOf(const placement::Plan& plan);

// "a, b, c".
std::string JoinNames(const std::vector<std::string>& names);

}  // namespace jaxtrain::controller
