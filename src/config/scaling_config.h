// ScalingConfig: how many workers, on which hardware. The single source of truth for its
// validation rules; the Python ScalingConfig binds this type and adds no rules of its own.
// Immutable once built; thread-safe.
#pragma once

#include <map>
#include <optional>
#include <string>

#include "accelerators/tpu.h"
#include "base/status.h"

namespace jaxtrain::config {

enum class PlacementStrategy { kPack, kSpread, kStrictPack, kStrictSpread };
std::string_view PlacementStrategyName(PlacementStrategy strategy);

// The most workers a ScalingConfig may ask for, whatever the launcher: more than any cluster
// jaxtrain is meant for, and far fewer than would exhaust the driver's memory while planning.
inline constexpr int kMaxWorkers = 100'000;

// A local run starts every worker process on this machine: at most
// max(kLocalWorkersFloor, kLocalWorkersPerCpu x its CPUs). The floor lets a simulated TPU pod
// slice (JAXTRAIN_SIMULATE) of up to 64 hosts run on a laptop.
inline constexpr int kLocalWorkersPerCpu = 8;
inline constexpr int kLocalWorkersFloor = 64;
int LocalWorkerLimit(int cpus);

// Ray Train V2's default for elastic_resize_monitor_interval_s.
inline constexpr double kDefaultResizeMonitorIntervalS = 60;

struct ScalingConfigInput {
  int num_workers = 1;  // the most workers; an elastic run's max
  // An elastic run (ScalingConfig(num_workers=(min, max)), docs/elastic.md): the fewest workers it
  // trains on. None: num_workers exactly, as before.
  std::optional<int> min_workers;
  // How often an elastic run below its max looks for the capacity it lacks.
  double elastic_resize_monitor_interval_s = kDefaultResizeMonitorIntervalS;
  bool use_tpu = false;
  bool use_gpu = false;
  std::optional<std::string> topology;
  std::optional<std::string> accelerator_type;
  std::map<std::string, double> resources_per_worker;  // empty = the default for the hardware
  std::string placement_strategy = "PACK";
};

class ScalingConfig {
 public:
  // Validates every field and the rules between them.
  // Errors: kInvalidArgument whose message names the field, the value given and what is allowed:
  //   num_workers < 1 or > kMaxWorkers; use_tpu together with use_gpu; an unknown
  //   placement_strategy; a negative or non-finite resource; a "TPU" resource without use_tpu, or
  //   use_tpu with TPU = 0; a "GPU" resource without use_gpu; topology without use_tpu; use_tpu
  //   with more than one worker but no topology or accelerator_type; an unknown TPU generation or a
  //   topology invalid for it; a TPU count per worker that does not divide the chips of a host;
  //   num_workers not a multiple of the workers one slice holds ("must be a multiple of ...").
  //   Elastic runs: min_workers < 1 or > num_workers (the max); for TPU, min_workers not a
  //   multiple of the workers one slice holds; elastic_resize_monitor_interval_s not finite and
  //   > 0. (That both are multiples of a listed host's workers is checked when the run is
  //   planned on its hosts: placement::CheckElasticHosts.)
  static StatusOr<ScalingConfig> Create(ScalingConfigInput input);

  const ScalingConfigInput& input() const { return input_; }
  int num_workers() const { return input_.num_workers; }
  // An elastic run: num_workers() is its max and min_workers() its min.
  bool elastic() const { return input_.min_workers.has_value(); }
  int min_workers() const { return input_.min_workers.value_or(input_.num_workers); }
  double resize_monitor_interval_s() const { return input_.elastic_resize_monitor_interval_s; }
  // This config with `workers` workers, a fixed-size run (an elastic run's plan for the hosts at
  // hand). Errors: as Create().
  StatusOr<ScalingConfig> WithWorkers(int workers) const;
  bool use_tpu() const { return input_.use_tpu; }
  bool use_gpu() const { return input_.use_gpu; }
  PlacementStrategy placement_strategy() const { return placement_strategy_; }
  // The resources of one worker, with the hardware's defaults filled in (TPU: a whole host's chips;
  // GPU: 1; CPU: 1).
  const std::map<std::string, double>& resources_per_worker() const { return resources_; }
  // The TPU slice, when use_tpu and a topology are given.
  const std::optional<accelerators::TpuSlice>& tpu_slice() const { return slice_; }
  // Workers one slice holds (hosts x workers per host); 0 without a slice.
  int workers_per_slice() const { return workers_per_slice_; }
  // Number of slices the workers span; 0 without a slice.
  int num_slices() const { return slice_ ? num_workers() / workers_per_slice_ : 0; }

 private:
  ScalingConfigInput input_;
  PlacementStrategy placement_strategy_ = PlacementStrategy::kPack;
  std::map<std::string, double> resources_;
  std::optional<accelerators::TpuSlice> slice_;
  int workers_per_slice_ = 0;
};

// Whether a local run of `config` fits this machine of `cpus` CPUs (LocalWorkerLimit).
// Errors: kInvalidArgument naming ScalingConfig.num_workers, its value and the limit.
Status CheckLocalWorkerCount(const ScalingConfig& config, int cpus);

}  // namespace jaxtrain::config
