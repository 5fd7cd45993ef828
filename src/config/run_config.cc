#include "config/run_config.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>

#include "base/strings.h"

namespace jaxtrain::config {

std::string DefaultRunName(const Clock& clock) {
  const double now = clock.UnixSeconds();
  std::time_t t = static_cast<std::time_t>(now);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  size_t n = std::strftime(buf, sizeof(buf), "jaxtrain_run-%Y-%m-%d_%H-%M-%S", &tm);
  // Milliseconds keep names in start order; the random part keeps runs started in the same
  // millisecond (or on other machines sharing the storage) out of each other's directory.
  const int ms = static_cast<int>((now - static_cast<double>(t)) * 1000);
  // A random start per process, then a counter: two names of one process always differ.
  static std::atomic<unsigned> next{std::random_device{}()};
  std::snprintf(buf + n, sizeof(buf) - n, ".%03d-%06x", std::clamp(ms, 0, 999),
                next.fetch_add(1) & 0xffffffu);
  return buf;
}

StatusOr<RunConfig> RunConfig::Create(RunConfigInput in, const Clock& clock) {
  RunConfig c;
  c.name_ = in.name ? *in.name : DefaultRunName(clock);
  if (c.name_.empty() || c.name_ == "." || c.name_ == ".." ||
      c.name_.find('/') != std::string::npos || c.name_.find('\0') != std::string::npos) {
    return InvalidArgumentError("RunConfig.name='" + c.name_ +
                                "' is not allowed; a run name is one directory name: not empty, "
                                "not '.' or '..', without '/'");
  }
  c.storage_path_ = in.storage_path ? *in.storage_path : "~/jaxtrain_results";
  if (c.storage_path_.empty()) {
    return InvalidArgumentError(
        "RunConfig.storage_path='' is not allowed; give a directory (local or shared, e.g. "
        "/mnt/nfs) or leave it unset for ~/jaxtrain_results");
  }
  if (c.storage_path_ == "~" || c.storage_path_.starts_with("~/")) {
    const char* home = std::getenv("HOME");
    c.storage_path_ = std::string(home ? home : "") + c.storage_path_.substr(1);
  }
  return c;
}

StatusOr<CheckpointConfig> CheckpointConfig::Create(CheckpointConfigInput in) {
  if (in.num_to_keep && *in.num_to_keep < 1) {
    return InvalidArgumentError("CheckpointConfig.num_to_keep=" + std::to_string(*in.num_to_keep) +
                                " is not allowed; keep at least 1 checkpoint, or leave it None to "
                                "keep all");
  }
  if (in.checkpoint_score_attribute && in.checkpoint_score_attribute->empty()) {
    return InvalidArgumentError(
        "CheckpointConfig.checkpoint_score_attribute='' is not allowed; name a reported metric "
        "(e.g. 'loss') or leave it None to rank checkpoints by recency");
  }
  if (in.checkpoint_score_order != "max" && in.checkpoint_score_order != "min") {
    return InvalidArgumentError("CheckpointConfig.checkpoint_score_order='" +
                                in.checkpoint_score_order + "' is not allowed; use 'max' or 'min'");
  }
  CheckpointConfig c;
  c.input_ = std::move(in);
  return c;
}

StatusOr<FailureConfig> FailureConfig::Create(FailureConfigInput in) {
  if (in.max_failures < -1) {
    return InvalidArgumentError("FailureConfig.max_failures=" + std::to_string(in.max_failures) +
                                " is not allowed; use 0 (no restarts), a positive number, or -1 "
                                "(restart without limit)");
  }
  if (in.controller_failure_limit < -1) {
    return InvalidArgumentError(
        "FailureConfig.controller_failure_limit=" + std::to_string(in.controller_failure_limit) +
        " is not allowed; use 0, a positive number, or -1 (without limit)");
  }
  if (in.progress_timeout_s &&
      !(*in.progress_timeout_s > 0 && std::isfinite(*in.progress_timeout_s))) {
    return InvalidArgumentError(
        "FailureConfig.progress_timeout_s=" + FormatNumber(*in.progress_timeout_s) +
        " is not allowed; give a number of seconds > 0, or None to turn "
        "the progress watchdog off");
  }
  if (in.progress_timeout_s && in.progress_timeout_auto) {
    return InvalidArgumentError(
        "FailureConfig.progress_timeout_s=" + FormatNumber(*in.progress_timeout_s) +
        " and the automatic limit cannot both be given; give one");
  }
  if (in.max_preemption_failures < -1) {
    return InvalidArgumentError(
        "FailureConfig.max_preemption_failures=" + std::to_string(in.max_preemption_failures) +
        " is not allowed; use 0, a positive number, or -1 (without limit)");
  }
  if (!(in.preemption_grace_s > 0 && std::isfinite(in.preemption_grace_s))) {
    return InvalidArgumentError(
        "FailureConfig.preemption_grace_s=" + FormatNumber(in.preemption_grace_s) +
        " is not allowed; give a number of seconds > 0");
  }
  if (!(in.unreachable_host_timeout_s >= 0 && std::isfinite(in.unreachable_host_timeout_s))) {
    return InvalidArgumentError(
        "FailureConfig.unreachable_host_timeout_s=" + FormatNumber(in.unreachable_host_timeout_s) +
        " is not allowed; give a number of seconds >= 0 (0: a restart "
        "fails at once when a host cannot be reached)");
  }
  FailureConfig c;
  c.input_ = in;
  return c;
}

}  // namespace jaxtrain::config
