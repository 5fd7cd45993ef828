#include "placement/plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

namespace jaxtrain::placement {
namespace {

using Strings = std::vector<std::string>;

::testing::AssertionResult HasSubstr(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << text << "' does not contain '" << part << "'";
}

config::ScalingConfig Make(config::ScalingConfigInput in) {
  auto c = config::ScalingConfig::Create(std::move(in));
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return *c;
}

config::ScalingConfigInput Tpu(int num_workers, std::string topology, std::string type,
                               std::optional<double> chips_per_worker = std::nullopt) {
  config::ScalingConfigInput in;
  in.num_workers = num_workers;
  in.use_tpu = true;
  in.topology = std::move(topology);
  in.accelerator_type = std::move(type);
  if (chips_per_worker) in.resources_per_worker = {{"TPU", *chips_per_worker}};
  return in;
}

config::ScalingConfigInput Gpu(int num_workers, double gpus_per_worker,
                               std::string strategy = "PACK") {
  config::ScalingConfigInput in;
  in.num_workers = num_workers;
  in.use_gpu = true;
  in.resources_per_worker = {{"GPU", gpus_per_worker}};
  in.placement_strategy = std::move(strategy);
  return in;
}

// The hosts of one slice, listed in `worker_ids` order.
std::vector<Host> SliceHosts(const std::string& slice, const std::string& type,
                             const std::string& topology, int chips,
                             const std::vector<int>& worker_ids) {
  std::vector<Host> hosts;
  for (int id : worker_ids) {
    Host h;
    h.name = slice + "-" + std::to_string(id);
    h.address = "10." + slice + "." + std::to_string(id);
    h.tpu_chips = chips;
    h.tpu_slice = slice;
    h.tpu_worker_id = id;
    h.tpu_accelerator_type = type;
    h.tpu_topology = topology;
    hosts.push_back(h);
  }
  return hosts;
}

HostDescription Describe(std::vector<std::vector<Host>> groups) {
  HostDescription d{.source = "test hosts", .hosts = {}};
  for (auto& g : groups) d.hosts.insert(d.hosts.end(), g.begin(), g.end());
  return d;
}

Host GpuHost(const std::string& name, int gpus, int cpus = 0) {
  Host h;
  h.name = name;
  h.address = name;
  h.cpus = cpus;
  for (int g = 0; g < gpus; ++g) h.gpus.push_back(std::to_string(g));
  return h;
}

bool Unsets(const WorkerPlacement& w, const std::string& name) {
  return std::find(w.unset_env.begin(), w.unset_env.end(), name) != w.unset_env.end();
}

std::string Env(const WorkerPlacement& w, const std::string& name) {
  const auto it = w.env.find(name);
  return it == w.env.end() ? "<unset>" : it->second;
}

// --- PlanLocal: this machine ---

TEST(PlanLocalTest, CpuWorkersGetOneCpuDeviceAndGloo) {
  config::ScalingConfigInput in;
  in.num_workers = 4;
  accelerators::FakeHost host;
  auto plan = PlanLocal(Make(in), host);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->platform, "cpu");
  EXPECT_EQ(plan->accelerator, "cpu");
  EXPECT_EQ(plan->hosts_source, "this machine");
  ASSERT_EQ(plan->workers.size(), 4u);
  for (int r = 0; r < 4; ++r) {
    const auto& w = plan->workers[r];
    EXPECT_EQ(w.rank, r);
    EXPECT_EQ(w.local_rank, r);
    EXPECT_EQ(w.local_world_size, 4);
    EXPECT_EQ(w.node_rank, 0);
    EXPECT_EQ(w.host, "fake-host");
    EXPECT_EQ(w.env.at("JAX_PLATFORMS"), "cpu");
    EXPECT_EQ(w.env.at("JAX_NUM_CPU_DEVICES"), "1");
    EXPECT_EQ(w.env.at("JAX_CPU_COLLECTIVES_IMPLEMENTATION"), "gloo");
    EXPECT_TRUE(w.unset_env.empty());
  }
}

TEST(PlanLocalTest, UserSettingsAreKept) {
  accelerators::FakeHost host;
  host.env["JAX_NUM_CPU_DEVICES"] = "2";
  auto plan = PlanLocal(Make({}), host);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->workers[0].env.count("JAX_NUM_CPU_DEVICES"), 0u);
}

TEST(PlanLocalTest, LocalCpuCountIsNotALimit) {
  config::ScalingConfigInput in;
  in.num_workers = 8;
  accelerators::FakeHost host;
  host.cpus = 2;
  EXPECT_TRUE(PlanLocal(Make(in), host).ok());
}

TEST(PlanLocalTest, StrictSpreadOnOneMachineIsRefused) {
  config::ScalingConfigInput in;
  in.num_workers = 2;
  in.placement_strategy = "STRICT_SPREAD";
  accelerators::FakeHost host;
  auto plan = PlanLocal(Make(in), host);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(HasSubstr(plan.status().message(), "STRICT_SPREAD needs 2 distinct hosts"));
}

