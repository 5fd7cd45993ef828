#include "placement/plan.h"

#include <algorithm>
#include <cctype>
#include <climits>
#include <cmath>
#include <optional>
#include <set>
#include <utility>

#include "accelerators/tpu.h"
#include "base/strings.h"

namespace jaxtrain::placement {
namespace {

using config::PlacementStrategy;

// The inherited variables placement reads; PlanLocal copies them from the machine.
constexpr const char* kInheritedNames[] = {"JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES",
                                           "JAX_CPU_COLLECTIVES_IMPLEMENTATION", "MEGASCALE_PORT",
                                           "CUDA_VISIBLE_DEVICES"};
constexpr char kDefaultMegascalePort[] = "8081";
// libtpu's view of a partial host: the worker's chips form a single-host slice of this shape
// (Ray's values for 1 and 2 chips; 4 and 8 chips of an 8-chip v5e/v6e host are 2x2 and 2x4).
constexpr std::pair<int, const char*> kChipsPerHostBounds[] = {
    {1, "1,1,1"}, {2, "1,2,1"}, {4, "2,2,1"}, {8, "2,4,1"}};
constexpr char kSingleHostBounds[] = "1,1,1";
constexpr const char* kMegascaleComputed[] = {"MEGASCALE_COORDINATOR_ADDRESS",
                                              "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID"};
constexpr const char* kPartialHostVariables[] = {"TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_HOST_BOUNDS",
                                                 "TPU_HOST_BOUNDS"};

bool IsSet(const Environment& env, const std::string& name) {
  const auto it = env.find(name);
  return it != env.end() && !it->second.empty();
}

std::string Quoted(const std::string& name) { return "\"" + name + "\""; }

// One worker's place before ranks are numbered.
struct Seat {
  size_t host = 0;
  std::vector<std::string> devices;
  int slice = -1;             // index into the plan's slices; -1 without one
  bool partial_host = false;  // a TPU worker with some of its host's chips
};

// A TPU slice the plan uses: its hosts in worker-id order.
struct UsedSlice {
  std::string name;
  std::vector<size_t> hosts;
  std::string accelerator_type;  // for TPU_ACCELERATOR_TYPE; empty: unknown
  std::string topology;
};

// A whole number >= 1 of `resource` per worker.
StatusOr<int> WholeCount(const config::ScalingConfig& config, const std::string& resource) {
  const double amount = config.resources_per_worker().at(resource);
  if (amount < 1 || amount != std::floor(amount) || amount > INT_MAX) {
    return InvalidArgumentError("ScalingConfig.resources_per_worker['" + resource +
                                "']=" + FormatNumber(amount) +
                                " is not allowed here: jaxtrain gives each worker whole " +
                                resource + "s; use a whole number >= 1");
  }
  return static_cast<int>(amount);
}

// Workers a host can take by its described CPUs.
int CpuCapacity(const Host& host, const config::ScalingConfig& config) {
  const auto cpu = config.resources_per_worker().find("CPU");
  const double per_worker = cpu == config.resources_per_worker().end() ? 0 : cpu->second;
  if (host.cpus == 0 || per_worker <= 0) return INT_MAX;
  return static_cast<int>(std::floor(host.cpus / per_worker + 1e-9));
}

// Workers per host under `strategy`, each host taking at most capacity[h]; nullopt when the hosts
// cannot hold `n` workers that way.
std::optional<std::vector<int>> WorkersPerHost(const std::vector<int>& capacity, int n,
                                               PlacementStrategy strategy) {
  std::vector<int> counts(capacity.size(), 0);
  int left = n;
  switch (strategy) {
    case PlacementStrategy::kPack:
      for (size_t h = 0; h < capacity.size() && left > 0; ++h) {
        counts[h] = std::min(capacity[h], left);
        left -= counts[h];
      }
      break;
    case PlacementStrategy::kSpread:
      while (left > 0) {
        const int before = left;
        for (size_t h = 0; h < capacity.size() && left > 0; ++h) {
          if (counts[h] < capacity[h]) {
            ++counts[h];
            --left;
          }
        }
        if (left == before) break;
      }
      break;
    case PlacementStrategy::kStrictPack:
      for (size_t h = 0; h < capacity.size(); ++h) {
        if (capacity[h] >= n) {
          counts[h] = n;
          left = 0;
          break;
        }
      }
      break;
    case PlacementStrategy::kStrictSpread:
      for (size_t h = 0; h < capacity.size() && left > 0; ++h) {
        if (capacity[h] >= 1) {
          counts[h] = 1;
          --left;
        }
      }
      break;
  }
  if (left > 0) return std::nullopt;
  return counts;
}

std::string WhyNotPlaced(const config::ScalingConfig& config, const std::string& per_worker,
                         const HostDescription& hosts, const std::vector<std::string>& offers,
                         const std::vector<int>& capacity) {
  const int n = config.num_workers();
  const std::string strategy(config::PlacementStrategyName(config.placement_strategy()));
  std::string why;
  switch (config.placement_strategy()) {
    case PlacementStrategy::kStrictPack: why = "no host can take all " + std::to_string(n); break;
    case PlacementStrategy::kStrictSpread: {
      const auto able =
          std::count_if(capacity.begin(), capacity.end(), [](int c) { return c > 0; });
      why = std::to_string(able) + " host(s) can take a worker, and STRICT_SPREAD needs " +
            std::to_string(n) + " distinct hosts";
      break;
    }
    default: {
      long long total = 0;
      for (int c : capacity) total += c;
      why = "they have room for " + std::to_string(total);
    }
  }
  std::vector<std::string> lines;
  for (size_t h = 0; h < hosts.hosts.size(); ++h) {
    const std::string room = capacity[h] == INT_MAX ? "any number" : std::to_string(capacity[h]);
    lines.push_back(Quoted(hosts.hosts[h].name) + ": " + offers[h] + " -> room for " + room);
  }
  return "ScalingConfig asks for " + std::to_string(n) + " workers x " + per_worker + " (" +
         strategy + "), but " + why + " on " + hosts.source + " (" + Join(lines, "; ") + ")";
}

// For SeatByStrategy: one worker takes every device of its host.
constexpr int kWholeHost = -1;

// Seats on hosts chosen by the strategy; each host's devices are dealt out `per_worker` at a time
// (0: workers own no devices; kWholeHost: all of them).
StatusOr<std::vector<Seat>> SeatByStrategy(const config::ScalingConfig& config,
                                           const HostDescription& hosts,
                                           const std::vector<std::vector<std::string>>& devices,
                                           int per_worker, const std::string& per_worker_text,
                                           const std::vector<std::string>& offers) {
  std::vector<int> capacity;
  for (size_t h = 0; h < hosts.hosts.size(); ++h) {
    const int held = static_cast<int>(devices[h].size());
    const int by_devices = per_worker == 0            ? INT_MAX
                           : per_worker == kWholeHost ? (held > 0 ? 1 : 0)
                                                      : held / per_worker;
    capacity.push_back(std::min(by_devices, CpuCapacity(hosts.hosts[h], config)));
  }
  const std::optional<std::vector<int>> counts =
      WorkersPerHost(capacity, config.num_workers(), config.placement_strategy());
  if (!counts) {
    return FailedPreconditionError(WhyNotPlaced(config, per_worker_text, hosts, offers, capacity));
  }
  std::vector<Seat> seats;
  for (size_t h = 0; h < hosts.hosts.size(); ++h) {
    for (int j = 0; j < (*counts)[h]; ++j) {
      Seat seat;
      seat.host = h;
      const int take = per_worker == kWholeHost ? static_cast<int>(devices[h].size()) : per_worker;
      for (int d = 0; d < take; ++d) seat.devices.push_back(devices[h][j * take + d]);
      seat.partial_host = take < static_cast<int>(devices[h].size());
      seats.push_back(std::move(seat));
    }
  }
  return seats;
}

std::vector<std::string> ChipIds(int chips) {
  std::vector<std::string> ids;
  for (int c = 0; c < chips; ++c) ids.push_back(std::to_string(c));
  return ids;
}

std::string NormalizedTopology(std::string_view topology) {
  std::string out;
  for (char c : topology) {
    if (!std::isspace(static_cast<unsigned char>(c))) {
      out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    }
  }
  return out;
}

std::string Plural(int n, const std::string& one) {
  return std::to_string(n) + " " + one + (n == 1 ? "" : "s");
}

// Why the described slice `members` (hosts in description order) cannot serve as one `want`
// slice; empty when it can.
std::string SliceMismatch(const config::ScalingConfig& config, const accelerators::TpuSlice& want,
                          const HostDescription& hosts, const std::vector<size_t>& members) {
  const Host& first = hosts.hosts[members.front()];
  if (!first.tpu_accelerator_type.empty()) {
    const auto described = accelerators::DescribeSlice(first.tpu_accelerator_type, want.topology);
    if (!described.ok() || described->generation != want.generation) {
      return "it is " + first.tpu_accelerator_type + ", not " + want.pod_type;
    }
  }
  if (!first.tpu_topology.empty() && NormalizedTopology(first.tpu_topology) != want.topology) {
    return "its topology is " + first.tpu_topology + ", not " + want.topology;
  }
  if (static_cast<int>(members.size()) != want.hosts) {
    return "it lists " + Plural(static_cast<int>(members.size()), "host") + ", and a " +
           want.pod_type + " slice has " + std::to_string(want.hosts);
  }
  std::set<int> ids;
  for (size_t h : members) ids.insert(hosts.hosts[h].tpu_worker_id);
  if (*ids.rbegin() != want.hosts - 1) {
    return "its worker ids are not 0.." + std::to_string(want.hosts - 1);
  }
  const int per_worker = static_cast<int>(config.resources_per_worker().at("TPU"));
  const int workers_per_host = want.chips_per_host / per_worker;
  for (size_t h : members) {
    const Host& host = hosts.hosts[h];
    if (host.tpu_chips != want.chips_per_host) {
      return "host " + Quoted(host.name) + " has " + Plural(host.tpu_chips, "chip") + ", and a " +
             want.pod_type + " host has " + std::to_string(want.chips_per_host);
    }
    if (CpuCapacity(host, config) < workers_per_host) {
      return "host " + Quoted(host.name) + " has " + Plural(host.cpus, "CPU") + ", too few for " +
             Plural(workers_per_host, "worker") + " x " +
             FormatNumber(config.resources_per_worker().at("CPU")) + " CPU";
    }
  }
  return "";
}

// Whole slices of the config's shape, filled one after the other.
StatusOr<std::vector<Seat>> SeatOnSlices(const config::ScalingConfig& config,
                                         const HostDescription& hosts,
                                         std::vector<UsedSlice>* used) {
  const accelerators::TpuSlice& want = *config.tpu_slice();
  const int per_worker = static_cast<int>(config.resources_per_worker().at("TPU"));
  const int needed = config.num_slices();

  std::vector<std::pair<std::string, std::vector<size_t>>> slices;  // in order of appearance
  for (size_t h = 0; h < hosts.hosts.size(); ++h) {
    if (hosts.hosts[h].tpu_chips == 0) continue;
    const std::string& name = hosts.hosts[h].tpu_slice;
    auto it = std::find_if(slices.begin(), slices.end(),
                           [&](const auto& slice) { return slice.first == name; });
    if (it == slices.end()) it = slices.insert(slices.end(), {name, {}});
    it->second.push_back(h);
  }
  std::vector<std::string> verdicts;
  for (auto& [name, members] : slices) {
    const std::string mismatch = SliceMismatch(config, want, hosts, members);
    if (!mismatch.empty()) {
      verdicts.push_back("slice " + Quoted(name) + ": " + mismatch);
      continue;
    }
    verdicts.push_back("slice " + Quoted(name) + " fits");
    if (static_cast<int>(used->size()) == needed) continue;
    std::sort(members.begin(), members.end(), [&](size_t a, size_t b) {
      return hosts.hosts[a].tpu_worker_id < hosts.hosts[b].tpu_worker_id;
    });
    used->push_back({.name = name,
                     .hosts = members,
                     .accelerator_type = want.pod_type,
                     .topology = want.topology});
  }
  if (static_cast<int>(used->size()) < needed) {
    const std::string offered = slices.empty() ? "no TPU hosts" : Join(verdicts, "; ");
    return FailedPreconditionError(
        "ScalingConfig(num_workers=" + std::to_string(config.num_workers()) + ", topology='" +
        want.topology + "') needs " + Plural(needed, "whole " + want.pod_type + " slice") + " (" +
        Plural(want.hosts, "host") + " x " + Plural(want.chips_per_host, "chip") +
        " each, used whole or not at all), but " + hosts.source + " has " +
        std::to_string(used->size()) + " that fit" + (used->size() == 1 ? "s" : "") + " (" +
        offered + ")");
  }
  std::vector<Seat> seats;
  for (int s = 0; s < needed; ++s) {
    for (size_t h : (*used)[s].hosts) {
      for (int j = 0; j < want.chips_per_host / per_worker; ++j) {
        Seat seat;
        seat.host = h;
        seat.slice = s;
        for (int c = 0; c < per_worker; ++c)
          seat.devices.push_back(std::to_string(j * per_worker + c));
        seat.partial_host = per_worker < want.chips_per_host;
        seats.push_back(std::move(seat));
      }
    }
  }
  return seats;
}

// A TPU worker without a topology: a whole host, or resources_per_worker["TPU"] chips when the
// user gave it, of a host of the generation asked for.
StatusOr<std::vector<Seat>> SeatOnTpuHosts(const config::ScalingConfig& config,
                                           const HostDescription& hosts,
                                           std::vector<UsedSlice>* used) {
  int per_worker = kWholeHost;
  if (config.input().resources_per_worker.count("TPU") != 0) {
    JT_ASSIGN_OR_RETURN(per_worker, WholeCount(config, "TPU"));
  }
  std::optional<accelerators::TpuGeneration> generation;
  if (config.input().accelerator_type) {
    JT_ASSIGN_OR_RETURN(generation,
                        accelerators::ParseTpuGeneration(*config.input().accelerator_type));
  }
  std::vector<std::vector<std::string>> devices;
  std::vector<std::string> offers;
  for (const Host& host : hosts.hosts) {
    bool other_generation = false;
    if (generation && !host.tpu_accelerator_type.empty()) {
      const auto parsed = accelerators::ParseTpuGeneration(host.tpu_accelerator_type);
      other_generation = !parsed.ok() || *parsed != *generation;
    }
    devices.push_back(other_generation ? std::vector<std::string>{} : ChipIds(host.tpu_chips));
    offers.push_back(Plural(host.tpu_chips, "TPU chip") +
                     (other_generation ? " of " + host.tpu_accelerator_type : ""));
  }
  JT_ASSIGN_OR_RETURN(
      std::vector<Seat> seats,
      SeatByStrategy(config, hosts, devices, per_worker,
                     per_worker == kWholeHost ? "a whole TPU host" : Plural(per_worker, "TPU chip"),
                     offers));
  for (Seat& seat : seats) {
    const Host& host = hosts.hosts[seat.host];
    auto it = std::find_if(used->begin(), used->end(),
                           [&](const UsedSlice& s) { return s.name == host.tpu_slice; });
    if (it == used->end()) {
      it = used->insert(used->end(), {.name = host.tpu_slice,
                                      .hosts = {seat.host},
                                      .accelerator_type = host.tpu_accelerator_type,
                                      .topology = host.tpu_topology});
    }
    seat.slice = static_cast<int>(it - used->begin());
  }
  return seats;
}

// A TPU slice plan that puts workers where a strict strategy forbids.
Status CheckStrictStrategy(const config::ScalingConfig& config, const HostDescription& hosts,
                           const std::vector<Seat>& seats) {
  std::map<size_t, int> per_host;
  for (const Seat& seat : seats) ++per_host[seat.host];
  const auto strategy = config.placement_strategy();
  if (strategy == PlacementStrategy::kStrictPack && per_host.size() > 1) {
    return FailedPreconditionError(
        "ScalingConfig(placement_strategy='STRICT_PACK') puts every worker on one host, but the " +
        config.tpu_slice()->pod_type + " slice(s) span " +
        Plural(static_cast<int>(per_host.size()), "host") +
        "; use PACK or SPREAD for a multi-host TPU slice");
  }
  if (strategy == PlacementStrategy::kStrictSpread) {
    for (const auto& [host, count] : per_host) {
      if (count > 1) {
        return FailedPreconditionError(
            "ScalingConfig(placement_strategy='STRICT_SPREAD') puts each worker on its own host, "
            "but resources_per_worker['TPU']=" +
            FormatNumber(config.resources_per_worker().at("TPU")) + " puts " +
            std::to_string(count) + " workers on host " + Quoted(hosts.hosts[host].name) +
            "; use PACK or SPREAD, or give each worker a whole host");
      }
    }
  }
  return OkStatus();
}

std::string ChipsPerHostBounds(int chips) {
  for (const auto& [count, bounds] : kChipsPerHostBounds) {
    if (count == chips) return bounds;
  }
  return "1," + std::to_string(chips) + ",1";
}

void SetTpuEnvironment(const Plan& plan, const std::vector<UsedSlice>& slices,
                       const HostDescription& hosts, const Seat& seat, const Environment& inherited,
                       WorkerPlacement* w) {
  const UsedSlice& slice = slices[seat.slice];
  const Host& host = hosts.hosts[seat.host];
  w->slice = slice.name;
  // Every value libtpu would ask the metadata server for is set here. "1" is what JAX itself
  // writes when it finds no chips, so a simulated worker sees the same value.
  w->env["TPU_SKIP_MDS_QUERY"] = "1";
  const auto set_or_unset = [&](const std::string& name, const std::string& value) {
    if (value.empty()) {
      w->unset_env.push_back(name);
    } else {
      w->env[name] = value;
    }
  };
  set_or_unset("TPU_ACCELERATOR_TYPE", slice.accelerator_type);
  set_or_unset("TPU_TOPOLOGY", slice.topology);
  if (seat.partial_host) {
    // The worker's chips run as a single-host slice of their own.
    w->env["TPU_VISIBLE_CHIPS"] = Join(seat.devices, ",");
    w->env["TPU_CHIPS_PER_HOST_BOUNDS"] = ChipsPerHostBounds(static_cast<int>(seat.devices.size()));
    w->env["TPU_HOST_BOUNDS"] = kSingleHostBounds;
    w->env["TPU_WORKER_ID"] = "0";
    w->env["TPU_WORKER_HOSTNAMES"] = host.address;
  } else {
    for (const char* name : kPartialHostVariables) w->unset_env.push_back(name);
    std::vector<std::string> addresses;
    for (size_t h : slice.hosts) addresses.push_back(hosts.hosts[h].address);
    w->env["TPU_WORKER_ID"] = std::to_string(host.tpu_worker_id);
    w->env["TPU_WORKER_HOSTNAMES"] = Join(addresses, ",");
  }
  if (plan.num_slices > 1) {
    w->env["MEGASCALE_COORDINATOR_ADDRESS"] =
        plan.workers.empty() ? w->address : plan.workers[0].address;
    w->env["MEGASCALE_NUM_SLICES"] = std::to_string(plan.num_slices);
    w->env["MEGASCALE_SLICE_ID"] = std::to_string(seat.slice);
    if (!IsSet(inherited, "MEGASCALE_PORT")) w->env["MEGASCALE_PORT"] = kDefaultMegascalePort;
  } else {
    for (const char* name : kMegascaleComputed) w->unset_env.push_back(name);
  }
}

}  // namespace

StatusOr<Plan> PlanOnHosts(const config::ScalingConfig& config, const HostDescription& hosts,
                           const Environment& inherited, bool simulate) {
  Plan plan;
  plan.simulated = simulate;
  plan.hosts_source = hosts.source;
  plan.accelerator = config.use_tpu() ? "tpu" : config.use_gpu() ? "gpu" : "cpu";
  const std::string native = config.use_tpu() ? "tpu" : config.use_gpu() ? "cuda" : "cpu";
  plan.platform = simulate ? "cpu" : native;

  std::vector<Seat> seats;
  std::vector<UsedSlice> slices;
  if (config.use_tpu() && config.tpu_slice()) {
    JT_ASSIGN_OR_RETURN(seats, SeatOnSlices(config, hosts, &slices));
    JT_RETURN_IF_ERROR(CheckStrictStrategy(config, hosts, seats));
  } else if (config.use_tpu()) {
    JT_ASSIGN_OR_RETURN(seats, SeatOnTpuHosts(config, hosts, &slices));
  } else if (config.use_gpu()) {
    JT_ASSIGN_OR_RETURN(const int per_worker, WholeCount(config, "GPU"));
    std::vector<std::vector<std::string>> devices;
    std::vector<std::string> offers;
    for (const Host& host : hosts.hosts) {
      devices.push_back(host.gpus);
      offers.push_back(Plural(static_cast<int>(host.gpus.size()), "GPU") +
                       (host.gpus.empty() ? "" : " (" + Join(host.gpus, ",") + ")"));
    }
    JT_ASSIGN_OR_RETURN(seats, SeatByStrategy(config, hosts, devices, per_worker,
                                              Plural(per_worker, "GPU"), offers));
  } else {
    const std::vector<std::vector<std::string>> devices(hosts.hosts.size());
    std::vector<std::string> offers;
    for (const Host& host : hosts.hosts) {
      offers.push_back(host.cpus == 0 ? "CPUs not limited" : Plural(host.cpus, "CPU"));
    }
    const auto cpu = config.resources_per_worker().find("CPU");
    JT_ASSIGN_OR_RETURN(seats, SeatByStrategy(config, hosts, devices, 0,
                                              FormatNumber(cpu->second) + " CPU", offers));
  }
  plan.num_slices = static_cast<int>(slices.size());

  std::map<size_t, int> node_rank;
  std::map<size_t, int> workers_on_host;
  for (const Seat& seat : seats) ++workers_on_host[seat.host];
  std::map<size_t, int> next_local_rank;
  for (size_t r = 0; r < seats.size(); ++r) {
    const Seat& seat = seats[r];
    const Host& host = hosts.hosts[seat.host];
    WorkerPlacement w;
    w.rank = static_cast<int>(r);
    w.node_rank = node_rank.emplace(seat.host, static_cast<int>(node_rank.size())).first->second;
    w.local_rank = next_local_rank[seat.host]++;
    w.local_world_size = workers_on_host[seat.host];
    w.host = host.name;
    w.address = host.address;
    w.devices = seat.devices;

    const auto set_unless_inherited = [&](const std::string& name, const std::string& value) {
      if (!IsSet(inherited, name)) w.env[name] = value;
    };
    if (simulate) {
      w.env["JAX_PLATFORMS"] = "cpu";  // whatever the user set for the real hardware
    } else {
      set_unless_inherited("JAX_PLATFORMS", native);
    }
    if (plan.platform == "cpu") {
      set_unless_inherited("JAX_NUM_CPU_DEVICES", "1");
      set_unless_inherited("JAX_CPU_COLLECTIVES_IMPLEMENTATION", "gloo");
    }
    if (config.use_gpu()) w.env["CUDA_VISIBLE_DEVICES"] = Join(w.devices, ",");
    if (config.use_tpu()) SetTpuEnvironment(plan, slices, hosts, seat, inherited, &w);
    plan.workers.push_back(std::move(w));
  }
  return plan;
}

namespace {

Environment InheritedFrom(const accelerators::HostView& view) {
  Environment inherited;
  for (const char* name : kInheritedNames) {
    if (const std::optional<std::string> value = view.GetEnv(name)) inherited[name] = *value;
  }
  return inherited;
}

bool SimulateSwitch(const accelerators::HostView& view) {
  const std::optional<std::string> value = view.GetEnv(kSimulateEnv);
  return value && !value->empty() && *value != "0";
}

}  // namespace

StatusOr<Plan> PlanLocal(const config::ScalingConfig& config, const accelerators::HostView& view) {
  const Environment inherited = InheritedFrom(view);
  const bool simulate = SimulateSwitch(view);
  const bool accelerated = config.use_tpu() || config.use_gpu();
  const std::string how_to_simulate =
      accelerated
          ? std::string("; to run this configuration on local CPU processes instead, set ") +
                kSimulateEnv + "=1"
          : "";

  HostDescription hosts;
  const std::optional<std::string> path = view.GetEnv(kHostsEnv);
  if (path && !path->empty()) {
    JT_ASSIGN_OR_RETURN(hosts, LoadHostDescription(view, *path, inherited));
  } else if (simulate && accelerated) {
    hosts = SimulatedHosts(config);
  } else {
    hosts = DescribeThisHost(view);
    const Host& here = hosts.hosts.front();
    if (config.use_tpu() && here.tpu_chips == 0) {
      return FailedPreconditionError(
          "ScalingConfig(use_tpu=True) asks for TPU chips, but this machine has none (no "
          "/dev/accel* devices, no Google /dev/vfio groups)" +
          how_to_simulate);
    }
    if (config.use_gpu() && here.gpus.empty()) {
      return FailedPreconditionError(
          "ScalingConfig(use_gpu=True) asks for GPUs, but this machine has none visible (no "
          "/dev/nvidia<N> devices, or CUDA_VISIBLE_DEVICES is empty)" +
          how_to_simulate);
    }
  }

  StatusOr<Plan> plan = PlanOnHosts(config, hosts, inherited, simulate);
  const bool this_machine = !simulate && !(path && !path->empty());
  if (!plan.ok()) {
    // On this machine's own hardware, say what else could run the configuration.
    if (plan.status().code() != StatusCode::kFailedPrecondition || !this_machine) return plan;
    std::string hint;
    if (config.tpu_slice() && config.tpu_slice()->hosts > 1) {
      hint = "; a " + config.tpu_slice()->pod_type + " slice spans " +
             Plural(config.tpu_slice()->hosts, "host") +
             " and the local launcher runs on this one machine: run under Slurm, or use a "
             "single-host topology";
    }
    return FailedPreconditionError(plan.status().message() + hint + how_to_simulate);
  }
  if (!simulate) {
    std::vector<std::string> remote;
    for (const WorkerPlacement& w : plan->workers) {
      const auto host = std::find_if(hosts.hosts.begin(), hosts.hosts.end(),
                                     [&](const Host& h) { return h.name == w.host; });
      if (!host->local && std::find(remote.begin(), remote.end(), w.host) == remote.end()) {
        remote.push_back(w.host);
      }
    }
    if (!remote.empty()) {
      return FailedPreconditionError(
          "the plan from " + hosts.source + " puts workers on " +
          Plural(static_cast<int>(remote.size()), "host") + " other than this machine (" +
          Join(remote, ", ") +
          "), and the local launcher starts processes on this machine only; set " + kSimulateEnv +
          "=1 to run them here as CPU processes with the planned environment, or launch on those "
          "hosts with a cluster launcher (Slurm)");
    }
  }
  return plan;
}

StatusOr<Plan> PlanForScheduler(const config::ScalingConfig& config,
                                const accelerators::HostView& env) {
  const bool simulate = SimulateSwitch(env);
  if (simulate && config.use_tpu()) {
    // The ranks' environment is the one a local simulated run gives them (TPU_WORKER_ID,
    // TPU_WORKER_HOSTNAMES, ...), from the same hosts; where they run is the engine's to choose.
    JT_ASSIGN_OR_RETURN(Plan plan,
                        PlanOnHosts(config, SimulatedHosts(config), InheritedFrom(env), true));
    plan.hosts_source.clear();
    for (WorkerPlacement& w : plan.workers) {
      w = {.rank = w.rank, .env = std::move(w.env), .unset_env = std::move(w.unset_env)};
    }
    return plan;
  }
  Plan plan;
  plan.simulated = simulate && config.use_gpu();
  plan.platform = plan.simulated || (!config.use_gpu() && !config.use_tpu()) ? "cpu"
                  : config.use_gpu()                                         ? "cuda"
                                                                             : "tpu";
  auto unless_set = [&](WorkerPlacement& w, const std::string& name, const std::string& value) {
    auto user = env.GetEnv(name);
    if (!user || user->empty()) w.env[name] = value;
  };
  // One environment for every rank; what differs per rank (devices) is the engine's to give.
  for (int r = 0; r < config.num_workers(); ++r) {
    WorkerPlacement w;
    w.rank = r;
    if (plan.platform == "cpu") {
      if (plan.simulated) {
        w.env["JAX_PLATFORMS"] = "cpu";  // whatever the user set for the real hardware
      } else {
        unless_set(w, "JAX_PLATFORMS", "cpu");
      }
      unless_set(w, "JAX_NUM_CPU_DEVICES", "1");
      unless_set(w, "JAX_CPU_COLLECTIVES_IMPLEMENTATION", "gloo");
    } else {
      unless_set(w, "JAX_PLATFORMS", plan.platform);
    }
    plan.workers.push_back(std::move(w));
  }
  return plan;
}

}  // namespace jaxtrain::placement
