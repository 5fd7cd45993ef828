#include "config/scaling_config.h"

#include <gtest/gtest.h>

namespace jaxtrain::config {
namespace {

ScalingConfigInput Tpu(int workers, std::string type, std::string topology) {
  ScalingConfigInput in;
  in.num_workers = workers;
  in.use_tpu = true;
  in.accelerator_type = std::move(type);
  in.topology = std::move(topology);
  return in;
}

void ExpectInvalid(const ScalingConfigInput& in, const std::vector<std::string>& fragments) {
  auto c = ScalingConfig::Create(in);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  for (const auto& f : fragments) {
    EXPECT_NE(c.status().message().find(f), std::string::npos)
        << "missing '" << f << "' in: " << c.status().message();
  }
}

TEST(ScalingConfigTest, DefaultsToOneCpuWorker) {
  auto c = ScalingConfig::Create({});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->num_workers(), 1);
  EXPECT_EQ(c->placement_strategy(), PlacementStrategy::kPack);
  EXPECT_EQ(c->resources_per_worker().at("CPU"), 1);
  EXPECT_FALSE(c->tpu_slice().has_value());
}

TEST(ScalingConfigTest, SeedTpuConfigIsOneV6eSliceOfFourHosts) {
  auto in = Tpu(4, "TPU-V6E", "4x4");
  in.placement_strategy = "SPREAD";
  auto c = ScalingConfig::Create(in);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->tpu_slice()->pod_type, "v6e-16");
  EXPECT_EQ(c->tpu_slice()->hosts, 4);
  EXPECT_EQ(c->resources_per_worker().at("TPU"), 4);
  EXPECT_EQ(c->workers_per_slice(), 4);
  EXPECT_EQ(c->num_slices(), 1);
  EXPECT_EQ(c->placement_strategy(), PlacementStrategy::kSpread);
}

TEST(ScalingConfigTest, TwoV4SlicesOfTwoHosts) {
  auto c = ScalingConfig::Create(Tpu(4, "TPU-V4", "2x2x2"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->workers_per_slice(), 2);
  EXPECT_EQ(c->num_slices(), 2);
}

TEST(ScalingConfigTest, OneChipPerWorkerPutsFourWorkersOnAHost) {
  auto in = Tpu(4, "TPU-V4", "2x2x1");
  in.resources_per_worker = {{"TPU", 1}};
  auto c = ScalingConfig::Create(in);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->workers_per_slice(), 4);
  EXPECT_EQ(c->resources_per_worker().at("TPU"), 1);
}

TEST(ScalingConfigTest, UnevenWorkerCountMustBeAMultipleOfASlice) {
  ExpectInvalid(Tpu(3, "TPU-V4", "2x2x2"),
                {"ScalingConfig.num_workers=3", "must be a multiple of 2", "v4-16"});
  auto in = Tpu(6, "TPU-V4", "2x2x1");
  in.resources_per_worker = {{"TPU", 1}};
  ExpectInvalid(in, {"num_workers=6", "must be a multiple of 4"});
}

TEST(ScalingConfigTest, MultiHostTpuNeedsTopologyAndAcceleratorType) {
  ScalingConfigInput in;
  in.num_workers = 4;
  in.use_tpu = true;
  ExpectInvalid(in, {"use_tpu=True, num_workers=4", "missing: topology, accelerator_type"});
  in.accelerator_type = "TPU-V6E";
  ExpectInvalid(in, {"missing: topology"});
}

TEST(ScalingConfigTest, SingleHostTpuNeedsNoTopology) {
  ScalingConfigInput in;
  in.use_tpu = true;
  in.resources_per_worker = {{"TPU", 8}};
  in.accelerator_type = "TPU-V6E";
  EXPECT_TRUE(ScalingConfig::Create(in).ok());
}

TEST(ScalingConfigTest, BadTopologyListsTheValidOnes) {
  ExpectInvalid(Tpu(4, "TPU-V6E", "3x3"), {"topology='3x3'", "v6e", "1x1, 2x2, 2x4"});
}

TEST(ScalingConfigTest, UnknownGenerationIsNamed) {
  ExpectInvalid(Tpu(4, "TPU-V9", "4x4"), {"accelerator_type='TPU-V9'", "TPU-V6E"});
}

TEST(ScalingConfigTest, AcceleratorTypeNeedsGpuOrTpu) {
  ScalingConfigInput in;
  in.num_workers = 2;
  in.accelerator_type = "H100";
  ExpectInvalid(in, {"ScalingConfig.accelerator_type='H100'", "use_gpu=True", "use_tpu=True",
                     "remove accelerator_type"});
  in.use_gpu = true;
  EXPECT_TRUE(ScalingConfig::Create(in).ok());
}

TEST(ScalingConfigTest, TpuAndGpuAreExclusive) {
  ScalingConfigInput in;
  in.use_tpu = true;
  in.use_gpu = true;
  ExpectInvalid(in, {"use_tpu=True and use_gpu=True"});
}

TEST(ScalingConfigTest, NumWorkersMustBePositive) {
  ScalingConfigInput in;
  in.num_workers = 0;
  ExpectInvalid(in, {"ScalingConfig.num_workers=0", ">= 1"});
}

TEST(ScalingConfigTest, NumWorkersHasAnUpperBound) {
  ScalingConfigInput in;
  in.num_workers = 1'000'000'000;
  ExpectInvalid(in, {"ScalingConfig.num_workers=1000000000", "at most 100000"});
  in.num_workers = kMaxWorkers;
  EXPECT_TRUE(ScalingConfig::Create(in).ok());
}

