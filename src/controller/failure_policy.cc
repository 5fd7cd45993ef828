#include "controller/failure_policy.h"

namespace jaxtrain::controller {

std::string_view FailureCauseName(FailureCause cause) {
  switch (cause) {
    case FailureCause::kException: return "exception";
    case FailureCause::kExit: return "exit";
    case FailureCause::kSignal: return "signal";
    case FailureCause::kOom: return "oom";
    case FailureCause::kConnection: return "connection";
    case FailureCause::kWatchdog: return "watchdog";
    case FailureCause::kStartUp: return "start-up";
    case FailureCause::kCheckpoint: return "checkpoint";
    case FailureCause::kStorage: return "storage";
    case FailureCause::kDriver: return "driver";
    case FailureCause::kPreemption: return "preemption";
  }
  return "unknown";
}

std::string_view FailureActionName(FailureDecision::Action action) {
  return action == FailureDecision::Action::kRetry ? "retry" : "raise";
}

bool IsTrainingFailure(FailureCause cause) {
  switch (cause) {
    case FailureCause::kException:
    case FailureCause::kExit:
    case FailureCause::kSignal:
    case FailureCause::kOom:
    case FailureCause::kConnection:
    case FailureCause::kWatchdog: return true;
    case FailureCause::kStartUp:
    case FailureCause::kCheckpoint:
    case FailureCause::kStorage:
    case FailureCause::kDriver:
    case FailureCause::kPreemption: return false;
  }
  return false;
}

bool IsTransientStorageError(StatusCode code) {
  return code == StatusCode::kResourceExhausted || code == StatusCode::kUnavailable;
}

namespace {

// Counts one failure against `max` (-1 = without limit), named `budget` in the reason.
FailureDecision Count(int& used, int max, std::string_view budget) {
  ++used;
  const std::string of = max < 0 ? " (" + std::string(budget) + " = -1: without limit)"
                                 : " of " + std::to_string(max) + " (" + std::string(budget) + ")";
  if (max < 0 || used <= max) {
    return {.action = FailureDecision::Action::kRetry,
            .reason = "restart " + std::to_string(used) + of};
  }
  return {.action = FailureDecision::Action::kRaise,
          .reason = "failure " + std::to_string(used) + ", over the " + std::to_string(max) +
                    " restarts that " + std::string(budget) + " allows"};
}

}  // namespace

FailureDecision FailurePolicy::Decide(FailureCause cause, StatusCode code) {
  switch (cause) {
    case FailureCause::kStartUp:
      return Count(start_failures_, max_start_failures_, "FailureConfig.controller_failure_limit");
    case FailureCause::kStorage:
    case FailureCause::kCheckpoint:
      if (!IsTransientStorageError(code)) {
        return {.action = FailureDecision::Action::kRaise,
                .reason = "retrying cannot help (" + std::string(StatusCodeName(code)) + ")"};
      }
      return Count(storage_failures_, max_storage_failures_, "the storage retry limit");
    case FailureCause::kDriver:
      return {.action = FailureDecision::Action::kRaise, .reason = "the driver itself failed"};
    case FailureCause::kPreemption:
      return Count(preemptions_, max_preemptions_, "FailureConfig.max_preemption_failures");
    case FailureCause::kException:
    case FailureCause::kExit:
    case FailureCause::kSignal:
    case FailureCause::kOom:
    case FailureCause::kConnection:
    case FailureCause::kWatchdog: break;  // IsTrainingFailure(cause)
  }
  return Count(failures_, max_failures_, "FailureConfig.max_failures");
}

}  // namespace jaxtrain::controller
