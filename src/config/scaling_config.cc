#include "config/scaling_config.h"

#include <algorithm>
#include <cmath>

#include "base/strings.h"

namespace jaxtrain::config {
namespace {

StatusOr<PlacementStrategy> ParsePlacementStrategy(const std::string& s) {
  if (s == "PACK") return PlacementStrategy::kPack;
  if (s == "SPREAD") return PlacementStrategy::kSpread;
  if (s == "STRICT_PACK") return PlacementStrategy::kStrictPack;
  if (s == "STRICT_SPREAD") return PlacementStrategy::kStrictSpread;
  return InvalidArgumentError("ScalingConfig.placement_strategy='" + s +
                              "' is not a placement strategy; allowed: PACK, SPREAD, "
                              "STRICT_PACK, STRICT_SPREAD");
}

}  // namespace

std::string_view PlacementStrategyName(PlacementStrategy strategy) {
  switch (strategy) {
    case PlacementStrategy::kPack: return "PACK";
    case PlacementStrategy::kSpread: return "SPREAD";
    case PlacementStrategy::kStrictPack: return "STRICT_PACK";
    case PlacementStrategy::kStrictSpread: return "STRICT_SPREAD";
  }
  return "PACK";
}

int LocalWorkerLimit(int cpus) {
  return std::max(kLocalWorkersFloor, kLocalWorkersPerCpu * std::max(cpus, 1));
}

Status CheckLocalWorkerCount(const ScalingConfig& config, int cpus) {
  const int limit = LocalWorkerLimit(cpus);
  if (config.num_workers() <= limit) return OkStatus();
  return InvalidArgumentError(
      "ScalingConfig.num_workers=" + std::to_string(config.num_workers()) +
      " is more than a local run starts on this machine: at most " + std::to_string(limit) +
      " worker processes (" + std::to_string(kLocalWorkersPerCpu) + " per CPU, " +
      std::to_string(cpus) + " CPUs, and never fewer than " + std::to_string(kLocalWorkersFloor) +
      "); ask for fewer workers, or run on a cluster (Slurm: docs/slurm.md)");
}

StatusOr<ScalingConfig> ScalingConfig::WithWorkers(int workers) const {
  ScalingConfigInput in = input_;
  in.num_workers = workers;
  in.min_workers.reset();
  return Create(std::move(in));
}

namespace {

// ScalingConfig.num_workers=(min, max) as the user wrote it, for messages.
std::string ElasticField(const ScalingConfigInput& in) {
  return "ScalingConfig.num_workers=(" + std::to_string(*in.min_workers) + ", " +
         std::to_string(in.num_workers) + ")";
}

Status CheckElastic(const ScalingConfigInput& in) {
  if (!std::isfinite(in.elastic_resize_monitor_interval_s) ||
      in.elastic_resize_monitor_interval_s <= 0) {
    return InvalidArgumentError("ScalingConfig.elastic_resize_monitor_interval_s=" +
                                FormatNumber(in.elastic_resize_monitor_interval_s) +
                                " is not allowed; it must be a number of seconds > 0");
  }
  if (!in.min_workers) return OkStatus();
  if (*in.min_workers < 1 || *in.min_workers > in.num_workers) {
    return InvalidArgumentError(ElasticField(in) +
                                " is not allowed; an elastic run's (min, max) must have "
                                "1 <= min <= max");
  }
  return OkStatus();
}

}  // namespace

StatusOr<ScalingConfig> ScalingConfig::Create(ScalingConfigInput in) {
  ScalingConfig c;
  if (in.num_workers < 1 || in.num_workers > kMaxWorkers) {
    return InvalidArgumentError(
        (in.min_workers ? ElasticField(in) + " has max=" + std::to_string(in.num_workers)
                        : "ScalingConfig.num_workers=" + std::to_string(in.num_workers)) +
        " is not allowed; it must be a whole number >= 1 and at most " +
        std::to_string(kMaxWorkers));
  }
  JT_RETURN_IF_ERROR(CheckElastic(in));
  if (in.use_tpu && in.use_gpu) {
    return InvalidArgumentError(
        "ScalingConfig.use_tpu=True and use_gpu=True were both given; a worker uses one kind of "
        "accelerator: set at most one of them");
  }
  JT_ASSIGN_OR_RETURN(c.placement_strategy_, ParsePlacementStrategy(in.placement_strategy));
  for (const auto& [name, amount] : in.resources_per_worker) {
    if (name.empty()) {
      return InvalidArgumentError(
          "ScalingConfig.resources_per_worker has an empty resource name; use names such as "
          "'CPU', 'GPU' or 'TPU'");
    }
    if (!std::isfinite(amount) || amount < 0) {
      return InvalidArgumentError("ScalingConfig.resources_per_worker['" + name +
                                  "']=" + FormatNumber(amount) +
                                  " is not allowed; amounts must be finite and >= 0");
    }
  }
  auto tpu = in.resources_per_worker.find("TPU");
  if (tpu != in.resources_per_worker.end() && !in.use_tpu) {
    return InvalidArgumentError(
        "ScalingConfig.resources_per_worker['TPU']=" + FormatNumber(tpu->second) +
        " needs use_tpu=True; set use_tpu=True or remove the TPU entry");
  }
  if (tpu != in.resources_per_worker.end() && tpu->second == 0) {
    return InvalidArgumentError(
        "ScalingConfig.resources_per_worker['TPU']=0 with use_tpu=True gives a worker no TPU "
        "chips; ask for 1, 2, 4 or 8 chips, or leave it out to take a whole host");
  }
  auto gpu = in.resources_per_worker.find("GPU");
  if (gpu != in.resources_per_worker.end() && gpu->second > 0 && !in.use_gpu) {
    return InvalidArgumentError(
        "ScalingConfig.resources_per_worker['GPU']=" + FormatNumber(gpu->second) +
        " needs use_gpu=True; set use_gpu=True or remove the GPU entry");
  }
  if (in.topology && !in.use_tpu) {
    return InvalidArgumentError("ScalingConfig.topology='" + *in.topology +
                                "' is only used with use_tpu=True; set use_tpu=True or remove "
                                "topology");
  }
  // Ray Train takes accelerator_type alone as a placement constraint: CPU workers on nodes
  // that have such accelerators. jaxtrain places no CPU worker by the host's accelerators, so it
  // refuses the field rather than ignore it.
  if (in.accelerator_type && !in.use_tpu && !in.use_gpu) {
    return InvalidArgumentError(
        "ScalingConfig.accelerator_type='" + *in.accelerator_type +
        "' is only used with use_gpu=True or use_tpu=True; set use_gpu=True for a GPU type "
        "(e.g. 'H100') or use_tpu=True for a TPU type (e.g. 'TPU-V6E'), or remove "
        "accelerator_type");
  }

  c.resources_ = in.resources_per_worker;
  if (in.use_tpu) {
    if (in.num_workers > 1 && (!in.topology || !in.accelerator_type)) {
      return InvalidArgumentError(
          "ScalingConfig(use_tpu=True, num_workers=" + std::to_string(in.num_workers) +
          ") needs both topology (e.g. '4x4') and accelerator_type (e.g. 'TPU-V6E') to reserve a "
          "multi-host TPU slice; missing: " +
          std::string(!in.topology && !in.accelerator_type ? "topology, accelerator_type"
                      : !in.topology                       ? "topology"
                                                           : "accelerator_type"));
    }
    if (in.accelerator_type && !in.topology) {
      JT_RETURN_IF_ERROR(accelerators::ParseTpuGeneration(*in.accelerator_type).status());
    }
    if (in.topology) {
      if (!in.accelerator_type) {
        return InvalidArgumentError("ScalingConfig.topology='" + *in.topology +
                                    "' needs accelerator_type (e.g. 'TPU-V6E') to know the TPU "
                                    "generation");
      }
      auto slice = accelerators::DescribeSlice(*in.accelerator_type, *in.topology);
      if (!slice.ok()) return InvalidArgumentError("ScalingConfig: " + slice.status().message());
      c.slice_ = *slice;
      const int per_host = slice->chips_per_host;
      int chips_per_worker = per_host;
      if (tpu != in.resources_per_worker.end()) {
        const double k = tpu->second;
        if (k != std::floor(k) || k > per_host || per_host % static_cast<int>(k) != 0) {
          return InvalidArgumentError(
              "ScalingConfig.resources_per_worker['TPU']=" + FormatNumber(k) +
              " does not divide "
              "the " +
              std::to_string(per_host) + " chips of a " + slice->pod_type +
              " host; allowed: a whole number that divides " + std::to_string(per_host));
        }
        chips_per_worker = static_cast<int>(k);
      }
      c.resources_["TPU"] = chips_per_worker;
      c.workers_per_slice_ = slice->hosts * (per_host / chips_per_worker);
      if (in.num_workers % c.workers_per_slice_ != 0) {
        return InvalidArgumentError(
            (in.min_workers ? ElasticField(in) + " has max=" + std::to_string(in.num_workers)
                            : "ScalingConfig.num_workers=" + std::to_string(in.num_workers)) +
            " must be a multiple of " + std::to_string(c.workers_per_slice_) +
            ", the number of workers in one " + slice->pod_type + " slice (topology " +
            slice->topology + ": " + std::to_string(slice->hosts) + " host(s) x " +
            std::to_string(per_host / chips_per_worker) + " worker(s) per host)");
      }
      if (in.min_workers && *in.min_workers % c.workers_per_slice_ != 0) {
        return InvalidArgumentError(
            ElasticField(in) + " has min=" + std::to_string(*in.min_workers) +
            ", not a multiple of " + std::to_string(c.workers_per_slice_) +
            ", the number of workers in one " + slice->pod_type +
            " slice: an elastic TPU run resizes by whole slices; allowed: min and max multiples "
            "of " +
            std::to_string(c.workers_per_slice_));
      }
    } else if (tpu == in.resources_per_worker.end()) {
      c.resources_["TPU"] = 1;
    }
  }
  if (in.use_gpu && !c.resources_.count("GPU")) c.resources_["GPU"] = 1;
  if (!c.resources_.count("CPU")) c.resources_["CPU"] = 1;
  c.input_ = std::move(in);
  return c;
}

}  // namespace jaxtrain::config