TEST(PlanLocalTest, TpuWithoutChipsNamesTheSimulateSwitch) {
  accelerators::FakeHost host;
  auto plan = PlanLocal(Make(Tpu(4, "4x4", "TPU-V6E")), host);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(HasSubstr(plan.status().message(), "JAXTRAIN_SIMULATE=1"));
  EXPECT_TRUE(HasSubstr(plan.status().message(), "use_tpu=True"));
}

TEST(PlanLocalTest, ATpuWorkerWithoutTopologyTakesTheWholeHost) {
  accelerators::FakeHost host;
  host.char_devices = {"/dev/accel0", "/dev/accel1", "/dev/accel2", "/dev/accel3"};
  config::ScalingConfigInput in;
  in.use_tpu = true;
  auto plan = PlanLocal(Make(in), host);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->workers[0].devices, (Strings{"0", "1", "2", "3"}));
  EXPECT_EQ(Env(plan->workers[0], "TPU_VISIBLE_CHIPS"), "<unset>");
  EXPECT_TRUE(Unsets(plan->workers[0], "TPU_ACCELERATOR_TYPE"));  // unknown on a bare TPU VM

  host.env["JAXTRAIN_SIMULATE"] = "1";
  plan = PlanLocal(Make(in), host);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->workers[0].host, "sim-host-0");
  EXPECT_EQ(plan->workers[0].devices.size(), 4u);
}

TEST(PlanLocalTest, MultiHostSliceOnOneTpuHostNamesTheLauncherAndTheSwitch) {
  accelerators::FakeHost host;
  host.char_devices = {"/dev/accel0", "/dev/accel1", "/dev/accel2", "/dev/accel3"};
  auto plan = PlanLocal(Make(Tpu(4, "2x2x4", "TPU-V4")), host);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(HasSubstr(plan.status().message(), "needs 1 whole v4-32 slice"));
  EXPECT_TRUE(HasSubstr(plan.status().message(), "it lists 1 host, and a v4-32 slice has 4"));
  EXPECT_TRUE(HasSubstr(plan.status().message(), "run under Slurm"));
  EXPECT_TRUE(HasSubstr(plan.status().message(), "JAXTRAIN_SIMULATE=1"));
}

TEST(PlanLocalTest, SingleHostTpuUsesThisMachinesChipsAndIdentity) {
  accelerators::FakeHost host;
  for (int c = 0; c < 8; ++c) host.char_devices.push_back("/dev/accel" + std::to_string(c));
  host.env = {{"TPU_ACCELERATOR_TYPE", "v6e-8"}, {"TPU_TOPOLOGY", "2x4"}};
  auto plan = PlanLocal(Make(Tpu(1, "2x4", "TPU-V6E")), host);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->platform, "tpu");
  const auto& w = plan->workers[0];
  EXPECT_EQ(w.slice, "fake-host");
  EXPECT_EQ(w.devices, (Strings{"0", "1", "2", "3", "4", "5", "6", "7"}));
  EXPECT_EQ(Env(w, "JAX_PLATFORMS"), "tpu");
  EXPECT_EQ(Env(w, "TPU_WORKER_ID"), "0");
  EXPECT_EQ(Env(w, "TPU_WORKER_HOSTNAMES"), "localhost");
  EXPECT_EQ(Env(w, "TPU_ACCELERATOR_TYPE"), "v6e-8");
  EXPECT_EQ(Env(w, "TPU_TOPOLOGY"), "2x4");
  EXPECT_EQ(Env(w, "TPU_SKIP_MDS_QUERY"), "1");
  EXPECT_EQ(Env(w, "TPU_VISIBLE_CHIPS"), "<unset>");
  EXPECT_TRUE(Unsets(w, "TPU_VISIBLE_CHIPS"));
  EXPECT_TRUE(Unsets(w, "TPU_HOST_BOUNDS"));
  EXPECT_TRUE(Unsets(w, "MEGASCALE_NUM_SLICES"));
}

TEST(PlanLocalTest, SimulatedTpuRunsOnCpuWithTheSameWorldSizeAndTheTpuEnvironment) {
  accelerators::FakeHost host;
  host.env["JAXTRAIN_SIMULATE"] = "1";
  host.env["JAX_PLATFORMS"] = "tpu";
  auto plan = PlanLocal(Make(Tpu(4, "4x4", "TPU-V6E")), host);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_TRUE(plan->simulated);
  EXPECT_EQ(plan->platform, "cpu");
  EXPECT_EQ(plan->accelerator, "tpu");
  EXPECT_EQ(plan->hosts_source, "the simulated hosts");
  ASSERT_EQ(plan->workers.size(), 4u);
  const auto& w = plan->workers[3];
  EXPECT_EQ(Env(w, "JAX_PLATFORMS"), "cpu");
  EXPECT_EQ(Env(w, "JAX_NUM_CPU_DEVICES"), "1");
  EXPECT_EQ(Env(w, "TPU_WORKER_ID"), "3");
  EXPECT_EQ(Env(w, "TPU_ACCELERATOR_TYPE"), "v6e-16");
  EXPECT_EQ(Env(w, "TPU_WORKER_HOSTNAMES"),
            "sim-slice-0-host-0,sim-slice-0-host-1,sim-slice-0-host-2,sim-slice-0-host-3");
}

