// RunConfig: where a run lives (<storage_path>/<name>) and how it is kept and retried.
// Immutable once built; thread-safe.
#pragma once

#include <optional>
#include <string>

#include "base/clock.h"
#include "base/status.h"

namespace jaxtrain::config {

struct RunConfigInput {
  std::optional<std::string> name;          // default: jaxtrain_run-<UTC timestamp>
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

// "jaxtrain_run-2026-12-02_10-36-51" for the clock's current UTC time.
std::string DefaultRunName(const Clock& clock);

}  // namespace jaxtrain::config
