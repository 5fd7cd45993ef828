#include "controller/worker_specs.h"

#include <algorithm>
#include <utility>

namespace jaxtrain::controller {

WorkerSpecs BuildWorkerSpecs(const placement::Plan& plan, const WorkerCommand& command) {
  const auto& workers = plan.workers;
  auto shared = std::make_shared<std::map<std::string, std::string>>(command.env);
  (*shared)["JAXTRAIN_CONTROLLER_ADDR"] = command.controller_address;
  (*shared)["JAXTRAIN_WORLD_SIZE"] = std::to_string(workers.size());
  (*shared)["JAXTRAIN_RUN_DIR"] = command.run_dir;
  (*shared)["JAXTRAIN_EXPERIMENT_NAME"] = command.experiment_name;
  (*shared)["JAXTRAIN_PLATFORM"] = plan.platform;
  // The per-worker numbers too, when every worker has the same (one host: one node, and so on).
  using Worker = placement::WorkerPlacement;
  const std::pair<const char*, int Worker::*> numbers[] = {
      {"JAXTRAIN_LOCAL_RANK", &Worker::local_rank},
      {"JAXTRAIN_LOCAL_WORLD_SIZE", &Worker::local_world_size},
      {"JAXTRAIN_NODE_RANK", &Worker::node_rank}};
  std::vector<std::pair<const char*, int Worker::*>> per_worker = {
      {"JAXTRAIN_RANK", &Worker::rank}};
  for (const auto& [name, field] : numbers) {
    // A copy: clang before 16 cannot capture a structured binding.
    const auto member = field;
    const bool same = std::all_of(workers.begin(), workers.end(), [&](const Worker& w) {
      return w.*member == workers.front().*member;
    });
    if (same && !workers.empty()) {
      (*shared)[name] = std::to_string(workers.front().*field);
    } else {
      per_worker.emplace_back(name, field);
    }
  }

  WorkerSpecs out{.shared_env = shared};
  out.specs.reserve(workers.size());
  for (const Worker& w : workers) {
    launch::ProcessSpec spec;
    spec.ranks = {w.rank};
    spec.argv = command.argv;
    spec.cwd = command.cwd;
    for (const auto& [k, v] : w.env) {
      if (!shared->count(k)) spec.env[k] = v;
    }
    spec.unset_env = w.unset_env;
    spec.shared_env = shared;
    spec.secret = command.secret_hex;
    for (const auto& [name, field] : per_worker) spec.env[name] = std::to_string(w.*field);
    out.specs.push_back(std::move(spec));
  }
  return out;
}

}  // namespace jaxtrain::controller
