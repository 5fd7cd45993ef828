#include "accelerators/tpu.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <optional>
#include <utility>

#include "base/strings.h"

namespace jaxtrain::accelerators {
namespace {

constexpr int kGenerationCount = 7;
// Chips per host of every multi-host slice, and the step of the larger 3D topologies.
constexpr int kDefaultChipsPerHost = 4;

// Spellings accepted after normalization (see ParseAcceleratorType); "v5e" is the marketing name
// of what Cloud TPU calls "v5litepod".
constexpr std::pair<std::string_view, TpuGeneration> kSpellings[] = {
    {"v2", TpuGeneration::kV2},   {"v3", TpuGeneration::kV3},         {"v4", TpuGeneration::kV4},
    {"v5p", TpuGeneration::kV5p}, {"v5litepod", TpuGeneration::kV5e}, {"v5e", TpuGeneration::kV5e},
    {"v6e", TpuGeneration::kV6e}, {"v7x", TpuGeneration::kV7x},
};

constexpr std::string_view kAllowedGenerations =
    "TPU-V2, TPU-V3, TPU-V4, TPU-V5P, TPU-V5E (v5litepod), TPU-V6E, TPU-V7X (or a pod type such as "
    "v4-32)";

// The v5e/v6e shapes that fit on one host, which then carries all of the slice's chips.
constexpr std::string_view kSingleHostTopologies[] = {"1x1", "2x2", "2x4"};

struct AcceleratorType {
  TpuGeneration generation;
  std::optional<int> cores;  // set when a pod type such as "v4-32" was given
};

std::string Lower(std::string_view text) {
  std::string lowered(text);
  for (char& c : lowered) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return lowered;
}

// Dimensions of a well-formed topology such as "2x2x4".
std::vector<int> Dimensions(std::string_view topology) {
  std::vector<int> dims;
  while (!topology.empty()) {
    int dim = 0;
    const char* end = std::from_chars(topology.data(), topology.data() + topology.size(), dim).ptr;
    dims.push_back(dim);
    topology.remove_prefix(end - topology.data());
    if (!topology.empty()) topology.remove_prefix(1);  // the 'x'
  }
  return dims;
}

int ChipCount(std::string_view topology) {
  int chips = 1;
  for (int dim : Dimensions(topology)) chips *= dim;
  return chips;
}

// Orders topologies smallest first: by chip count, then by dimensions.
std::vector<std::string> SmallestFirst(std::vector<std::string> topologies) {
  std::sort(topologies.begin(), topologies.end(), [](const std::string& a, const std::string& b) {
    return std::pair(ChipCount(a), Dimensions(a)) < std::pair(ChipCount(b), Dimensions(b));
  });
  return topologies;
}

// Ray's _get_larger_3d_topologies: `listed` plus every XxYxZ whose dimensions are multiples of 4
// up to the bounds.
std::vector<std::string> WithLarger3dTopologies(std::vector<std::string> listed, int max_x,
                                                int max_y, int max_z) {
  for (int x = kDefaultChipsPerHost; x <= max_x; x += kDefaultChipsPerHost) {
    for (int y = kDefaultChipsPerHost; y <= max_y; y += kDefaultChipsPerHost) {
      for (int z = kDefaultChipsPerHost; z <= max_z; z += kDefaultChipsPerHost) {
        listed.push_back(std::to_string(x) + "x" + std::to_string(y) + "x" + std::to_string(z));
      }
    }
  }
  return listed;
}

// Ray's VALID_TPU_TOPOLOGY (python/ray/_private/accelerators/tpu.py): the same sets, smallest
// first. Ray's literal sets are written here already in that order.
std::array<std::vector<std::string>, kGenerationCount> BuildTopologyTables() {
  const std::vector<std::string> small_3d = {"2x2x1", "2x2x2", "2x2x4", "2x4x4"};
  const std::vector<std::string> lite = {"1x1", "2x2", "2x4",  "2x8",  "4x4",
                                         "4x8", "8x8", "8x16", "16x16"};
  std::array<std::vector<std::string>, kGenerationCount> tables;
  tables[static_cast<int>(TpuGeneration::kV2)] = {"4x4", "4x8", "8x8", "8x16", "16x16"};
  tables[static_cast<int>(TpuGeneration::kV3)] = {"4x4",   "4x8",   "8x8",  "8x16",
                                                  "16x16", "16x32", "32x32"};
  tables[static_cast<int>(TpuGeneration::kV4)] =
      SmallestFirst(WithLarger3dTopologies(small_3d, 12, 12, 16));
  tables[static_cast<int>(TpuGeneration::kV5p)] =
      SmallestFirst(WithLarger3dTopologies(small_3d, 16, 16, 24));
  tables[static_cast<int>(TpuGeneration::kV5e)] = lite;
  tables[static_cast<int>(TpuGeneration::kV6e)] = lite;
  tables[static_cast<int>(TpuGeneration::kV7x)] = {"2x2x1", "2x2x2", "2x2x4", "2x4x4",  "4x4x4",
                                                   "4x4x8", "4x8x8", "8x8x8", "8x8x16", "8x16x16"};
  return tables;
}

// Accepts a generation ("TPU-V4", "v6e", "tpu7x") or a pod type ("v4-32", "tpu7x-16"),
// case-insensitively. Like Ray, a leading "tpu", "tpu-", "tpuv" or "tpu-v" stands for "v".
StatusOr<AcceleratorType> ParseAcceleratorType(std::string_view accelerator_type) {
  const auto unknown = [&] {
    return InvalidArgumentError(
        "accelerator_type='" + std::string(accelerator_type) +
        "' is not a TPU generation jaxtrain knows; allowed: " + std::string(kAllowedGenerations));
  };
  std::string spelled = Lower(Trim(accelerator_type));
  if (spelled.starts_with("tpu")) {
    std::string_view rest = std::string_view(spelled).substr(3);
    if (rest.starts_with('-')) rest.remove_prefix(1);
    if (rest.starts_with('v')) rest.remove_prefix(1);
    spelled = "v" + std::string(rest);
  }
  const size_t dash = spelled.find('-');
  const std::string_view name = std::string_view(spelled).substr(0, dash);
  const auto spelling = std::find_if(std::begin(kSpellings), std::end(kSpellings),
                                     [&](const auto& entry) { return entry.first == name; });
  if (spelling == std::end(kSpellings)) return unknown();
  AcceleratorType parsed{spelling->second, std::nullopt};
  if (dash != std::string::npos) {
    const std::string_view count = std::string_view(spelled).substr(dash + 1);
    int cores = 0;
    const auto [end, ec] = std::from_chars(count.data(), count.data() + count.size(), cores);
    if (ec != std::errc() || end != count.data() + count.size() || cores <= 0) {
      return unknown();
    }
    parsed.cores = cores;
  }
  return parsed;
}

std::string NormalizeTopology(std::string_view topology) { return Lower(Trim(topology)); }

int ChipsPerHost(TpuGeneration generation, std::string_view topology, int chips) {
  const bool packs_up_to_8 = generation == TpuGeneration::kV5e || generation == TpuGeneration::kV6e;
  const bool single_host =
      std::find(std::begin(kSingleHostTopologies), std::end(kSingleHostTopologies), topology) !=
      std::end(kSingleHostTopologies);
  return packs_up_to_8 && single_host ? chips : kDefaultChipsPerHost;
}

}  // namespace

std::string_view GenerationName(TpuGeneration generation) {
  switch (generation) {
    case TpuGeneration::kV2: return "v2";
    case TpuGeneration::kV3: return "v3";
    case TpuGeneration::kV4: return "v4";
    case TpuGeneration::kV5p: return "v5p";
    case TpuGeneration::kV5e: return "v5litepod";
    case TpuGeneration::kV6e: return "v6e";
    case TpuGeneration::kV7x: return "v7x";
  }
  return "unknown";
}

const std::vector<TpuGeneration>& AllGenerations() {
  static const auto* const kGenerations = new std::vector<TpuGeneration>{
      TpuGeneration::kV2,  TpuGeneration::kV3,  TpuGeneration::kV4, TpuGeneration::kV5p,
      TpuGeneration::kV5e, TpuGeneration::kV6e, TpuGeneration::kV7x};
  return *kGenerations;
}

StatusOr<TpuGeneration> ParseTpuGeneration(std::string_view accelerator_type) {
  JT_ASSIGN_OR_RETURN(const AcceleratorType parsed, ParseAcceleratorType(accelerator_type));
  return parsed.generation;
}

const std::vector<std::string>& ValidTopologies(TpuGeneration generation) {
  static const auto* const kTables =
      new std::array<std::vector<std::string>, kGenerationCount>(BuildTopologyTables());
  return (*kTables)[static_cast<int>(generation)];
}

int CoresPerChip(TpuGeneration generation) {
  return generation == TpuGeneration::kV5e || generation == TpuGeneration::kV6e ? 1 : 2;
}

StatusOr<TpuSlice> DescribeSlice(std::string_view accelerator_type, std::string_view topology) {
  JT_ASSIGN_OR_RETURN(const AcceleratorType parsed, ParseAcceleratorType(accelerator_type));
  const std::string_view name = GenerationName(parsed.generation);
  const std::vector<std::string>& valid = ValidTopologies(parsed.generation);
  std::string normalized = NormalizeTopology(topology);
  if (std::find(valid.begin(), valid.end(), normalized) == valid.end()) {
    return InvalidArgumentError("topology='" + std::string(topology) + "' is not valid for " +
                                std::string(name) + "; valid topologies: " + Join(valid, ", "));
  }

  TpuSlice slice;
  slice.generation = parsed.generation;
  slice.topology = std::move(normalized);
  slice.chips = ChipCount(slice.topology);
  slice.chips_per_host = ChipsPerHost(slice.generation, slice.topology, slice.chips);
  slice.hosts = slice.chips / slice.chips_per_host;
  const int cores_per_chip = CoresPerChip(slice.generation);
  const int cores = slice.chips * cores_per_chip;
  slice.pod_type = std::string(name) + "-" + std::to_string(cores);
  if (parsed.cores.has_value() && *parsed.cores != cores) {
    return InvalidArgumentError(
        "accelerator_type='" + std::string(accelerator_type) + "' does not match topology='" +
        std::string(topology) + "': a " + std::string(name) + " " + slice.topology +
        " slice is pod type '" + slice.pod_type + "' (" + std::to_string(slice.chips) +
        " chips x " + std::to_string(cores_per_chip) + " cores); set accelerator_type to '" +
        slice.pod_type + "' or to the generation alone ('" + std::string(name) +
        "'), or change the topology");
  }
  return slice;
}

}  // namespace jaxtrain::accelerators
