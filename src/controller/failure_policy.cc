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

// Why retrying a storage failure with `code` cannot help, in the user's words (the code itself
// is in run.json's failure.status_code and said by a verbose run).
std::string_view Why(StatusCode code) {
  switch (code) {
    case StatusCode::kPermissionDenied: return "a permission is missing";
    case StatusCode::kInvalidArgument: return "what was asked is not valid";
    case StatusCode::kFailedPrecondition: return "the run directory is not in a state to allow it";
    case StatusCode::kAlreadyExists: return "something is already in the way";
    case StatusCode::kNotFound: return "something it needs is not there";
    case StatusCode::kUnauthenticated: return "the credentials were refused";
    case StatusCode::kDataLoss: return "data is lost or damaged";
    case StatusCode::kDeadlineExceeded: return "it timed out";
    default: return "the error is not one that passes";
  }
}

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
                .reason = "retrying cannot help (" + std::string(Why(code)) + ")"};
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
