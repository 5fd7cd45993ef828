// TPU generations, topologies and slice shapes: the facts that placement and ScalingConfig
// validation are built on. Pure functions over static tables; thread-safe.
//
// Terms: a *slice* is a set of TPU chips wired by ICI into one `topology` ("4x4", "2x2x4");
// a slice spans `hosts` machines (TPU VMs) with `chips_per_host` chips each; the *pod type*
// names a slice by generation and core count ("v4-32" = 16 v4 chips x 2 cores).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace jaxtrain::accelerators {

enum class TpuGeneration { kV2, kV3, kV4, kV5p, kV5e, kV6e, kV7x };

// Canonical lower-case name: "v2", "v3", "v4", "v5p", "v5litepod", "v6e", "v7x".
std::string_view GenerationName(TpuGeneration generation);

// Every generation, in the order above.
const std::vector<TpuGeneration>& AllGenerations();

// Parses the generation out of an accelerator type as users write it, case-insensitively:
// "TPU-V6E", "v6e", "TPU-V5LITEPOD", "v5litepod", "v5e", "TPU-V7X", "tpu7x", and pod types such as
// "v4-32", "v5litepod-16", "tpu7x-16".
// Errors: kInvalidArgument naming the value and listing the accepted generations.
StatusOr<TpuGeneration> ParseTpuGeneration(std::string_view accelerator_type);

// The topologies valid for `generation`, smallest first.
const std::vector<std::string>& ValidTopologies(TpuGeneration generation);

// Cores per chip: 1 for v5e and v6e, 2 for the others.
int CoresPerChip(TpuGeneration generation);

struct TpuSlice {
  TpuGeneration generation;
  std::string topology;  // normalized, e.g. "2x2x4"
  int chips = 0;         // product of the topology's dimensions
  int chips_per_host = 0;
  int hosts = 0;         // chips / chips_per_host
  std::string pod_type;  // e.g. "v4-32", "v6e-16", "v5litepod-8", "v7x-16"
};

// Describes the slice named by `accelerator_type` and `topology`.
// Chips per host is 4, except the single-host v5e/v6e shapes 1x1, 2x2 and 2x4 (1, 4, 8 chips).
// If `accelerator_type` carries a core count ("v4-32", "tpu7x-16") it must match the topology.
// Errors: kInvalidArgument when the generation is unknown, when the topology is not valid for the
// generation (the message lists the valid ones), or when a pod type's core count does not match.
StatusOr<TpuSlice> DescribeSlice(std::string_view accelerator_type, std::string_view topology);

}  // namespace jaxtrain::accelerators
