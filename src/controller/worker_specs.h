// The processes of a run's worker group: one launch::ProcessSpec per rank of a placement plan,
// made by a pure function (no clock, files or network), so that it is tested alone and called
// again for each attempt.
//
// Each worker's environment is, from the bottom: the launcher's own, the plan's entries for the
// worker (less those it unsets), then what every worker shares, held once in `shared_env`
// (the run's worker_env, the controller's address, world size, run directory, experiment name,
// platform, and each of JAXTRAIN_LOCAL_RANK, JAXTRAIN_LOCAL_WORLD_SIZE and JAXTRAIN_NODE_RANK that
// all workers have alike), then the per-worker numbers: JAXTRAIN_RANK and those three where they
// differ. A plan's entry of a shared name is overridden by the shared one.
//
// Thread-safe: pure.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "launch/launcher.h"
#include "placement/plan.h"

namespace jaxtrain::controller {

// What every worker of a run is started with, beside its placement.
struct WorkerCommand {
  std::vector<std::string> argv;           // argv[0] is an absolute path
  std::string cwd;                         // "" = the launcher's
  std::map<std::string, std::string> env;  // every worker's (ControllerOptions::worker_env)
  std::string controller_address;          // host:port of the control port
  std::string run_dir;
  std::string experiment_name;
  std::string secret_hex;  // the run's secret, hex (launch::ProcessSpec::secret)
};

struct WorkerSpecs {
  std::vector<launch::ProcessSpec> specs;  // one per worker of the plan, in its order
  // Every spec's shared_env; the controller adds JAXTRAIN_ATTEMPT to it before each attempt.
  std::shared_ptr<std::map<std::string, std::string>> shared_env;
};

WorkerSpecs BuildWorkerSpecs(const placement::Plan& plan, const WorkerCommand& command);

}  // namespace jaxtrain::controller
