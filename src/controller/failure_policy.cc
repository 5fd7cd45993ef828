#include "controller/failure_policy.h"

namespace jaxtrain::controller {

bool FailurePolicy::ShouldRestart(const std::string& cause) {
  if (cause == "checkpoint") return false;
  if (cause == "start-up") {
    ++start_failures_;
    return max_start_failures_ < 0 || start_failures_ <= max_start_failures_;
  }
  ++failures_;
  return max_failures_ < 0 || failures_ <= max_failures_;
}

}  // namespace jaxtrain::controller
