// Elastic runs (ScalingConfig(num_workers=(min, max)), docs/elastic.md): which hosts of the full
// plan (the plan for max) a run trains on when some cannot be had, and the checks of its range
// against the hosts. A run resizes by whole units: a host and all of its workers, or, for a TPU
// slice, the whole slice (every host of it). Pure functions; thread-safe.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "base/status.h"
#include "config/scaling_config.h"
#include "placement/hosts.h"
#include "placement/plan.h"

namespace jaxtrain::placement {

// A unit a plan grows or shrinks by: one host, or one TPU slice (its hosts in rank order).
struct ResizeUnit {
  std::string name;                // the host, or the slice
  std::vector<std::string> hosts;  // WorkerPlacement::host of its workers, in rank order
  int workers = 0;
};

// The units of `plan`, in the order of their first ranks.
std::vector<ResizeUnit> ResizeUnits(const Plan& plan);

// Checks an elastic `config` against its full plan: when every unit holds the same number of
// workers w, min and max must be multiples of w (a run resizes by whole hosts or slices).
// Errors: kInvalidArgument naming ScalingConfig.num_workers=(min, max), the hosts' workers and
// what is allowed. A config that is not elastic is always fine.
Status CheckElasticHosts(const config::ScalingConfig& config, const Plan& full);

struct HostChoice {
  std::vector<std::string> hosts;     // the hosts to train on, in the full plan's order
  std::vector<std::string> left_out;  // the full plan's hosts left out, in its order
  int workers = 0;                    // the workers they hold
};

// The hosts of `full` an elastic run trains on without `unreachable`: every unit of which no host
// is unreachable (a slice with one host unreachable is left out whole).
// Errors: kUnavailable when they hold fewer than `min_workers`; the message names the
// unreachable hosts, the workers left and the min.
StatusOr<HostChoice> ChooseHosts(const Plan& full, const std::set<std::string>& unreachable,
                                 int min_workers);

// For an engine that places the ranks itself (placement::PlanForScheduler, whose ranks share
// one environment): `workers` ranks of `uniform` put on `hosts`, `per_host` on each in rank order
// (ranks 0..per_host-1 on the first host, as Slurm's block distribution numbers its tasks), with
// the host, local and node ranks set; `source` names the hosts (Plan::hosts_source).
// Errors: kInvalidArgument when `workers` is not per_host x the hosts, or exceeds uniform's.
StatusOr<Plan> PlanPerHost(const Plan& uniform, const std::vector<std::string>& hosts, int per_host,
                           int workers, const std::string& source);

// `hosts` without the hosts not in `keep`, and without the TPU slices of which a host is not kept.
HostDescription OnlyHosts(const HostDescription& hosts, const std::set<std::string>& keep);

}  // namespace jaxtrain::placement
