// Placement: a ScalingConfig and a description of the host(s) become a Plan: for every rank, where
// it runs, which devices it owns and the environment it starts with. All-or-nothing: a plan is
// returned whole or an error says why it cannot be made. Pure functions; thread-safe.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "accelerators/discovery.h"
#include "base/status.h"
#include "config/scaling_config.h"

namespace jaxtrain::placement {

// The environment variable that runs a TPU or GPU ScalingConfig on local CPU processes.
inline constexpr char kSimulateEnv[] = "JAXTRAIN_SIMULATE";

struct WorkerPlacement {
  int rank = 0;
  int local_rank = 0;
  int local_world_size = 0;
  int node_rank = 0;
  std::string host;
  std::vector<std::string> devices;        // accelerator ids this rank owns
  std::map<std::string, std::string> env;  // set in the worker's environment
};

struct Plan {
  std::string platform;  // what JAX runs on: "cpu", "tpu" or "cuda"
  bool simulated = false;
  std::vector<WorkerPlacement> workers;  // indexed by rank
};

// Plans `config` on this one host.
// With JAXTRAIN_SIMULATE=1 in the host's environment, TPU and GPU configurations run as CPU
// processes with the same world size.
// Errors: kFailedPrecondition when the host lacks the accelerators asked for (the message names
// what was looked for and the simulate switch), or has too few of them.
StatusOr<Plan> PlanLocal(const config::ScalingConfig& config, const accelerators::HostView& host);

}  // namespace jaxtrain::placement
