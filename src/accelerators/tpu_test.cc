#include "accelerators/tpu.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

namespace jaxtrain::accelerators {
namespace {

::testing::AssertionResult HasSubstr(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << text << "' does not contain '" << part << "'";
}

int Chips(const std::string& topology) {
  int chips = 1;
  size_t start = 0;
  while (start < topology.size()) {
    size_t end = topology.find('x', start);
    if (end == std::string::npos) end = topology.size();
    chips *= std::stoi(topology.substr(start, end - start));
    start = end + 1;
  }
  return chips;
}

TEST(TpuGenerationTest, ListsEveryGenerationWithItsCanonicalName) {
  std::vector<std::string> names;
  for (TpuGeneration generation : AllGenerations()) {
    names.emplace_back(GenerationName(generation));
  }
  EXPECT_EQ(names, (std::vector<std::string>{"v2", "v3", "v4", "v5p", "v5litepod", "v6e", "v7x"}));
}

TEST(TpuGenerationTest, V5eAndV6eHaveOneCorePerChipOthersTwo) {
  const struct {
    TpuGeneration generation;
    int cores;
  } kCases[] = {
      {TpuGeneration::kV2, 2},  {TpuGeneration::kV3, 2},  {TpuGeneration::kV4, 2},
      {TpuGeneration::kV5p, 2}, {TpuGeneration::kV5e, 1}, {TpuGeneration::kV6e, 1},
      {TpuGeneration::kV7x, 2},
  };
  for (const auto& c : kCases) {
    EXPECT_EQ(CoresPerChip(c.generation), c.cores) << GenerationName(c.generation);
  }
}

TEST(TpuTopologyTest, TablesHoldRaysTopologies) {
  const struct {
    TpuGeneration generation;
    size_t count;
    std::string first;
    std::string last;
  } kCases[] = {
      {TpuGeneration::kV2, 5, "4x4", "16x16"},
      {TpuGeneration::kV3, 7, "4x4", "32x32"},
      // 4 small shapes + {4,8,12} x {4,8,12} x {4,8,12,16}.
      {TpuGeneration::kV4, 40, "2x2x1", "12x12x16"},
      // 4 small shapes + {4..16} x {4..16} x {4..24}.
      {TpuGeneration::kV5p, 100, "2x2x1", "16x16x24"},
      {TpuGeneration::kV5e, 9, "1x1", "16x16"},
      {TpuGeneration::kV6e, 9, "1x1", "16x16"},
      {TpuGeneration::kV7x, 10, "2x2x1", "8x16x16"},
  };
  for (const auto& c : kCases) {
    SCOPED_TRACE(GenerationName(c.generation));
    const std::vector<std::string>& topologies = ValidTopologies(c.generation);
    ASSERT_EQ(topologies.size(), c.count);
    EXPECT_EQ(topologies.front(), c.first);
    EXPECT_EQ(topologies.back(), c.last);
  }
}

TEST(TpuTopologyTest, TablesContainExactlyTheDocumentedShapes) {
  EXPECT_EQ(ValidTopologies(TpuGeneration::kV2),
            (std::vector<std::string>{"4x4", "4x8", "8x8", "8x16", "16x16"}));
  EXPECT_EQ(ValidTopologies(TpuGeneration::kV3),
            (std::vector<std::string>{"4x4", "4x8", "8x8", "8x16", "16x16", "16x32", "32x32"}));
  const std::vector<std::string> lite = {"1x1", "2x2", "2x4",  "2x8",  "4x4",
                                         "4x8", "8x8", "8x16", "16x16"};
  EXPECT_EQ(ValidTopologies(TpuGeneration::kV5e), lite);
  EXPECT_EQ(ValidTopologies(TpuGeneration::kV6e), lite);
  EXPECT_EQ(ValidTopologies(TpuGeneration::kV7x),
            (std::vector<std::string>{"2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8",
                                      "8x8x8", "8x8x16", "8x16x16"}));

  const struct {
    TpuGeneration generation;
    std::string topology;
    bool valid;
  } kMembership[] = {
      {TpuGeneration::kV4, "2x4x4", true},      {TpuGeneration::kV4, "4x4x4", true},
      {TpuGeneration::kV4, "4x12x8", true},     {TpuGeneration::kV4, "12x4x16", true},
      {TpuGeneration::kV4, "4x4x20", false},    {TpuGeneration::kV4, "16x16x16", false},
      {TpuGeneration::kV4, "4x4x2", false},     {TpuGeneration::kV4, "2x2x8", false},
      {TpuGeneration::kV5p, "16x16x16", true},  {TpuGeneration::kV5p, "4x4x20", true},
      {TpuGeneration::kV5p, "16x4x24", true},   {TpuGeneration::kV5p, "16x16x28", false},
      {TpuGeneration::kV5p, "20x4x4", false},   {TpuGeneration::kV7x, "4x4x12", false},
      {TpuGeneration::kV7x, "16x16x16", false},
  };
  for (const auto& c : kMembership) {
    const std::vector<std::string>& topologies = ValidTopologies(c.generation);
    EXPECT_EQ(std::find(topologies.begin(), topologies.end(), c.topology) != topologies.end(),
              c.valid)
        << GenerationName(c.generation) << " " << c.topology;
  }
}

TEST(TpuTopologyTest, EveryTableIsSmallestFirstWithoutDuplicates) {
  for (TpuGeneration generation : AllGenerations()) {
    SCOPED_TRACE(GenerationName(generation));
    const std::vector<std::string>& topologies = ValidTopologies(generation);
    EXPECT_EQ(std::set<std::string>(topologies.begin(), topologies.end()).size(),
              topologies.size());
    for (size_t i = 1; i < topologies.size(); ++i) {
      EXPECT_LE(Chips(topologies[i - 1]), Chips(topologies[i]))
          << topologies[i - 1] << " before " << topologies[i];
    }
  }
}

TEST(DescribeSliceTest, EveryValidTopologyFillsWholeHosts) {
  for (TpuGeneration generation : AllGenerations()) {
    for (const std::string& topology : ValidTopologies(generation)) {
      SCOPED_TRACE(std::string(GenerationName(generation)) + " " + topology);
      StatusOr<TpuSlice> slice = DescribeSlice(GenerationName(generation), topology);
      ASSERT_TRUE(slice.ok()) << slice.status().ToString();
      EXPECT_EQ(slice->generation, generation);
      EXPECT_EQ(slice->topology, topology);
      EXPECT_EQ(slice->chips, Chips(topology));
      EXPECT_GE(slice->hosts, 1);
      EXPECT_EQ(slice->hosts * slice->chips_per_host, slice->chips);
      EXPECT_EQ(slice->pod_type, std::string(GenerationName(generation)) + "-" +
                                     std::to_string(slice->chips * CoresPerChip(generation)));
    }
  }
}

TEST(DescribeSliceTest, ComputesChipsHostsAndPodType) {
  const struct {
    std::string accelerator_type;
    std::string topology;
    TpuGeneration generation;
    int chips;
    int chips_per_host;
    int hosts;
    std::string pod_type;
  } kCases[] = {
      {"TPU-V2", "4x4", TpuGeneration::kV2, 16, 4, 4, "v2-32"},
      {"v3", "32x32", TpuGeneration::kV3, 1024, 4, 256, "v3-2048"},
      {"TPU-V4", "2x2x1", TpuGeneration::kV4, 4, 4, 1, "v4-8"},
      {"TPU-V4", "2x2x2", TpuGeneration::kV4, 8, 4, 2, "v4-16"},
      {"v4-32", "2x2x4", TpuGeneration::kV4, 16, 4, 4, "v4-32"},
      {"TPU-V4", "12x12x16", TpuGeneration::kV4, 2304, 4, 576, "v4-4608"},
      {"v5p-8", "2x2x1", TpuGeneration::kV5p, 4, 4, 1, "v5p-8"},
      {"TPU-V5P", "16x16x24", TpuGeneration::kV5p, 6144, 4, 1536, "v5p-12288"},
      {"v5e", "1x1", TpuGeneration::kV5e, 1, 1, 1, "v5litepod-1"},
      {"v5e", "2x4", TpuGeneration::kV5e, 8, 8, 1, "v5litepod-8"},
      {"v5litepod-16", "4x4", TpuGeneration::kV5e, 16, 4, 4, "v5litepod-16"},
      {"TPU-V5LITEPOD", "16x16", TpuGeneration::kV5e, 256, 4, 64, "v5litepod-256"},
      {"v6e", "1x1", TpuGeneration::kV6e, 1, 1, 1, "v6e-1"},
      {"v6e", "2x2", TpuGeneration::kV6e, 4, 4, 1, "v6e-4"},
      {"v6e-8", "2x4", TpuGeneration::kV6e, 8, 8, 1, "v6e-8"},
      {"TPU-V6E", "2x8", TpuGeneration::kV6e, 16, 4, 4, "v6e-16"},
      {"TPU-V6E", "4x4", TpuGeneration::kV6e, 16, 4, 4, "v6e-16"},
      {"v6e", "16x16", TpuGeneration::kV6e, 256, 4, 64, "v6e-256"},
      {"TPU-V7X", "2x2x1", TpuGeneration::kV7x, 4, 4, 1, "v7x-8"},
      {"TPU-V7X", "2x2x2", TpuGeneration::kV7x, 8, 4, 2, "v7x-16"},
      {"tpu7x-16", "2x2x2", TpuGeneration::kV7x, 8, 4, 2, "v7x-16"},
      {"v7x", "8x16x16", TpuGeneration::kV7x, 2048, 4, 512, "v7x-4096"},
  };
  for (const auto& c : kCases) {
    SCOPED_TRACE(c.accelerator_type + " " + c.topology);
    StatusOr<TpuSlice> slice = DescribeSlice(c.accelerator_type, c.topology);
    ASSERT_TRUE(slice.ok()) << slice.status().ToString();
    EXPECT_EQ(slice->generation, c.generation);
    EXPECT_EQ(slice->topology, c.topology);
    EXPECT_EQ(slice->chips, c.chips);
    EXPECT_EQ(slice->chips_per_host, c.chips_per_host);
    EXPECT_EQ(slice->hosts, c.hosts);
    EXPECT_EQ(slice->pod_type, c.pod_type);
  }
}

TEST(DescribeSliceTest, NormalizesTopologyCaseAndWhitespace) {
  const struct {
    std::string given;
    std::string normalized;
  } kCases[] = {{"2X2X4", "2x2x4"}, {" 2x2x4\n", "2x2x4"}, {"\t2x2X4 ", "2x2x4"}};
  for (const auto& c : kCases) {
    StatusOr<TpuSlice> slice = DescribeSlice("v4", c.given);
    ASSERT_TRUE(slice.ok()) << slice.status().ToString();
    EXPECT_EQ(slice->topology, c.normalized);
    EXPECT_EQ(slice->pod_type, "v4-32");
  }
}

TEST(ParseTpuGenerationTest, AcceptsEverySpellingCaseInsensitively) {
  const struct {
    std::string spelling;
    TpuGeneration generation;
  } kCases[] = {
      {"TPU-V2", TpuGeneration::kV2},     {"v2-8", TpuGeneration::kV2},
      {"TPU-V3", TpuGeneration::kV3},     {"v3", TpuGeneration::kV3},
      {"TPU-V4", TpuGeneration::kV4},     {"v4", TpuGeneration::kV4},
      {"v4-32", TpuGeneration::kV4},      {"V4-32", TpuGeneration::kV4},
      {"tpu-v4-32", TpuGeneration::kV4},  {"TPU-V5P", TpuGeneration::kV5p},
      {"v5p-8", TpuGeneration::kV5p},     {"TPU-V5LITEPOD", TpuGeneration::kV5e},
      {"v5litepod", TpuGeneration::kV5e}, {"v5litepod-16", TpuGeneration::kV5e},
      {"v5e", TpuGeneration::kV5e},       {"TPU-V5E", TpuGeneration::kV5e},
      {"v5e-8", TpuGeneration::kV5e},     {"TPU-V6E", TpuGeneration::kV6e},
      {"v6e", TpuGeneration::kV6e},       {"v6e-8", TpuGeneration::kV6e},
      {" v6e ", TpuGeneration::kV6e},     {"TPU-V7X", TpuGeneration::kV7x},
      {"v7x", TpuGeneration::kV7x},       {"v7x-16", TpuGeneration::kV7x},
      {"tpu7x", TpuGeneration::kV7x},     {"TPU7X", TpuGeneration::kV7x},
      {"tpu7x-16", TpuGeneration::kV7x},
  };
  for (const auto& c : kCases) {
    StatusOr<TpuGeneration> generation = ParseTpuGeneration(c.spelling);
    ASSERT_TRUE(generation.ok()) << c.spelling << ": " << generation.status().ToString();
    EXPECT_EQ(*generation, c.generation) << c.spelling;
  }
}

TEST(ParseTpuGenerationTest, RejectsUnknownTypeNamingItAndTheAllowedGenerations) {
  StatusOr<TpuGeneration> generation = ParseTpuGeneration("TPU-V9");
  ASSERT_FALSE(generation.ok());
  EXPECT_EQ(generation.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(generation.status().message(),
            "accelerator_type='TPU-V9' is not a TPU generation jaxtrain knows; allowed: TPU-V2, "
            "TPU-V3, TPU-V4, TPU-V5P, TPU-V5E (v5litepod), TPU-V6E, TPU-V7X (or a pod type such "
            "as v4-32)");
}

TEST(ParseTpuGenerationTest, RejectsMalformedTypesAndPodTypes) {
  const std::string kCases[] = {"",       "tpu",    "TPU-",   "v5",      "v5lite",
                                "v6",     "A100",   "gpu",    "v4-",     "v4-abc",
                                "v4-0",   "v4--32", "v4-32x", "v6e-8-1", "v4-99999999999",
                                "v4 -32", "vv4"};
  for (const std::string& spelling : kCases) {
    StatusOr<TpuGeneration> generation = ParseTpuGeneration(spelling);
    ASSERT_FALSE(generation.ok()) << "'" << spelling << "' parsed";
    EXPECT_EQ(generation.status().code(), StatusCode::kInvalidArgument) << spelling;
    EXPECT_TRUE(HasSubstr(generation.status().message(), "accelerator_type='" + spelling + "'"));
    EXPECT_TRUE(HasSubstr(generation.status().message(), "allowed: TPU-V2"));
  }
}

TEST(DescribeSliceTest, RejectsUnknownGeneration) {
  StatusOr<TpuSlice> slice = DescribeSlice("TPU-V9", "4x4");
  ASSERT_FALSE(slice.ok());
  EXPECT_EQ(slice.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(HasSubstr(slice.status().message(), "accelerator_type='TPU-V9'"));
  EXPECT_TRUE(HasSubstr(slice.status().message(), "allowed: TPU-V2"));
}

TEST(DescribeSliceTest, RejectsTopologyInvalidForGenerationListingValidOnes) {
  StatusOr<TpuSlice> slice = DescribeSlice("v6e", "3x3");
  ASSERT_FALSE(slice.ok());
  EXPECT_EQ(slice.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(slice.status().message(),
            "topology='3x3' is not valid for v6e; valid topologies: 1x1, 2x2, 2x4, 2x8, 4x4, 4x8, "
            "8x8, 8x16, 16x16");

  const struct {
    std::string accelerator_type;
    std::string topology;
    std::string generation;
  } kCases[] = {
      {"v7x-8", "4x4", "v7x"},
      {"TPU-V4", "4x4", "v4"},
      {"v4", "16x16x16", "v4"},
      {"v4", "2x2x3", "v4"},
      {"v4", "", "v4"},
      {"v5p", "4x4x28", "v5p"},
      {"TPU-V2", "2x2x1", "v2"},
      {"v2", "32x32", "v2"},
      {"v5e", "2x2x1", "v5litepod"},
      {"v6e", "4 x 4", "v6e"},
      {"v6e", "4x4x", "v6e"},
      {"tpu7x", "2x2", "v7x"},
      {"v3-8", "2x2", "v3"},
      {"v5litepod-4", "2x2x1", "v5litepod"},
  };
  for (const auto& c : kCases) {
    SCOPED_TRACE(c.accelerator_type + " " + c.topology);
    StatusOr<TpuSlice> invalid = DescribeSlice(c.accelerator_type, c.topology);
    ASSERT_FALSE(invalid.ok());
    EXPECT_EQ(invalid.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(HasSubstr(
        invalid.status().message(),
        "topology='" + c.topology + "' is not valid for " + c.generation + "; valid topologies: "));
  }
}

TEST(DescribeSliceTest, InvalidTopologyMessageListsEveryValidTopology) {
  StatusOr<TpuSlice> slice = DescribeSlice("v5p", "3x3x3");
  ASSERT_FALSE(slice.ok());
  const std::string& message = slice.status().message();
  const std::string list = message.substr(message.find("valid topologies: "));
  EXPECT_EQ(std::count(list.begin(), list.end(), ','), 99);
  EXPECT_TRUE(HasSubstr(list, ": 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, "));
  EXPECT_TRUE(list.ends_with(", 16x16x24")) << list;
}

TEST(DescribeSliceTest, RejectsPodTypeWhoseCoreCountDisagreesWithTopology) {
  const struct {
    std::string accelerator_type;
    std::string topology;
    std::string expected_pod_type;
  } kCases[] = {
      {"v4-16", "2x2x4", "v4-32"}, {"v4-32", "2x2x2", "v4-16"},      {"v6e-16", "2x4", "v6e-8"},
      {"v6e-32", "4x4", "v6e-16"}, {"v5e-16", "2x4", "v5litepod-8"}, {"tpu7x-8", "2x2x2", "v7x-16"},
  };
  for (const auto& c : kCases) {
    SCOPED_TRACE(c.accelerator_type + " " + c.topology);
    StatusOr<TpuSlice> slice = DescribeSlice(c.accelerator_type, c.topology);
    ASSERT_FALSE(slice.ok());
    EXPECT_EQ(slice.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(HasSubstr(slice.status().message(), "accelerator_type='" + c.accelerator_type +
                                                        "' does not match topology='" + c.topology +
                                                        "'"));
    EXPECT_TRUE(HasSubstr(slice.status().message(), "'" + c.expected_pod_type + "'"));
  }
}

TEST(DescribeSliceTest, PodTypeMismatchMessageExplainsTheFix) {
  StatusOr<TpuSlice> slice = DescribeSlice("v4-16", "2x2x4");
  ASSERT_FALSE(slice.ok());
  EXPECT_EQ(slice.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(slice.status().message(),
            "accelerator_type='v4-16' does not match topology='2x2x4': a v4 2x2x4 slice is pod "
            "type 'v4-32' (16 chips x 2 cores); set accelerator_type to 'v4-32' or to the "
            "generation alone ('v4'), or change the topology");
}

}  // namespace
}  // namespace jaxtrain::accelerators
