// Which launcher starts a run's workers: chosen once, from the driver's environment, and named by
// a LauncherKind from then on. Each launcher's home is its own pair of files here
// (local_launcher, ssh_launcher, slurm_launcher, kubernetes_launcher) and the Python module of
// the same name in python/jaxtrain/launch/.
#pragma once

#include <string_view>

#include "accelerators/discovery.h"
#include "base/status.h"

namespace jaxtrain::launch {

inline constexpr char kLauncherEnv[] = "JAXTRAIN_LAUNCHER";  // local|slurm|ssh|kubernetes|auto

enum class LauncherKind { kLocal, kSsh, kSlurm, kKubernetes };

// "local", "ssh", "slurm" or "kubernetes".
std::string_view LauncherKindName(LauncherKind kind);

// The kind named `name` (LauncherKindName's words). `field` names the setting in errors.
// Errors: kInvalidArgument for any other name, saying which are allowed.
StatusOr<LauncherKind> ParseLauncherKind(std::string_view name, std::string_view field);

// JAXTRAIN_LAUNCHER when set to a launcher's name; otherwise ("auto" or unset) ssh when
// JAXTRAIN_SSH_HOSTS or JAXTRAIN_HOSTFILE lists hosts (ssh_launcher.h), slurm inside a Slurm
// allocation (SLURM_JOB_ID set) and local elsewhere. Kubernetes is never chosen by itself: a
// driver pod may well run its workers locally.
// Errors: kInvalidArgument for any other value of JAXTRAIN_LAUNCHER.
StatusOr<LauncherKind> ChooseLauncher(const accelerators::HostView& env);

}  // namespace jaxtrain::launch
