#include "placement/elastic.h"

#include <algorithm>
#include <map>

namespace jaxtrain::placement {
namespace {

std::string Join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace

std::vector<ResizeUnit> ResizeUnits(const Plan& plan) {
  std::vector<ResizeUnit> units;
  std::map<std::string, size_t> index;  // unit name -> position in units
  for (const WorkerPlacement& w : plan.workers) {
    const std::string& name = w.slice.empty() ? w.host : w.slice;
    auto [at, added] = index.emplace(name, units.size());
    if (added) units.push_back({.name = name});
    ResizeUnit& unit = units[at->second];
    if (std::find(unit.hosts.begin(), unit.hosts.end(), w.host) == unit.hosts.end()) {
      unit.hosts.push_back(w.host);
    }
    ++unit.workers;
  }
  return units;
}

Status CheckElasticHosts(const config::ScalingConfig& config, const Plan& full) {
  if (!config.elastic()) return OkStatus();
  const std::vector<ResizeUnit> units = ResizeUnits(full);
  if (units.empty()) return OkStatus();
  const int per_unit = units.front().workers;
  for (const ResizeUnit& u : units) {
    if (u.workers != per_unit) return OkStatus();  // uneven hosts: any sum of whole ones
  }
  const int min = config.min_workers();
  const int max = config.num_workers();
  if (min % per_unit == 0 && max % per_unit == 0) return OkStatus();
  const bool slices = !full.workers.empty() && !full.workers.front().slice.empty();
  return InvalidArgumentError(
      "ScalingConfig.num_workers=(" + std::to_string(min) + ", " + std::to_string(max) +
      ") is not allowed on these hosts (" + full.hosts_source + "): each " +
      (slices ? "slice" : "host") + " takes " + std::to_string(per_unit) +
      " worker(s), and an elastic run grows and shrinks by whole " + (slices ? "slices" : "hosts") +
      "; allowed: min and max multiples of " + std::to_string(per_unit));
}

StatusOr<HostChoice> ChooseHosts(const Plan& full, const std::set<std::string>& unreachable,
                                 int min_workers) {
  HostChoice choice;
  std::vector<std::string> lost;
  for (const ResizeUnit& u : ResizeUnits(full)) {
    const bool whole = std::none_of(u.hosts.begin(), u.hosts.end(),
                                    [&](const std::string& h) { return unreachable.count(h); });
    auto& into = whole ? choice.hosts : choice.left_out;
    into.insert(into.end(), u.hosts.begin(), u.hosts.end());
    if (whole) choice.workers += u.workers;
    for (const auto& h : u.hosts) {
      if (unreachable.count(h)) lost.push_back(h);
    }
  }
  if (choice.workers >= min_workers && choice.workers > 0) return choice;
  return UnavailableError("host " + Join(lost) + " cannot be reached, and the hosts left (" +
                          (choice.hosts.empty() ? std::string("none") : Join(choice.hosts)) +
                          ") hold " + std::to_string(choice.workers) +
                          " worker(s), fewer than the min of ScalingConfig.num_workers (" +
                          std::to_string(min_workers) + ")");
}

StatusOr<Plan> PlanPerHost(const Plan& uniform, const std::vector<std::string>& hosts, int per_host,
                           int workers, const std::string& source) {
  if (per_host < 1 || workers != per_host * static_cast<int>(hosts.size()) ||
      workers > static_cast<int>(uniform.workers.size())) {
    return InvalidArgumentError("cannot place " + std::to_string(workers) + " worker(s), " +
                                std::to_string(per_host) + " on each of the hosts " + Join(hosts) +
                                " (" + source + "), in a plan of " +
                                std::to_string(uniform.workers.size()));
  }
  Plan plan = uniform;
  plan.hosts_source = source;
  plan.workers.resize(static_cast<size_t>(workers));
  for (WorkerPlacement& w : plan.workers) {
    w.node_rank = w.rank / per_host;
    w.local_rank = w.rank % per_host;
    w.local_world_size = per_host;
    w.host = hosts[static_cast<size_t>(w.node_rank)];
  }
  return plan;
}

HostDescription OnlyHosts(const HostDescription& hosts, const std::set<std::string>& keep) {
  std::set<std::string> broken_slices;
  for (const Host& h : hosts.hosts) {
    if (!keep.count(h.name) && !h.tpu_slice.empty()) broken_slices.insert(h.tpu_slice);
  }
  HostDescription out{.source = hosts.source};
  for (const Host& h : hosts.hosts) {
    if (keep.count(h.name) && !broken_slices.count(h.tpu_slice)) out.hosts.push_back(h);
  }
  return out;
}

}  // namespace jaxtrain::placement
