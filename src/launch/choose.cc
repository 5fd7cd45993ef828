#include "launch/choose.h"

#include <array>
#include <string>
#include <utility>

#include "launch/ssh_launcher.h"

namespace jaxtrain::launch {
namespace {

constexpr std::array<std::pair<std::string_view, LauncherKind>, 4> kKinds = {{
    {"local", LauncherKind::kLocal},
    {"ssh", LauncherKind::kSsh},
    {"slurm", LauncherKind::kSlurm},
    {"kubernetes", LauncherKind::kKubernetes},
}};

}  // namespace

std::string_view LauncherKindName(LauncherKind kind) {
  for (const auto& [name, k] : kKinds) {
    if (k == kind) return name;
  }
  return "unknown";
}

StatusOr<LauncherKind> ParseLauncherKind(std::string_view name, std::string_view field) {
  for (const auto& [n, kind] : kKinds) {
    if (n == name) return kind;
  }
  return InvalidArgumentError(std::string(field) + "='" + std::string(name) +
                              "' is not allowed; use local, ssh, slurm or kubernetes");
}

StatusOr<LauncherKind> ChooseLauncher(const accelerators::HostView& env) {
  std::string kind = env.GetEnv(kLauncherEnv).value_or("");
  if (!kind.empty() && kind != "auto") {
    auto parsed = ParseLauncherKind(kind, kLauncherEnv);
    if (parsed.ok()) return parsed;
    return InvalidArgumentError(std::string(kLauncherEnv) + "='" + kind +
                                "' is not allowed; use local, slurm, ssh, kubernetes or auto (the "
                                "default: ssh when hosts are listed, slurm inside a Slurm "
                                "allocation, local elsewhere)");
  }
  for (const char* hosts : {kSshHostsEnv, kHostfileEnv}) {
    auto listed = env.GetEnv(hosts);
    if (listed && !listed->empty()) return LauncherKind::kSsh;
  }
  auto job = env.GetEnv("SLURM_JOB_ID");
  return job && !job->empty() ? LauncherKind::kSlurm : LauncherKind::kLocal;
}

}  // namespace jaxtrain::launch