TEST(PlanForSchedulerTest, SimulatedTpuRanksGetTheEnvironmentOfALocalSimulatedRun) {
  accelerators::FakeHost host;
  host.env["JAXTRAIN_SIMULATE"] = "1";
  for (const auto& in : {Tpu(4, "4x4", "TPU-V6E"), Tpu(8, "2x2x2", "TPU-V4"),
                         Tpu(8, "4x4", "TPU-V6E")}) {  // the last: two slices
    const config::ScalingConfig config = Make(in);
    auto local = PlanLocal(config, host);
    auto scheduled = PlanForScheduler(config, host);
    ASSERT_TRUE(local.ok()) << local.status().ToString();
    ASSERT_TRUE(scheduled.ok()) << scheduled.status().ToString();
    EXPECT_TRUE(scheduled->simulated);
    EXPECT_EQ(scheduled->platform, "cpu");
    EXPECT_EQ(scheduled->num_slices, local->num_slices);
    ASSERT_EQ(scheduled->workers.size(), local->workers.size());
    std::set<std::string> differing;
    for (size_t r = 0; r < local->workers.size(); ++r) {
      const WorkerPlacement& w = scheduled->workers[r];
      EXPECT_EQ(w.rank, static_cast<int>(r));
      EXPECT_EQ(w.env, local->workers[r].env) << "rank " << r;
      EXPECT_EQ(w.unset_env, local->workers[r].unset_env) << "rank " << r;
      // The engine places the ranks: no host or device of the simulated hosts is kept.
      EXPECT_EQ(w.host, "");
      EXPECT_TRUE(w.devices.empty());
      for (const auto& [name, value] : w.env) {
        if (Env(scheduled->workers[0], name) != value) differing.insert(name);
      }
    }
    for (const std::string& name : differing) {
      EXPECT_TRUE(kPerRankPlacementVariables.count(name)) << name << " differs between ranks";
    }
  }
  EXPECT_EQ(
      Env(PlanForScheduler(Make(Tpu(4, "4x4", "TPU-V6E")), host)->workers[2], "TPU_WORKER_ID"),
      "2");
}

TEST(PlanForSchedulerTest, WithoutTheSimulateSwitchEveryRankHasOneEnvironment) {
  accelerators::FakeHost host;
  auto plan = PlanForScheduler(Make(Tpu(4, "4x4", "TPU-V6E")), host);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_FALSE(plan->simulated);
  EXPECT_EQ(plan->platform, "tpu");
  for (const WorkerPlacement& w : plan->workers) {
    EXPECT_EQ(w.env, (std::map<std::string, std::string>{{"JAX_PLATFORMS", "tpu"}}));
  }
}

TEST(PlanLocalTest, GpuWithoutDevicesNamesTheSimulateSwitch) {
  config::ScalingConfigInput in;
  in.use_gpu = true;
  accelerators::FakeHost host;
  auto plan = PlanLocal(Make(in), host);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(HasSubstr(plan.status().message(), "JAXTRAIN_SIMULATE=1"));
}

TEST(PlanLocalTest, GpusAreMappedThroughTheInheritedVisibleDevices) {
  accelerators::FakeHost host;
  host.char_devices = {"/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2", "/dev/nvidia3"};
  host.env["CUDA_VISIBLE_DEVICES"] = "3,1,2,0";
  auto plan = PlanLocal(Make(Gpu(2, 2)), host);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->platform, "cuda");
  EXPECT_EQ(plan->workers[0].env.at("CUDA_VISIBLE_DEVICES"), "3,1");
  EXPECT_EQ(plan->workers[1].env.at("CUDA_VISIBLE_DEVICES"), "2,0");
  EXPECT_EQ(plan->workers[1].env.at("JAX_PLATFORMS"), "cuda");
  EXPECT_EQ(plan->workers[1].local_rank, 1);
}

TEST(PlanLocalTest, TooFewGpusIsRefusedWhole) {
  accelerators::FakeHost host;
  host.char_devices = {"/dev/nvidia0", "/dev/nvidia1"};
  auto plan = PlanLocal(Make(Gpu(3, 1)), host);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(HasSubstr(plan.status().message(), "3 workers x 1 GPU (PACK)"));
  EXPECT_TRUE(HasSubstr(plan.status().message(), "2 GPUs (0,1) -> room for 2"));
  EXPECT_TRUE(HasSubstr(plan.status().message(), "JAXTRAIN_SIMULATE=1"));
}

// --- PlanLocal: a host description named by JAXTRAIN_HOSTS ---

