// Placement: a ScalingConfig and a description of the hosts (hosts.h) become a Plan: for every
// rank, the host it runs on, the devices it owns and the environment it starts with.
// All-or-nothing: a plan is returned whole or an error says why it cannot be made.
//
// Rules (docs/accelerators.md has the full contract):
//   * TPU with a topology: whole slices only. num_workers / workers_per_slice slices whose pod
//     type, topology, host count and chips per host match are taken, in the order the description
//     lists them; ranks fill one slice after the other (each slice a contiguous rank range), its
//     hosts in worker-id order, and each host's chips in groups of resources_per_worker["TPU"].
//   * GPU, CPU and TPU without a topology: workers per host by placement_strategy (PACK fills
//     hosts in order, SPREAD deals one worker per host in turn, STRICT_PACK one host for all,
//     STRICT_SPREAD one host each), limited by a host's GPUs or chips and its described CPUs;
//     ranks are contiguous per host. A TPU worker without a topology takes a whole host unless
//     resources_per_worker["TPU"] was given. A TPU slice plan that contradicts STRICT_PACK or
//     STRICT_SPREAD is refused.
//   * The environment is computed from the plan alone; an inherited value is only kept for
//     JAX_PLATFORMS, JAX_NUM_CPU_DEVICES, JAX_CPU_COLLECTIVES_IMPLEMENTATION (the user's choice)
//     and MEGASCALE_PORT. Stale TPU variables the plan does not set are listed in unset_env.
// Pure functions; thread-safe.
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>

#include "accelerators/discovery.h"
#include "base/status.h"
#include "config/scaling_config.h"
#include "placement/hosts.h"

namespace jaxtrain::placement {

// The environment variable that runs a TPU or GPU ScalingConfig on local CPU processes.
inline constexpr char kSimulateEnv[] = "JAXTRAIN_SIMULATE";

// The variables of a plan's environment that may differ between ranks placed by an engine
// (PlanForScheduler for a simulated TPU config): the launcher passes each rank its own.
inline const std::set<std::string> kPerRankPlacementVariables = {
    "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "TPU_VISIBLE_CHIPS", "MEGASCALE_SLICE_ID"};

struct WorkerPlacement {
  int rank = 0;
  int local_rank = 0;                // index among the workers of its host
  int local_world_size = 0;          // workers on its host
  int node_rank = 0;                 // index of its host, in the order of the hosts' first ranks
  std::string host;                  // Host::name
  std::string address;               // Host::address
  std::string slice;                 // the TPU slice it runs in; empty without one
  std::vector<std::string> devices;  // accelerator ids this rank owns on its host
  std::map<std::string, std::string> env;  // set in the worker's environment
  std::vector<std::string> unset_env;      // removed from the inherited environment first
};

struct Plan {
  std::string platform;                  // what JAX runs on: "cpu", "tpu" or "cuda"
  std::string accelerator;               // what the plan was made for: "tpu", "gpu" or "cpu"
  bool simulated = false;                // TPU or GPU workers run as CPU processes
  std::string hosts_source;              // HostDescription::source
  int num_slices = 0;                    // TPU slices used; 0 without a topology
  std::vector<WorkerPlacement> workers;  // indexed by rank
};

// Plans `config` over `hosts`. `inherited` is the driver's environment, which every worker
// inherits. With `simulate`, the workers are planned exactly as for the hardware, but JAX runs on
// CPU: JAX_PLATFORMS=cpu, one CPU device and gloo collectives; the TPU and GPU variables stay
// set for the worker to inspect (CPU JAX ignores them).
// Errors: kInvalidArgument for a GPU or TPU count per worker that is not a whole number >= 1;
// kFailedPrecondition when the hosts cannot hold the workers (too few matching slices, GPUs,
// chips or CPUs; a strategy they cannot satisfy): the message names what was asked for and what
// each host or slice offers.
StatusOr<Plan> PlanOnHosts(const config::ScalingConfig& config, const HostDescription& hosts,
                           const Environment& inherited, bool simulate);

// Plans `config` for the local launcher. The hosts are those of the file named by JAXTRAIN_HOSTS
// when it is set; otherwise, with JAXTRAIN_SIMULATE=1 and a TPU or GPU config, the simulated hosts
// (SimulatedHosts); otherwise this machine (DescribeThisHost).
// Errors: those of LoadHostDescription and PlanOnHosts; kFailedPrecondition when this machine
// lacks the accelerators asked for (the message names what was looked for and the simulate
// switch), and, without the simulate switch, when the plan puts a worker on another host (the
// local launcher starts processes on this machine only).
StatusOr<Plan> PlanLocal(const config::ScalingConfig& config, const accelerators::HostView& host);

// The plan for an engine that places the ranks itself (Slurm, Kubernetes): the world size and one
// environment for every rank (JAX_PLATFORMS, and for CPU one device and gloo collectives, unless
// `host` sets them); no host, local rank or device is assigned. With the simulate switch any
// ScalingConfig runs as CPU processes, as for local runs; a simulated TPU config's ranks get the
// environment PlanLocal gives them on the simulated hosts (TPU_WORKER_ID, TPU_WORKER_HOSTNAMES,
// TPU_ACCELERATOR_TYPE, TPU_TOPOLOGY, ...), which differs between ranks: the launcher passes each
// rank its own (launch::UniformGroup::rank_env). Errors: those of PlanOnHosts for a simulated TPU
// config; never otherwise today, a StatusOr so that engines may refuse shapes later.
StatusOr<Plan> PlanForScheduler(const config::ScalingConfig& config,
                                const accelerators::HostView& host);

}  // namespace jaxtrain::placement
