#include "placement/plan.h"

#include <gtest/gtest.h>

namespace jaxtrain::placement {
namespace {

config::ScalingConfig Make(config::ScalingConfigInput in) {
  auto c = config::ScalingConfig::Create(std::move(in));
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return *c;
}

config::ScalingConfigInput SeedTpu() {
  config::ScalingConfigInput in;
  in.num_workers = 4;
  in.use_tpu = true;
  in.topology = "4x4";
  in.accelerator_type = "TPU-V6E";
  return in;
}

TEST(PlanLocalTest, CpuWorkersGetOneCpuDeviceAndGloo) {
  config::ScalingConfigInput in;
  in.num_workers = 4;
  accelerators::FakeHost host;
  auto plan = PlanLocal(Make(in), host);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->platform, "cpu");
  ASSERT_EQ(plan->workers.size(), 4u);
  for (int r = 0; r < 4; ++r) {
    const auto& w = plan->workers[r];
    EXPECT_EQ(w.rank, r);
    EXPECT_EQ(w.local_rank, r);
    EXPECT_EQ(w.local_world_size, 4);
    EXPECT_EQ(w.env.at("JAX_PLATFORMS"), "cpu");
    EXPECT_EQ(w.env.at("JAX_NUM_CPU_DEVICES"), "1");
    EXPECT_EQ(w.env.at("JAX_CPU_COLLECTIVES_IMPLEMENTATION"), "gloo");
  }
}

TEST(PlanLocalTest, UserSettingsAreKept) {
  accelerators::FakeHost host;
  host.env["JAX_NUM_CPU_DEVICES"] = "2";
  auto plan = PlanLocal(Make({}), host);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->workers[0].env.count("JAX_NUM_CPU_DEVICES"), 0u);
}

TEST(PlanLocalTest, TpuWithoutChipsNamesTheSimulateSwitch) {
  accelerators::FakeHost host;
  auto plan = PlanLocal(Make(SeedTpu()), host);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(plan.status().message().find("JAXTRAIN_SIMULATE=1"), std::string::npos);
  EXPECT_NE(plan.status().message().find("use_tpu=True"), std::string::npos);
}

TEST(PlanLocalTest, SimulatedTpuRunsOnCpuWithTheSameWorldSize) {
  accelerators::FakeHost host;
  host.env["JAXTRAIN_SIMULATE"] = "1";
  host.env["JAX_PLATFORMS"] = "tpu";
  auto plan = PlanLocal(Make(SeedTpu()), host);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_TRUE(plan->simulated);
  EXPECT_EQ(plan->platform, "cpu");
  ASSERT_EQ(plan->workers.size(), 4u);
  EXPECT_EQ(plan->workers[3].env.at("JAX_PLATFORMS"), "cpu");
}

TEST(PlanLocalTest, GpuWithoutDevicesNamesTheSimulateSwitch) {
  config::ScalingConfigInput in;
  in.use_gpu = true;
  accelerators::FakeHost host;
  auto plan = PlanLocal(Make(in), host);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(plan.status().message().find("JAXTRAIN_SIMULATE=1"), std::string::npos);
}

TEST(PlanLocalTest, GpusAreMappedThroughTheInheritedVisibleDevices) {
  config::ScalingConfigInput in;
  in.num_workers = 2;
  in.use_gpu = true;
  in.resources_per_worker = {{"GPU", 2}};
  accelerators::FakeHost host;
  host.char_devices = {"/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2", "/dev/nvidia3"};
  host.env["CUDA_VISIBLE_DEVICES"] = "3,1,2,0";
  auto plan = PlanLocal(Make(in), host);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->platform, "cuda");
  EXPECT_EQ(plan->workers[0].env.at("CUDA_VISIBLE_DEVICES"), "3,1");
  EXPECT_EQ(plan->workers[1].env.at("CUDA_VISIBLE_DEVICES"), "2,0");
}

TEST(PlanLocalTest, TooFewGpusIsRefusedWhole) {
  config::ScalingConfigInput in;
  in.num_workers = 3;
  in.use_gpu = true;
  accelerators::FakeHost host;
  host.char_devices = {"/dev/nvidia0", "/dev/nvidia1"};
  auto plan = PlanLocal(Make(in), host);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("3 workers x 1 GPUs, but 2 are visible"),
            std::string::npos);
}

}  // namespace
}  // namespace jaxtrain::placement