constexpr char kTwoV4Slices[] = R"({"hosts": [
  {"name": "a0", "address": "10.0.0.1", "tpu": {"chips": 4, "slice": "a", "worker_id": 0,
    "accelerator_type": "v4", "topology": "2x2x2"}},
  {"name": "a1", "address": "10.0.0.2", "tpu": {"chips": 4, "slice": "a", "worker_id": 1,
    "accelerator_type": "v4", "topology": "2x2x2"}},
  {"name": "b0", "address": "10.0.1.1", "tpu": {"chips": 4, "slice": "b", "worker_id": 0,
    "accelerator_type": "v4", "topology": "2x2x2"}},
  {"name": "b1", "address": "10.0.1.2", "tpu": {"chips": 4, "slice": "b", "worker_id": 1,
    "accelerator_type": "v4", "topology": "2x2x2"}}]})";

TEST(PlanLocalTest, DescribedRemoteHostsAreRefusedWithoutTheSimulateSwitch) {
  accelerators::FakeHost host;
  host.env["JAXTRAIN_HOSTS"] = "/hosts.json";
  host.files["/hosts.json"] = kTwoV4Slices;
  auto plan = PlanLocal(Make(Tpu(4, "2x2x2", "TPU-V4")), host);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(HasSubstr(plan.status().message(),
                        "the plan from JAXTRAIN_HOSTS=/hosts.json puts workers on 4 hosts other "
                        "than this machine (a0, a1, b0, b1)"));
  EXPECT_TRUE(HasSubstr(plan.status().message(), "JAXTRAIN_SIMULATE=1"));
}

TEST(PlanLocalTest, DescribedHostsRunSimulatedWithTheirEnvironment) {
  accelerators::FakeHost host;
  host.env = {{"JAXTRAIN_HOSTS", "/hosts.json"}, {"JAXTRAIN_SIMULATE", "1"}};
  host.files["/hosts.json"] = kTwoV4Slices;
  auto plan = PlanLocal(Make(Tpu(4, "2x2x2", "TPU-V4")), host);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->hosts_source, "JAXTRAIN_HOSTS=/hosts.json");
  EXPECT_EQ(plan->platform, "cpu");
  EXPECT_EQ(plan->num_slices, 2);
  EXPECT_EQ(Env(plan->workers[2], "MEGASCALE_SLICE_ID"), "1");
}

TEST(PlanLocalTest, ADescriptionOfThisMachineRunsWithoutTheSwitch) {
  accelerators::FakeHost host;
  host.hostname = "box";
  host.env = {{"JAXTRAIN_HOSTS", "/hosts.json"}, {"CUDA_VISIBLE_DEVICES", "3,1,2,0"}};
  host.files["/hosts.json"] = R"({"hosts": [{"name": "box", "gpus": 4}]})";
  auto plan = PlanLocal(Make(Gpu(2, 2)), host);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->platform, "cuda");
  EXPECT_EQ(Env(plan->workers[0], "CUDA_VISIBLE_DEVICES"), "3,1");
  EXPECT_EQ(Env(plan->workers[1], "CUDA_VISIBLE_DEVICES"), "2,0");
}

TEST(PlanLocalTest, AnUnreadableDescriptionIsNotFound) {
  accelerators::FakeHost host;
  host.env["JAXTRAIN_HOSTS"] = "/missing.json";
  auto plan = PlanLocal(Make({}), host);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kNotFound);
}

// --- PlanOnHosts: TPU slices ---

