#include "controller/run_placement.h"

#include <algorithm>
#include <set>
#include <utility>

#include "base/strings.h"
#include "placement/elastic.h"

namespace jaxtrain::controller {

std::vector<std::string> HostsOf(const placement::Plan& plan) {
  std::vector<std::string> hosts;
  for (const placement::ResizeUnit& u : placement::ResizeUnits(plan)) {
    hosts.insert(hosts.end(), u.hosts.begin(), u.hosts.end());
  }
  return hosts;
}

std::string JoinNames(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

RunPlacement::RunPlacement(const ControllerOptions& opts, launch::Launcher& launcher,
                           std::function<void(const std::string&)> say)
    : opts_(opts),
      launcher_(launcher),
      say_(std::move(say)),
      plan_(std::make_shared<const placement::Plan>(opts.plan)) {}

Status RunPlacement::Start(WorkerCommand command) {
  command_ = std::move(command);
  workers_ = BuildWorkerSpecs(*plan_, command_);
  if (!opts_.elastic) return OkStatus();
  // The run starts as soon as min workers can be placed: on the hosts that answer now.
  JT_ASSIGN_OR_RETURN(monitor_,
                      CapacityMonitor::Create(launcher_, opts_.elastic->monitor_interval));
  return Choose(/*restart=*/false);
}

Status RunPlacement::UsePlan(placement::Plan next) {
  plan_ = std::make_shared<const placement::Plan>(std::move(next));
  workers_ = BuildWorkerSpecs(*plan_, command_);
  return launcher_.UsePlan(*plan_);
}

Status RunPlacement::Choose(bool restart) {
  const ElasticOptions& e = *opts_.elastic;
  const placement::Plan& full = opts_.plan;
  // One probe of every host, probing those down again with backoff up to the wait: the
  // probe of a host cut off takes ssh's connect timeout, so it is not made twice.
  const Duration wait = restart ? e.host_wait : Duration::zero();
  JT_ASSIGN_OR_RETURN(std::vector<std::string> down,
                      launcher_.UnreachableHosts(HostsOf(full), wait, -1));
  const std::set<std::string> unreachable(down.begin(), down.end());
  const std::vector<std::string> before = HostsOf(*plan_);
  const std::string leaving = std::exchange(leaving_why_, "");
  if (!down.empty() && restart) {
    say_("host " + JoinNames(down) + " cannot be reached after waiting up to " +
         FormatNumber(std::chrono::duration<double>(wait).count()) +
         " s for it (elastic: min(FailureConfig.unreachable_host_timeout_s, "
         "ScalingConfig.elastic_resize_monitor_interval_s))");
  }
  StatusOr<placement::HostChoice> choice = placement::ChooseHosts(full, unreachable, e.min_workers);
  placement::Plan next;
  if (!choice.ok()) {
    say_("warning: " + choice.status().message() +
         "; starting on every host, as a fixed-size "
         "run does");
    next = full;
  } else if (static_cast<size_t>(choice->workers) == full.workers.size()) {
    next = full;
  } else {
    JT_ASSIGN_OR_RETURN(next, e.plan_on(choice->hosts, choice->workers));
  }
  const size_t from = plan_->workers.size();
  const size_t to = next.workers.size();
  if (to != from) {
    ++resizes_;
    const std::vector<std::string> now = HostsOf(next);
    std::vector<std::string> gone, added;
    for (const auto& h : before) {
      if (std::find(now.begin(), now.end(), h) == now.end()) gone.push_back(h);
    }
    for (const auto& h : now) {
      if (std::find(before.begin(), before.end(), h) == before.end()) added.push_back(h);
    }
    const std::string reason = to > from ? "host " + JoinNames(added) + " can be reached again"
                               : !leaving.empty()
                                   ? leaving
                                   : "host " + JoinNames(gone) + " cannot be reached";
    next_resize_ = {
        {"from", from},
        {"to", to},
        {"reason", reason},
        {"hosts_left_out", choice.ok() ? choice->left_out : std::vector<std::string>{}}};
    say_("resizing the run from " + std::to_string(from) + " to " + std::to_string(to) +
         " workers (" + reason + "; ScalingConfig.num_workers=(" + std::to_string(e.min_workers) +
         ", " + std::to_string(full.workers.size()) + ")): hosts " + JoinNames(now));
  }
  return UsePlan(std::move(next));
}

void RunPlacement::WatchMissingHosts() {
  if (!monitor_) return;
  std::vector<std::string> now = HostsOf(*plan_);
  std::vector<std::string> missing;
  for (const auto& h : HostsOf(opts_.plan)) {
    if (std::find(now.begin(), now.end(), h) == now.end()) missing.push_back(h);
  }
  monitor_->Start(std::move(missing), std::move(now));
}

void RunPlacement::StopWatching() {
  if (monitor_) monitor_->Stop();
}

std::optional<std::string> RunPlacement::TakeCapacityChange() {
  if (!monitor_) return std::nullopt;
  std::optional<CapacityChange> change = monitor_->TakeFound();
  if (!change) return std::nullopt;
  if (!change->leaving.empty()) {
    leaving_why_ = "host " + JoinNames(change->leaving) + " is being taken from the run";
    say_(leaving_why_ + "; the run shrinks at its next committed checkpoint");
    return leaving_why_;
  }
  const std::string why = "host " + JoinNames(change->back) + " can be reached again";
  say_(why + "; the run grows at its next committed checkpoint");
  return why;
}

}  // namespace jaxtrain::controller
