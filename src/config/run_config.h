// RunConfig: where a run lives (<storage_path>/<name>) and how it is kept and retried.
// Immutable once built; thread-safe.
#pragma once

#include <optional>
#include <string>

#include "base/clock.h"
#include "base/status.h"

namespace jaxtrain::config {

struct RunConfigInput {
  std::optional<std::string> name;          // default: DefaultRunName()
  std::optional<std::string> storage_path;  // default: ~/jaxtrain_results
};

class RunConfig {
 public:
  // Fills in the defaults and validates.
  // Errors: kInvalidArgument when name is empty, ".", "..", or contains '/' or a NUL; when
  // storage_path is empty.
  static StatusOr<RunConfig> Create(RunConfigInput input, const Clock& clock = RealClock());

  const std::string& name() const { return name_; }
  // As given or defaulted, with a leading "~" expanded; not made absolute.
  const std::string& storage_path() const { return storage_path_; }

 private:
  std::string name_;
  std::string storage_path_;
};

// How many checkpoints to keep, and which are best.
struct CheckpointConfigInput {
  std::optional<int> num_to_keep;                         // all when unset
  std::optional<std::string> checkpoint_score_attribute;  // a reported metric; '/' for nesting
  std::string checkpoint_score_order = "max";             // "max" or "min"
};

class CheckpointConfig {
 public:
  // Errors: kInvalidArgument for num_to_keep < 1, an empty score attribute, or a score order
  // other than "max" / "min".
  static StatusOr<CheckpointConfig> Create(CheckpointConfigInput input);
  const CheckpointConfigInput& input() const { return input_; }
  bool higher_is_better() const { return input_.checkpoint_score_order == "max"; }

 private:
  CheckpointConfigInput input_;
};

// How many times a failed worker group is restarted: training failures and start-up failures (a
// group that could not start) have separate budgets.
struct FailureConfigInput {
  int max_failures = 0;              // -1: without limit
  int controller_failure_limit = 3;  // start-up failures; -1: without limit
  // The progress watchdog: a rank alive but without a report() for this long has failed.
  std::optional<double> progress_timeout_s;  // off when unset, unless progress_timeout_auto
  // The automatic limit (controller/watchdog.h), with progress_timeout_s unset: Python's default
  // progress_timeout_s="auto".
  bool progress_timeout_auto = false;
  // Preemptions (docs/preemption.md) have a budget of their own; -1: without limit.
  int max_preemption_failures = -1;
  // How long a preempted group may go on after the notice when the notice names no deadline.
  double preemption_grace_s = 30;
  // How long a restart waits for a host it cannot reach (ssh hosts: down, rebooting, its network
  // cut), probing with backoff, before the start fails; 0: it fails at the first probe.
  double unreachable_host_timeout_s = 300;
};

class FailureConfig {
 public:
  // Errors: kInvalidArgument for max_failures, controller_failure_limit or
  // max_preemption_failures < -1, a progress_timeout_s or preemption_grace_s that is not a
  // positive number, a progress_timeout_s together with progress_timeout_auto, or an
  // unreachable_host_timeout_s that is negative or not finite.
  static StatusOr<FailureConfig> Create(FailureConfigInput input);
  int max_failures() const { return input_.max_failures; }
  int controller_failure_limit() const { return input_.controller_failure_limit; }
  std::optional<double> progress_timeout_s() const { return input_.progress_timeout_s; }
  bool progress_timeout_auto() const { return input_.progress_timeout_auto; }
  int max_preemption_failures() const { return input_.max_preemption_failures; }
  double preemption_grace_s() const { return input_.preemption_grace_s; }
  double unreachable_host_timeout_s() const { return input_.unreachable_host_timeout_s; }

 private:
  FailureConfigInput input_;
};

// "jaxtrain_run-2026-12-02_10-36-51.042-3fa9c1" for the clock's current UTC time (to the
// millisecond), and 24 random bits: a new name for every call.
std::string DefaultRunName(const Clock& clock);

}  // namespace jaxtrain::config