// Every generation, every topology of up to 64 hosts, every chip count per worker that divides
// a host: one slice and two slices.
TEST(PlanOnHostsTest, EveryGenerationsTopologiesPlanWholeSlicesContiguously) {
  int plans = 0;
  for (accelerators::TpuGeneration generation : accelerators::AllGenerations()) {
    const std::string type(accelerators::GenerationName(generation));
    for (const std::string& topology : accelerators::ValidTopologies(generation)) {
      const auto slice = accelerators::DescribeSlice(type, topology);
      ASSERT_TRUE(slice.ok());
      if (slice->hosts > 64) continue;
      for (int k : {1, 2, 4, 8}) {
        if (k > slice->chips_per_host || slice->chips_per_host % k != 0) continue;
        const int per_host = slice->chips_per_host / k;
        for (int num_slices : {1, 2}) {
          const std::string what = type + " " + topology + " k=" + std::to_string(k) +
                                   " slices=" + std::to_string(num_slices);
          const int n = num_slices * slice->hosts * per_host;
          const auto config = Make(Tpu(n, topology, type, k));
          HostDescription hosts = SimulatedHosts(config);
          // Each slice's hosts listed in reverse worker-id order: ranks still follow worker ids.
          std::stable_sort(hosts.hosts.begin(), hosts.hosts.end(),
                           [](const Host& a, const Host& b) {
                             return std::pair(a.tpu_slice, -a.tpu_worker_id) <
                                    std::pair(b.tpu_slice, -b.tpu_worker_id);
                           });
          auto plan = PlanOnHosts(config, hosts, {}, false);
          ASSERT_TRUE(plan.ok()) << what << ": " << plan.status().ToString();
          ++plans;
          ASSERT_EQ(static_cast<int>(plan->workers.size()), n) << what;
          EXPECT_EQ(plan->num_slices, num_slices) << what;
          std::set<std::pair<std::string, std::string>> chips_taken;
          for (const WorkerPlacement& w : plan->workers) {
            const int slice_index = w.rank / (slice->hosts * per_host);
            const int worker_id = (w.rank % (slice->hosts * per_host)) / per_host;
            EXPECT_EQ(Env(w, "TPU_ACCELERATOR_TYPE"), slice->pod_type) << what;
            EXPECT_EQ(Env(w, "TPU_TOPOLOGY"), slice->topology) << what;
            EXPECT_EQ(static_cast<int>(w.devices.size()), k) << what;
            EXPECT_EQ(w.local_world_size, per_host) << what;
            EXPECT_EQ(w.local_rank, w.rank % per_host) << what;
            EXPECT_EQ(w.node_rank, w.rank / per_host) << what;
            EXPECT_EQ(w.slice, "sim-slice-" + std::to_string(slice_index)) << what;
            for (const auto& chip : w.devices) {
              EXPECT_TRUE(chips_taken.insert({w.host, chip}).second) << what << " " << chip;
            }
            if (k == slice->chips_per_host) {
              EXPECT_EQ(Env(w, "TPU_WORKER_ID"), std::to_string(worker_id)) << what;
              EXPECT_EQ(Env(w, "TPU_VISIBLE_CHIPS"), "<unset>") << what;
              EXPECT_TRUE(Unsets(w, "TPU_HOST_BOUNDS")) << what;
            } else {
              EXPECT_EQ(Env(w, "TPU_WORKER_ID"), "0") << what;
              EXPECT_EQ(Env(w, "TPU_HOST_BOUNDS"), "1,1,1") << what;
              EXPECT_NE(Env(w, "TPU_CHIPS_PER_HOST_BOUNDS"), "<unset>") << what;
            }
            if (num_slices == 2) {
              EXPECT_EQ(Env(w, "MEGASCALE_SLICE_ID"), std::to_string(slice_index)) << what;
              EXPECT_EQ(Env(w, "MEGASCALE_NUM_SLICES"), "2") << what;
              EXPECT_EQ(Env(w, "MEGASCALE_COORDINATOR_ADDRESS"), "sim-slice-0-host-0") << what;
            } else {
              EXPECT_EQ(Env(w, "MEGASCALE_SLICE_ID"), "<unset>") << what;
              EXPECT_TRUE(Unsets(w, "MEGASCALE_SLICE_ID")) << what;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(plans, 150);
}

TEST(PlanOnHostsTest, MultiSliceRanksFollowSliceOrderThenWorkerId) {
  // Listed out of order: b's hosts first, each slice's worker ids reversed.
  const HostDescription hosts = Describe(
      {SliceHosts("b", "v4-16", "2x2x2", 4, {1, 0}), SliceHosts("a", "v4-16", "2x2x2", 4, {1, 0})});
  auto plan = PlanOnHosts(Make(Tpu(4, "2x2x2", "TPU-V4")), hosts, {}, false);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  Strings order;
  for (const auto& w : plan->workers) order.push_back(w.host);
  EXPECT_EQ(order, (Strings{"b-0", "b-1", "a-0", "a-1"}));
  EXPECT_EQ(Env(plan->workers[0], "TPU_WORKER_HOSTNAMES"), "10.b.0,10.b.1");
  EXPECT_EQ(Env(plan->workers[3], "TPU_WORKER_HOSTNAMES"), "10.a.0,10.a.1");
  EXPECT_EQ(Env(plan->workers[3], "TPU_WORKER_ID"), "1");
  EXPECT_EQ(Env(plan->workers[3], "MEGASCALE_COORDINATOR_ADDRESS"), "10.b.0");
  EXPECT_EQ(Env(plan->workers[3], "MEGASCALE_PORT"), "8081");
  EXPECT_EQ(Env(plan->workers[1], "MEGASCALE_SLICE_ID"), "0");
  EXPECT_EQ(Env(plan->workers[2], "MEGASCALE_SLICE_ID"), "1");
  EXPECT_EQ(plan->workers[2].slice, "a");
}

TEST(PlanOnHostsTest, AUsersMegascalePortIsKept) {
  const HostDescription hosts = Describe(
      {SliceHosts("a", "v4-16", "2x2x2", 4, {0, 1}), SliceHosts("b", "v4-16", "2x2x2", 4, {0, 1})});
  auto plan =
      PlanOnHosts(Make(Tpu(4, "2x2x2", "TPU-V4")), hosts, {{"MEGASCALE_PORT", "9999"}}, false);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  for (const auto& w : plan->workers) {
    EXPECT_EQ(Env(w, "MEGASCALE_PORT"), "<unset>");  // inherited as the user set it
    EXPECT_FALSE(Unsets(w, "MEGASCALE_PORT"));
  }
}

TEST(PlanOnHostsTest, OnlyTheSlicesNeededAreTakenAndMismatchesAreSkipped) {
  std::vector<Host> short_slice = SliceHosts("short", "", "", 4, {0, 1, 2});
  const HostDescription hosts = Describe({SliceHosts("v5p", "v5p-32", "2x2x4", 4, {0, 1, 2, 3}),
                                          SliceHosts("small", "v4-16", "2x2x2", 4, {0, 1}),
                                          short_slice, SliceHosts("fat", "", "", 8, {0, 1, 2, 3}),
                                          SliceHosts("good", "v4-32", "2x2x4", 4, {0, 1, 2, 3}),
                                          SliceHosts("spare", "v4-32", "2x2x4", 4, {0, 1, 2, 3})});
  auto plan = PlanOnHosts(Make(Tpu(4, "2x2x4", "TPU-V4")), hosts, {}, false);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  for (const auto& w : plan->workers) EXPECT_EQ(w.slice, "good");

  auto refused = PlanOnHosts(Make(Tpu(12, "2x2x4", "TPU-V4")), hosts, {}, false);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  const std::string& message = refused.status().message();
  EXPECT_TRUE(HasSubstr(message,
                        "needs 3 whole v4-32 slices (4 hosts x 4 chips each, used whole "
                        "or not at all), but test hosts has 2 that fit"));
  EXPECT_TRUE(HasSubstr(message, "slice \"v5p\": it is v5p-32, not v4-32"));
  EXPECT_TRUE(HasSubstr(message, "slice \"small\": it is v4-16, not v4-32"));
  EXPECT_TRUE(HasSubstr(message, "slice \"short\": it lists 3 hosts, and a v4-32 slice has 4"));
  EXPECT_TRUE(HasSubstr(message, "slice \"fat\": host \"fat-0\" has 8 chips"));
  EXPECT_TRUE(HasSubstr(message, "slice \"good\" fits"));
}

TEST(PlanOnHostsTest, APartialHostGivesEachWorkerItsOwnChipsAndBounds) {
  const struct {
    std::string topology;
    std::string type;
    int chips_per_worker;
    Strings visible;  // of each worker on the first host
    std::string bounds;
  } kCases[] = {
      {"2x2x1", "TPU-V4", 1, {"0", "1", "2", "3"}, "1,1,1"},
      {"2x2x1", "TPU-V4", 2, {"0,1", "2,3"}, "1,2,1"},
      {"2x4", "TPU-V6E", 4, {"0,1,2,3", "4,5,6,7"}, "2,2,1"},
      {"2x4", "TPU-V6E", 2, {"0,1", "2,3", "4,5", "6,7"}, "1,2,1"},
  };
  for (const auto& c : kCases) {
    const auto config =
        Make(Tpu(static_cast<int>(c.visible.size()), c.topology, c.type, c.chips_per_worker));
    auto plan =
        PlanOnHosts(config, SimulatedHosts(config), {{"TPU_VISIBLE_CHIPS", "stale"}}, false);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    ASSERT_EQ(plan->workers.size(), c.visible.size());
    for (size_t r = 0; r < c.visible.size(); ++r) {
      const auto& w = plan->workers[r];
      EXPECT_EQ(Env(w, "TPU_VISIBLE_CHIPS"), c.visible[r]) << c.topology;
      EXPECT_EQ(Env(w, "TPU_CHIPS_PER_HOST_BOUNDS"), c.bounds) << c.topology;
      EXPECT_EQ(Env(w, "TPU_HOST_BOUNDS"), "1,1,1");
      EXPECT_EQ(Env(w, "TPU_WORKER_ID"), "0");
      EXPECT_EQ(Env(w, "TPU_WORKER_HOSTNAMES"), "sim-slice-0-host-0");
      EXPECT_EQ(w.local_rank, static_cast<int>(r));
      EXPECT_EQ(w.local_world_size, static_cast<int>(c.visible.size()));
      EXPECT_EQ(w.node_rank, 0);
    }
  }
}

TEST(PlanOnHostsTest, StrictStrategiesThatASliceContradictsAreRefused) {
  auto in = Tpu(4, "2x2x4", "TPU-V4");
  in.placement_strategy = "STRICT_PACK";
  const auto pack = Make(in);
  auto plan = PlanOnHosts(pack, SimulatedHosts(pack), {}, false);
  ASSERT_FALSE(plan.ok());
  EXPECT_TRUE(HasSubstr(plan.status().message(), "slice(s) span 4 hosts"));

  in = Tpu(4, "2x2x1", "TPU-V4", 1);
  in.placement_strategy = "STRICT_SPREAD";
  const auto spread = Make(in);
  plan = PlanOnHosts(spread, SimulatedHosts(spread), {}, false);
  ASSERT_FALSE(plan.ok());
  EXPECT_TRUE(HasSubstr(plan.status().message(), "puts 4 workers on host"));

  in = Tpu(4, "2x2x4", "TPU-V4");
  in.placement_strategy = "STRICT_SPREAD";
  const auto whole_hosts = Make(in);
  EXPECT_TRUE(PlanOnHosts(whole_hosts, SimulatedHosts(whole_hosts), {}, false).ok());
}

TEST(PlanOnHostsTest, DescribedCpusLimitWorkersPerTpuHost) {
  std::vector<Host> slice = SliceHosts("s", "", "", 4, {0});
  slice[0].cpus = 2;
  auto plan = PlanOnHosts(Make(Tpu(4, "2x2x1", "TPU-V4", 1)), Describe({slice}), {}, false);
  ASSERT_FALSE(plan.ok());
  EXPECT_TRUE(HasSubstr(plan.status().message(), "host \"s-0\" has 2 CPUs, too few for 4 workers"));
}

TEST(PlanOnHostsTest, StaleTpuVariablesAreListedForRemoval) {
  const auto config = Make(Tpu(2, "2x2x2", "TPU-V4"));
  auto plan = PlanOnHosts(config, SimulatedHosts(config), {}, false);
  ASSERT_TRUE(plan.ok());
  for (const auto& w : plan->workers) {
    EXPECT_EQ(w.unset_env, (Strings{"TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_HOST_BOUNDS",
                                    "TPU_HOST_BOUNDS", "MEGASCALE_COORDINATOR_ADDRESS",
                                    "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID"}));
  }
}

TEST(PlanOnHostsTest, TpuWithoutTopologyTakesChipsOfAHostOfTheRightGeneration) {
  config::ScalingConfigInput in;
  in.use_tpu = true;
  in.accelerator_type = "TPU-V6E";
  in.resources_per_worker = {{"TPU", 4}};
  std::vector<Host> v5p = SliceHosts("p", "v5p-8", "2x2x1", 4, {0});
  std::vector<Host> v6e = SliceHosts("e", "v6e-8", "2x4", 8, {0});
  auto plan = PlanOnHosts(Make(in), Describe({v5p, v6e}), {}, false);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  const auto& w = plan->workers[0];
  EXPECT_EQ(w.host, "e-0");
  EXPECT_EQ(w.devices, (Strings{"0", "1", "2", "3"}));
  EXPECT_EQ(Env(w, "TPU_CHIPS_PER_HOST_BOUNDS"), "2,2,1");
  EXPECT_EQ(Env(w, "TPU_ACCELERATOR_TYPE"), "v6e-8");
  EXPECT_EQ(plan->num_slices, 1);

  in.resources_per_worker.clear();  // a whole host
  auto whole = PlanOnHosts(Make(in), Describe({v5p, v6e}), {}, false);
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  EXPECT_EQ(whole->workers[0].devices, (Strings{"0", "1", "2", "3", "4", "5", "6", "7"}));
  EXPECT_EQ(Env(whole->workers[0], "TPU_VISIBLE_CHIPS"), "<unset>");

  in.resources_per_worker = {{"TPU", 0.5}};
  auto fractional = PlanOnHosts(Make(in), Describe({v6e}), {}, false);
  ASSERT_FALSE(fractional.ok());
  EXPECT_EQ(fractional.status().code(), StatusCode::kInvalidArgument);
}

// --- PlanOnHosts: GPU and CPU workers ---

TEST(PlanOnHostsTest, GpuWorkersFollowThePlacementStrategy) {
  const HostDescription hosts{.source = "test hosts",
                              .hosts = {GpuHost("g0", 4), GpuHost("g1", 4), GpuHost("g2", 2)}};
  const struct {
    std::string strategy;
    int workers;
    int gpus;
    Strings hosts;    // of each rank
    Strings devices;  // CUDA_VISIBLE_DEVICES of each rank
  } kCases[] = {
      {"PACK", 3, 2, {"g0", "g0", "g1"}, {"0,1", "2,3", "0,1"}},
      {"SPREAD", 3, 2, {"g0", "g1", "g2"}, {"0,1", "0,1", "0,1"}},
      {"SPREAD", 4, 2, {"g0", "g0", "g1", "g2"}, {"0,1", "2,3", "0,1", "0,1"}},
      {"STRICT_PACK", 2, 2, {"g0", "g0"}, {"0,1", "2,3"}},
      {"STRICT_PACK", 4, 1, {"g0", "g0", "g0", "g0"}, {"0", "1", "2", "3"}},
      {"STRICT_SPREAD", 3, 1, {"g0", "g1", "g2"}, {"0", "0", "0"}},
      {"STRICT_SPREAD", 2, 4, {"g0", "g1"}, {"0,1,2,3", "0,1,2,3"}},
  };
  for (const auto& c : kCases) {
    const std::string what = c.strategy + " " + std::to_string(c.workers);
    auto plan = PlanOnHosts(Make(Gpu(c.workers, c.gpus, c.strategy)), hosts, {}, false);
    ASSERT_TRUE(plan.ok()) << what << ": " << plan.status().ToString();
    Strings placed, devices;
    for (const auto& w : plan->workers) {
      placed.push_back(w.host);
      devices.push_back(Env(w, "CUDA_VISIBLE_DEVICES"));
    }
    EXPECT_EQ(placed, c.hosts) << what;
    EXPECT_EQ(devices, c.devices) << what;
  }
}

TEST(PlanOnHostsTest, GpuStrategiesTheHostsCannotMeetAreRefused) {
  const HostDescription hosts{.source = "test hosts",
                              .hosts = {GpuHost("g0", 4), GpuHost("g1", 2), GpuHost("cpu", 0)}};
  const struct {
    std::string strategy;
    int workers;
    int gpus;
    std::string part;
  } kCases[] = {
      {"PACK", 4, 2, "they have room for 3 on test hosts"},
      {"SPREAD", 7, 1, "they have room for 6"},
      {"STRICT_PACK", 3, 2, "no host can take all 3"},
      {"STRICT_SPREAD", 3, 1, "2 host(s) can take a worker, and STRICT_SPREAD needs 3"},
  };
  for (const auto& c : kCases) {
    auto plan = PlanOnHosts(Make(Gpu(c.workers, c.gpus, c.strategy)), hosts, {}, false);
    ASSERT_FALSE(plan.ok()) << c.strategy;
    EXPECT_EQ(plan.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_TRUE(HasSubstr(plan.status().message(), c.part));
    EXPECT_TRUE(HasSubstr(plan.status().message(), "\"g1\": 2 GPUs (0,1) -> room for"));
  }
}

TEST(PlanOnHostsTest, GpuNodeAndLocalRanksFollowTheHosts) {
  const HostDescription hosts{.source = "test hosts",
                              .hosts = {GpuHost("g0", 2), GpuHost("g1", 2)}};
  auto plan = PlanOnHosts(Make(Gpu(4, 1)), hosts, {}, false);
  ASSERT_TRUE(plan.ok());
  const int expected[][3] = {{0, 0, 2}, {0, 1, 2}, {1, 0, 2}, {1, 1, 2}};
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(plan->workers[r].node_rank, expected[r][0]);
    EXPECT_EQ(plan->workers[r].local_rank, expected[r][1]);
    EXPECT_EQ(plan->workers[r].local_world_size, expected[r][2]);
  }
}

TEST(PlanOnHostsTest, SimulatedGpuWorkersRunOnCpuButKeepTheirDevices) {
  const HostDescription hosts{.source = "test hosts", .hosts = {GpuHost("g0", 4)}};
  auto plan = PlanOnHosts(Make(Gpu(2, 2)), hosts, {{"JAX_PLATFORMS", "cuda"}}, true);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->platform, "cpu");
  EXPECT_EQ(plan->accelerator, "gpu");
  EXPECT_EQ(Env(plan->workers[1], "JAX_PLATFORMS"), "cpu");
  EXPECT_EQ(Env(plan->workers[1], "CUDA_VISIBLE_DEVICES"), "2,3");
  EXPECT_EQ(Env(plan->workers[1], "JAX_CPU_COLLECTIVES_IMPLEMENTATION"), "gloo");
}

TEST(PlanOnHostsTest, AUsersJaxPlatformsIsKeptOnRealHardware) {
  const HostDescription hosts{.source = "test hosts", .hosts = {GpuHost("g0", 1)}};
  auto plan = PlanOnHosts(Make(Gpu(1, 1)), hosts, {{"JAX_PLATFORMS", "cuda,cpu"}}, false);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(Env(plan->workers[0], "JAX_PLATFORMS"), "<unset>");
}

TEST(PlanOnHostsTest, FractionalGpusAreRefused) {
  const HostDescription hosts{.source = "test hosts", .hosts = {GpuHost("g0", 4)}};
  auto plan = PlanOnHosts(Make(Gpu(2, 0.5)), hosts, {}, false);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(HasSubstr(plan.status().message(), "resources_per_worker['GPU']=0.5"));
}

TEST(PlanOnHostsTest, CpuWorkersAreLimitedByDescribedCpus) {
  const HostDescription hosts{.source = "test hosts",
                              .hosts = {GpuHost("c0", 0, 2), GpuHost("c1", 0, 3)}};
  config::ScalingConfigInput in;
  in.num_workers = 5;
  auto plan = PlanOnHosts(Make(in), hosts, {}, false);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->workers[1].host, "c0");
  EXPECT_EQ(plan->workers[2].host, "c1");
  EXPECT_EQ(plan->workers[4].node_rank, 1);
  in.num_workers = 6;
  auto refused = PlanOnHosts(Make(in), hosts, {}, false);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(HasSubstr(refused.status().message(), "\"c1\": 3 CPUs -> room for 3"));
}

}  // namespace
}  // namespace jaxtrain::placement
