// FailurePolicy: after a failed attempt, restart the worker group or give up. Pure; not
// thread-safe (owned by the controller's loop).
//
// The decision is made from the failure's cause and, for the run directory's own errors, from its
// Status code; never from a message. The table (FailurePolicy::Decide):
//
//   cause                                    budget                     when it is spent
//   exception, exit, signal, oom,            max_failures               raise
//   connection, watchdog
//   start-up                                 max_start_failures         raise
//                                            (FailureConfig.controller_failure_limit)
//   preemption (a notice, or a failure       max_preemption_failures    raise
//     during one)                            (default -1)
//   storage, checkpoint with a transient     max_storage_failures       raise
//     code (kResourceExhausted: ENOSPC,      (kMaxStorageFailures = 2)
//     EDQUOT; kUnavailable: EIO)
//   storage, checkpoint with any other code  none: retrying cannot help (a permission, a path
//     (kPermissionDenied, kInvalidArgument,  in the way, ranks that disagree on a checkpoint,
//     kFailedPrecondition, kAlreadyExists..)  a commit that is on disk but not indexed) → raise
//   driver                                   none → raise
//
// -1 means without limit. Each budget counts only its own failures. A full disk or a failing
// storage server may recover (space is freed, the server restarts): such failures are retried a
// few times whatever max_failures says, so that one round that could not be written does not
// end a run that asked for no restarts, and never without bound.
#pragma once

#include <string>
#include <string_view>

#include "base/status.h"

namespace jaxtrain::controller {

enum class FailureCause {
  kException,   // the training function raised
  kExit,        // the process exited before its function returned (RankFailure::exit_code)
  kSignal,      // a signal ended the process (RankFailure::signal)
  kOom,         // SIGKILL while the host was out of memory
  kConnection,  // the control connection closed or broke the protocol
  kWatchdog,    // no report() within the progress timeout
  kStartUp,     // the group could not start (a rank ended or timed out before registering)
  kCheckpoint,  // a round's checkpoint could not be committed (RankFailure::status_code)
  kStorage,     // the run directory could not be written (RankFailure::status_code)
  kDriver,      // an earlier driver of the run ended without recording how (run.json only)
  kPreemption,  // a preemption notice stopped the group, or a failure came while one was open
};

// The name in run.json, error.txt and Python's TrainingFailedError.cause: "exception", "exit",
// "signal", "oom", "connection", "watchdog", "start-up", "checkpoint", "storage", "driver",
// "preemption".
std::string_view FailureCauseName(FailureCause cause);

struct FailureDecision {
  enum class Action { kRetry, kRaise };
  Action action = Action::kRaise;
  std::string
      reason;  // one line: which budget, how much of it is used, or why retrying cannot help
  bool retry() const { return action == Action::kRetry; }
};

std::string_view FailureActionName(FailureDecision::Action action);  // "retry", "raise"

// True for the causes that FailureConfig.max_failures counts: the training function raised or
// its process ended, was killed, lost its connection or made no progress.
bool IsTrainingFailure(FailureCause cause);

// True for the codes of storage errors that may pass: kResourceExhausted, kUnavailable.
bool IsTransientStorageError(StatusCode code);

class FailurePolicy {
 public:
  static constexpr int kMaxStorageFailures = 2;

  FailurePolicy(int max_failures, int max_start_failures,
                int max_storage_failures = kMaxStorageFailures, int max_preemptions = -1)
      : max_failures_(max_failures),
        max_start_failures_(max_start_failures),
        max_storage_failures_(max_storage_failures),
        max_preemptions_(max_preemptions) {}

  // Counts a failure with this cause (and, for kStorage and kCheckpoint, the code of the error
  // behind it) against its budget and decides, as the table above says.
  FailureDecision Decide(FailureCause cause, StatusCode code = StatusCode::kOk);

  int failures() const { return failures_; }
  int start_failures() const { return start_failures_; }
  int storage_failures() const { return storage_failures_; }
  int preemptions() const { return preemptions_; }

 private:
  int max_failures_;
  int max_start_failures_;
  int max_storage_failures_;
  int max_preemptions_;
  int failures_ = 0;
  int start_failures_ = 0;
  int storage_failures_ = 0;
  int preemptions_ = 0;
};

}  // namespace jaxtrain::controller
