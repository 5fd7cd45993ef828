#include "placement/elastic.h"

#include <gtest/gtest.h>

namespace jaxtrain::placement {
namespace {

config::ScalingConfig Make(config::ScalingConfigInput in) {
  auto c = config::ScalingConfig::Create(std::move(in));
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return *c;
}

config::ScalingConfigInput Cpu(int min, int max) {
  config::ScalingConfigInput in;
  in.num_workers = max;
  in.min_workers = min;
  return in;
}

// Hosts of `slots` CPU workers each, as the ssh launcher describes listed hosts.
HostDescription Hosts(std::vector<std::string> names, int slots) {
  HostDescription d{.source = "JAXTRAIN_SSH_HOSTS"};
  for (auto& n : names) d.hosts.push_back({.name = n, .address = n, .cpus = slots});
  return d;
}

std::string Env(const WorkerPlacement& w, const std::string& name) {
  auto it = w.env.find(name);
  return it == w.env.end() ? "<unset>" : it->second;
}

bool Unsets(const WorkerPlacement& w, const std::string& name) {
  return std::find(w.unset_env.begin(), w.unset_env.end(), name) != w.unset_env.end();
}

TEST(ElasticTest, AHostLostLeavesTheOtherHostsWholeWorkers) {
  auto full = PlanOnHosts(Make(Cpu(2, 4)), Hosts({"host1", "host2"}, 2), {}, false);
  ASSERT_TRUE(full.ok()) << full.status().ToString();
  auto choice = ChooseHosts(*full, {"host2"}, 2);
  ASSERT_TRUE(choice.ok()) << choice.status().ToString();
  EXPECT_EQ(choice->hosts, std::vector<std::string>{"host1"});
  EXPECT_EQ(choice->left_out, std::vector<std::string>{"host2"});
  EXPECT_EQ(choice->workers, 2);
}

TEST(ElasticTest, EveryHostReachableKeepsTheFullPlan) {
  auto full = PlanOnHosts(Make(Cpu(2, 4)), Hosts({"host1", "host2"}, 2), {}, false);
  ASSERT_TRUE(full.ok());
  auto choice = ChooseHosts(*full, {}, 2);
  ASSERT_TRUE(choice.ok());
  EXPECT_EQ(choice->hosts, (std::vector<std::string>{"host1", "host2"}));
  EXPECT_TRUE(choice->left_out.empty());
  EXPECT_EQ(choice->workers, 4);
}

TEST(ElasticTest, FewerThanMinWorkersLeftIsUnavailableNamingTheHosts) {
  auto full = PlanOnHosts(Make(Cpu(4, 6)), Hosts({"host1", "host2", "host3"}, 2), {}, false);
  ASSERT_TRUE(full.ok());
  auto choice = ChooseHosts(*full, {"host1", "host3"}, 4);
  ASSERT_FALSE(choice.ok());
  EXPECT_EQ(choice.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(choice.status().message().find("host host1, host3 cannot be reached"),
            std::string::npos)
      << choice.status().message();
  EXPECT_NE(choice.status().message().find("hold 2 worker(s), fewer than the min"),
            std::string::npos);
  EXPECT_EQ(ChooseHosts(*full, {"host1", "host2", "host3"}, 1).status().code(),
            StatusCode::kUnavailable);
}

TEST(ElasticTest, TheSmallerPlanNumbersRanksAndEnvironmentsAnew) {
  const config::ScalingConfig config = Make(Cpu(2, 4));
  const HostDescription hosts = Hosts({"host1", "host2"}, 2);
  auto full = PlanOnHosts(config, hosts, {}, false);
  ASSERT_TRUE(full.ok());
  auto choice = ChooseHosts(*full, {"host1"}, 2);  // the first host lost: host2 takes rank 0
  ASSERT_TRUE(choice.ok());
  auto smaller =
      PlanOnHosts(*config.WithWorkers(choice->workers),
                  OnlyHosts(hosts, {choice->hosts.begin(), choice->hosts.end()}), {}, false);
  ASSERT_TRUE(smaller.ok()) << smaller.status().ToString();
  ASSERT_EQ(smaller->workers.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    const WorkerPlacement& w = smaller->workers[static_cast<size_t>(r)];
    EXPECT_EQ(w.rank, r);
    EXPECT_EQ(w.host, "host2");
    EXPECT_EQ(w.node_rank, 0);
    EXPECT_EQ(w.local_rank, r);
    EXPECT_EQ(w.local_world_size, 2);
  }
}

TEST(ElasticTest, RangeMustBeWholeHostsWhenHostsTakeEqualWorkers) {
  auto config = Make(Cpu(3, 4));
  auto full = PlanOnHosts(config, Hosts({"host1", "host2"}, 2), {}, false);
  ASSERT_TRUE(full.ok());
  Status s = CheckElasticHosts(config, *full);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("ScalingConfig.num_workers=(3, 4)"), std::string::npos);
  EXPECT_NE(s.message().find("each host takes 2 worker(s)"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("multiples of 2"), std::string::npos);
  auto fine = Make(Cpu(2, 4));
  EXPECT_TRUE(
      CheckElasticHosts(fine, *PlanOnHosts(fine, Hosts({"host1", "host2"}, 2), {}, false)).ok());
}

config::ScalingConfigInput TwoV4Slices(int min) {
  config::ScalingConfigInput in;
  in.num_workers = 4;  // 2 slices of 2 hosts, one worker per host
  in.min_workers = min;
  in.use_tpu = true;
  in.topology = "2x2x2";
  in.accelerator_type = "TPU-V4";
  return in;
}

TEST(ElasticTest, ATpuRunShrinksByAWholeSliceWithMegascaleRecomputed) {
  const config::ScalingConfig config = Make(TwoV4Slices(2));
  const HostDescription hosts = SimulatedHosts(config);
  auto full = PlanOnHosts(config, hosts, {}, /*simulate=*/true);
  ASSERT_TRUE(full.ok()) << full.status().ToString();
  ASSERT_EQ(full->num_slices, 2);
  EXPECT_EQ(Env(full->workers[3], "MEGASCALE_NUM_SLICES"), "2");
  EXPECT_EQ(Env(full->workers[3], "MEGASCALE_SLICE_ID"), "1");

  // One host of slice 0 lost: the whole of slice 0 goes; slice 1 holds ranks 0 and 1.
  const std::string lost = full->workers[0].host;
  auto choice = ChooseHosts(*full, {lost}, 2);
  ASSERT_TRUE(choice.ok()) << choice.status().ToString();
  EXPECT_EQ(choice->workers, 2);
  EXPECT_EQ(choice->hosts,
            (std::vector<std::string>{full->workers[2].host, full->workers[3].host}));
  EXPECT_EQ(choice->left_out.size(), 2u);
  auto smaller =
      PlanOnHosts(*config.WithWorkers(choice->workers),
                  OnlyHosts(hosts, {choice->hosts.begin(), choice->hosts.end()}), {}, true);
  ASSERT_TRUE(smaller.ok()) << smaller.status().ToString();
  EXPECT_EQ(smaller->num_slices, 1);
  ASSERT_EQ(smaller->workers.size(), 2u);
  EXPECT_EQ(smaller->workers[0].host, full->workers[2].host);
  // One slice: no multi-slice variables, and the stale ones are unset, never kept.
  EXPECT_EQ(Env(smaller->workers[1], "MEGASCALE_NUM_SLICES"), "<unset>");
  EXPECT_TRUE(Unsets(smaller->workers[1], "MEGASCALE_NUM_SLICES"));
  EXPECT_TRUE(Unsets(smaller->workers[1], "MEGASCALE_SLICE_ID"));
  EXPECT_EQ(Env(smaller->workers[1], "TPU_WORKER_ID"), "1");

  // A slice's hosts lost together leave fewer than min=4: unavailable.
  auto strict = Make(TwoV4Slices(4));
  EXPECT_EQ(ChooseHosts(*full, {lost}, strict.min_workers()).status().code(),
            StatusCode::kUnavailable);
}

TEST(ElasticTest, OnlyHostsDropsASliceWithAHostLeftOut) {
  HostDescription d{.source = "x"};
  d.hosts.push_back({.name = "a0", .tpu_slice = "a"});
  d.hosts.push_back({.name = "a1", .tpu_slice = "a", .tpu_worker_id = 1});
  d.hosts.push_back({.name = "b0", .tpu_slice = "b"});
  d.hosts.push_back({.name = "c"});
  HostDescription kept = OnlyHosts(d, {"a0", "b0", "c"});
  ASSERT_EQ(kept.hosts.size(), 2u);
  EXPECT_EQ(kept.hosts[0].name, "b0");
  EXPECT_EQ(kept.hosts[1].name, "c");
}

TEST(ElasticTest, PlanPerHostPutsRankBlocksOnTheHostsOfAnEngine) {
  Plan uniform{.platform = "cpu"};
  for (int r = 0; r < 4; ++r) uniform.workers.push_back({.rank = r, .env = {{"A", "1"}}});
  auto shrunk = PlanPerHost(uniform, {"node1"}, 2, 2, "Slurm job 7's nodes node1,node2");
  ASSERT_TRUE(shrunk.ok()) << shrunk.status().ToString();
  ASSERT_EQ(shrunk->workers.size(), 2u);
  for (const WorkerPlacement& w : shrunk->workers) {
    EXPECT_EQ(w.host, "node1");
    EXPECT_EQ(w.local_rank, w.rank);
    EXPECT_EQ(w.local_world_size, 2);
    EXPECT_EQ(w.node_rank, 0);
    EXPECT_EQ(w.env.at("A"), "1");
  }
  EXPECT_EQ(ResizeUnits(*shrunk).size(), 1u);
  EXPECT_EQ(PlanPerHost(uniform, {"node1", "node2"}, 2, 3, "x").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanPerHost(uniform, {"n1", "n2", "n3"}, 2, 6, "x").status().code(),
            StatusCode::kInvalidArgument)
      << "more ranks than the plan has";
}

}  // namespace
}  // namespace jaxtrain::placement