TEST(ScalingConfigTest, ALocalRunIsBoundedByTheMachinesCpus) {
  auto fits = ScalingConfig::Create({.num_workers = 64});
  ASSERT_TRUE(fits.ok());
  EXPECT_TRUE(CheckLocalWorkerCount(*fits, 2).ok());  // the floor: 64 whatever the CPUs
  auto big = ScalingConfig::Create({.num_workers = 129});
  ASSERT_TRUE(big.ok());
  EXPECT_TRUE(CheckLocalWorkerCount(*big, 17).ok());  // 8 per CPU
  Status s = CheckLocalWorkerCount(*big, 16);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  for (const char* part : {"ScalingConfig.num_workers=129", "at most 128", "16 CPUs"}) {
    EXPECT_NE(s.message().find(part), std::string::npos)
        << "missing '" << part << "' in " << s.message();
  }
}

TEST(ScalingConfigTest, PlacementStrategyMustBeKnown) {
  ScalingConfigInput in;
  in.placement_strategy = "RANDOM";
  ExpectInvalid(in, {"placement_strategy='RANDOM'", "PACK, SPREAD, STRICT_PACK, STRICT_SPREAD"});
}

TEST(ScalingConfigTest, ResourcesMustBeNonNegative) {
  ScalingConfigInput in;
  in.resources_per_worker = {{"CPU", -1}};
  ExpectInvalid(in, {"resources_per_worker['CPU']=-1", ">= 0"});
}

TEST(ScalingConfigTest, TpuResourceNeedsUseTpu) {
  ScalingConfigInput in;
  in.resources_per_worker = {{"TPU", 4}};
  ExpectInvalid(in, {"resources_per_worker['TPU']=4", "use_tpu=True"});
}

TEST(ScalingConfigTest, ZeroTpuChipsWithUseTpuIsRefused) {
  ScalingConfigInput in;
  in.use_tpu = true;
  in.resources_per_worker = {{"TPU", 0}};
  ExpectInvalid(in, {"resources_per_worker['TPU']=0"});
}

TEST(ScalingConfigTest, GpuResourceNeedsUseGpu) {
  ScalingConfigInput in;
  in.resources_per_worker = {{"GPU", 2}};
  ExpectInvalid(in, {"resources_per_worker['GPU']=2", "use_gpu=True"});
}

TEST(ScalingConfigTest, TopologyNeedsUseTpu) {
  ScalingConfigInput in;
  in.topology = "4x4";
  ExpectInvalid(in, {"topology='4x4'", "use_tpu=True"});
}

TEST(ScalingConfigTest, TpuPerWorkerMustDivideAHost) {
  auto in = Tpu(4, "TPU-V4", "2x2x2");
  in.resources_per_worker = {{"TPU", 3}};
  ExpectInvalid(in, {"resources_per_worker['TPU']=3", "divides 4"});
}

TEST(ScalingConfigTest, GpuDefaultsToOneGpuPerWorker) {
  ScalingConfigInput in;
  in.num_workers = 2;
  in.use_gpu = true;
  auto c = ScalingConfig::Create(in);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->resources_per_worker().at("GPU"), 1);
}

TEST(ScalingConfigTest, APlainCountIsAFixedSizeRun) {
  ScalingConfigInput in;
  in.num_workers = 4;
  auto c = ScalingConfig::Create(in);
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->elastic());
  EXPECT_EQ(c->min_workers(), 4);
  EXPECT_EQ(c->num_workers(), 4);
}

TEST(ScalingConfigTest, ElasticRangeKeepsMinAndMax) {
  ScalingConfigInput in;
  in.num_workers = 4;
  in.min_workers = 2;
  in.elastic_resize_monitor_interval_s = 5;
  auto c = ScalingConfig::Create(in);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->elastic());
  EXPECT_EQ(c->min_workers(), 2);
  EXPECT_EQ(c->num_workers(), 4);
  EXPECT_EQ(c->resize_monitor_interval_s(), 5);
  auto fixed = c->WithWorkers(2);
  ASSERT_TRUE(fixed.ok());
  EXPECT_FALSE(fixed->elastic());
  EXPECT_EQ(fixed->num_workers(), 2);
}

TEST(ScalingConfigTest, ElasticMinMustBeAtLeastOneAndAtMostMax) {
  ScalingConfigInput in;
  in.num_workers = 4;
  in.min_workers = 0;
  ExpectInvalid(in, {"ScalingConfig.num_workers=(0, 4)", "1 <= min <= max"});
  in.min_workers = 5;
  ExpectInvalid(in, {"ScalingConfig.num_workers=(5, 4)", "1 <= min <= max"});
}

TEST(ScalingConfigTest, ResizeMonitorIntervalMustBePositive) {
  ScalingConfigInput in;
  in.num_workers = 4;
  in.min_workers = 2;
  in.elastic_resize_monitor_interval_s = 0;
  ExpectInvalid(in, {"elastic_resize_monitor_interval_s=0", "> 0"});
  in.elastic_resize_monitor_interval_s = -1;
  ExpectInvalid(in, {"elastic_resize_monitor_interval_s=-1", "> 0"});
}

TEST(ScalingConfigTest, ElasticTpuResizesByWholeSlices) {
  auto in = Tpu(4, "TPU-V4", "2x2x2");  // 2 hosts a slice, one worker each
  in.min_workers = 2;
  auto c = ScalingConfig::Create(in);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->min_workers(), 2);
  in.min_workers = 3;
  ExpectInvalid(in, {"ScalingConfig.num_workers=(3, 4)", "min=3", "multiple of 2", "whole slices"});
  in = Tpu(5, "TPU-V4", "2x2x2");
  in.min_workers = 2;
  ExpectInvalid(in, {"ScalingConfig.num_workers=(2, 5)", "max=5", "multiple of 2"});
}

}  // namespace
}  // namespace jaxtrain::config
