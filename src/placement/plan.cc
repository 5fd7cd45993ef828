#include "placement/plan.h"

namespace jaxtrain::placement {
namespace {

bool IsSet(const accelerators::HostView& host, const std::string& name) {
  auto v = host.GetEnv(name);
  return v.has_value() && !v->empty();
}

void SetUnlessUserSet(const accelerators::HostView& host, std::map<std::string, std::string>* env,
                      const std::string& name, const std::string& value) {
  if (!IsSet(host, name)) (*env)[name] = value;
}

std::string Join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : ",") + s;
  return out;
}

}  // namespace

StatusOr<Plan> PlanLocal(const config::ScalingConfig& config, const accelerators::HostView& host) {
  Plan plan;
  const int n = config.num_workers();
  auto simulate = host.GetEnv(kSimulateEnv);
  plan.simulated = simulate && !simulate->empty() && *simulate != "0";
  const std::string how_to_simulate =
      std::string("; to run this configuration on local CPU processes instead, set ") +
      kSimulateEnv + "=1";

  std::vector<std::vector<std::string>> devices(n);
  plan.platform = "cpu";
  if (config.use_tpu() && !plan.simulated) {
    int chips = accelerators::CountTpuChips(host);
    if (chips == 0) {
      return FailedPreconditionError(
          "ScalingConfig(use_tpu=True) asks for TPU chips, but this machine has none (no "
          "/dev/accel* devices, no Google /dev/vfio groups)" +
          how_to_simulate);
    }
    const auto& slice = config.tpu_slice();
    if (slice && slice->hosts > 1) {
      return FailedPreconditionError(
          "ScalingConfig(topology='" + slice->topology + "') is a " + slice->pod_type +
          " slice of " + std::to_string(slice->hosts) +
          " hosts; the local launcher runs on this one host only: run under Slurm, or use a "
          "single-host topology" +
          how_to_simulate);
    }
    const int per_worker = static_cast<int>(config.resources_per_worker().at("TPU"));
    if (per_worker * n > chips) {
      return FailedPreconditionError("ScalingConfig asks for " + std::to_string(n) + " workers x " +
                                     std::to_string(per_worker) +
                                     " TPU chips, but this machine has " + std::to_string(chips) +
                                     how_to_simulate);
    }
    for (int r = 0; r < n; ++r) {
      for (int c = 0; c < per_worker; ++c) devices[r].push_back(std::to_string(r * per_worker + c));
    }
    plan.platform = "tpu";
  } else if (config.use_gpu() && !plan.simulated) {
    std::vector<std::string> gpus = accelerators::VisibleGpus(host);
    const int per_worker = static_cast<int>(config.resources_per_worker().at("GPU"));
    if (gpus.empty()) {
      return FailedPreconditionError(
          "ScalingConfig(use_gpu=True) asks for GPUs, but this machine has none visible (no "
          "/dev/nvidia<N> devices, or CUDA_VISIBLE_DEVICES is empty)" +
          how_to_simulate);
    }
    if (per_worker * n > static_cast<int>(gpus.size())) {
      return FailedPreconditionError("ScalingConfig asks for " + std::to_string(n) + " workers x " +
                                     std::to_string(per_worker) + " GPUs, but " +
                                     std::to_string(gpus.size()) + " are visible (" + Join(gpus) +
                                     ")" + how_to_simulate);
    }
    for (int r = 0; r < n; ++r) {
      for (int g = 0; g < per_worker; ++g) devices[r].push_back(gpus[r * per_worker + g]);
    }
    plan.platform = "cuda";
  }

  const std::string hostname = host.GetEnv("HOSTNAME").value_or("localhost");
  for (int r = 0; r < n; ++r) {
    WorkerPlacement w;
    w.rank = r;
    w.local_rank = r;
    w.local_world_size = n;
    w.node_rank = 0;
    w.host = hostname;
    w.devices = devices[r];
    if (plan.platform == "cpu") {
      if (plan.simulated) {
        w.env["JAX_PLATFORMS"] = "cpu";  // whatever the user set for the real hardware
      } else {
        SetUnlessUserSet(host, &w.env, "JAX_PLATFORMS", "cpu");
      }
      SetUnlessUserSet(host, &w.env, "JAX_NUM_CPU_DEVICES", "1");
      SetUnlessUserSet(host, &w.env, "JAX_CPU_COLLECTIVES_IMPLEMENTATION", "gloo");
    } else if (plan.platform == "cuda") {
      SetUnlessUserSet(host, &w.env, "JAX_PLATFORMS", "cuda");
      w.env["CUDA_VISIBLE_DEVICES"] = Join(w.devices);
    } else {
      SetUnlessUserSet(host, &w.env, "JAX_PLATFORMS", "tpu");
      w.env["TPU_VISIBLE_CHIPS"] = Join(w.devices);
    }
    plan.workers.push_back(std::move(w));
  }
  return plan;
}

}  // namespace jaxtrain::placement
