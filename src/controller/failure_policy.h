// FailurePolicy: after a failed attempt, restart the worker group or give up. Pure; not
// thread-safe (owned by the controller's loop).
//
// Training failures (an exception, a signal, an exit, a lost connection, a watchdog timeout)
// count against max_failures; start-up failures (a group that could not start) against their own
// budget, max_start_failures; -1 means without limit. A failure whose cause says that retrying
// cannot help ("checkpoint": two ranks wrote the same file) is never retried.
#pragma once

#include <string>

namespace jaxtrain::controller {

class FailurePolicy {
 public:
  FailurePolicy(int max_failures, int max_start_failures)
      : max_failures_(max_failures), max_start_failures_(max_start_failures) {}

  // Counts a failure with this cause; true when the group should be restarted.
  bool ShouldRestart(const std::string& cause);

  int failures() const { return failures_; }
  int start_failures() const { return start_failures_; }

 private:
  int max_failures_;
  int max_start_failures_;
  int failures_ = 0;
  int start_failures_ = 0;
};

}  // namespace jaxtrain::controller
