#include "config/run_config.h"

#include <cstdlib>
#include <ctime>

namespace jaxtrain::config {

std::string DefaultRunName(const Clock& clock) {
  std::time_t t = static_cast<std::time_t>(clock.UnixSeconds());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof(buf), "jaxtrain_run-%Y-%m-%d_%H-%M-%S", &tm);
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

}  // namespace jaxtrain::config
