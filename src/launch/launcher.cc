#include "launch/launcher.h"

namespace jaxtrain::launch {

StatusOr<UniformGroup> MergeUniform(const std::vector<ProcessSpec>& specs,
                                    const std::set<std::string>& per_rank,
                                    std::string_view engine) {
  if (specs.empty()) return InvalidArgumentError("no processes to launch");
  const ProcessSpec& first = specs.front();
  UniformGroup group{.argv = first.argv, .cwd = first.cwd, .secret = first.secret};
  for (const auto& spec : specs) {
    if (spec.argv != first.argv || spec.cwd != first.cwd || spec.secret != first.secret) {
      return InvalidArgumentError("the " + std::string(engine) +
                                  " launcher runs one command for every rank; the ranks' commands "
                                  "or working directories differ");
    }
    group.unset_env.insert(spec.unset_env.begin(), spec.unset_env.end());
    std::set<std::string> names;
    for (const auto& [k, v] : spec.env) names.insert(k);
    for (const auto& [k, v] : first.env) names.insert(k);
    for (const auto& name : names) {
      if (per_rank.count(name)) continue;
      auto a = first.env.find(name);
      auto b = spec.env.find(name);
      if (a == first.env.end() || b == spec.env.end() || a->second != b->second) {
        return InvalidArgumentError("the environment variable " + name +
                                    " differs between ranks, " + "which one " +
                                    std::string(engine) + " launch cannot give");
      }
    }
    group.ranks.insert(group.ranks.end(), spec.ranks.begin(), spec.ranks.end());
  }
  for (const auto& [k, v] : first.env) {
    if (!per_rank.count(k)) group.env[k] = v;
  }
  return group;
}

}  // namespace jaxtrain::launch
