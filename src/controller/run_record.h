// RunRecord: the one writer of the run's own records in its directory — run.json (the run's
// state, its rounds and its attempts, earlier runs' of the same directory too), error.txt (the
// failures of a run that failed) and return_value.pkl (rank 0's return value) — and the one shape
// of a failure in them (FailureJson()). It keeps what it last wrote of run.json and the return
// value, which the run's Outcome carries to fit() (python/jaxtrain/result.py), so that the
// driver does not read them back.
// docs/architecture.md ("The run directory") describes both files; python/jaxtrain reads them.
//
// run.json is rewritten whole, atomically (storage::RunStore::WriteRunState), each time: when an
// attempt starts (an attempt that run.json does not show must not run; one whose launch may wait
// in a queue shows as queued, and again once the launch returns, with its queue_wait_s), when its
// stragglers change or its step times are stale, and when the run ends. Attempts that ended are
// kept here (AddAttempt()); the attempt in progress is passed to Write() as it is now.
//
// Threads: the controller's event-loop thread only (Resume() on the thread of Controller::Start,
// before the loop runs).
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/clock.h"
#include "base/status.h"
#include "controller/controller.h"
#include "storage/run_store.h"

namespace jaxtrain::controller {

// run.json's record of a failure: the cause's name and the fields that apply to it.
nlohmann::json FailureJson(const RankFailure& f);

// A failure of the driver's own records (the run directory), blamed on no rank, on this host.
// `why` is the error, whose code FailurePolicy decides from.
RankFailure StorageFailure(const Status& why, std::string message);

// This host's name.
std::string HostName();

class RunRecord {
 public:
  // `store` and `opts` outlive the record. The run's start time is now.
  RunRecord(storage::RunStore& store, const ControllerOptions& opts, const Clock& clock);

  // Takes over the attempts of an earlier run of the directory from its run.json, marking those
  // it shows as RUNNING as CRASHED (that driver ended without recording how); returns how many
  // there were, the number of this run's first attempt.
  int Resume();

  // An attempt ended: `attempt` (Attempt::Record()) joins the attempts.
  void AddAttempt(nlohmann::json attempt) { attempts_.push_back(std::move(attempt)); }

  // Writes run.json as `status` (RUNNING, or how the run ended), with `rounds` recorded and, when
  // not null, `running`: the attempt in progress. Errors: as RunStore::WriteRunState.
  Status Write(std::string_view status, uint64_t rounds, const nlohmann::json& running);

  // An elastic run's resizes so far (docs/elastic.md), written as "resizes"; a run that never
  // calls it writes none.
  void set_resizes(int resizes) { resizes_ = resizes; }

  // run.json as last written; null before it was.
  const nlohmann::json& state() const { return state_; }

  // Rank 0's return value (pickled) as return_value.pkl, replacing an earlier attempt's or run's;
  // none removes it. Errors: as storage::WriteFileAtomically, and storage::PathError's when the
  // file cannot be removed.
  Status WriteReturnValue(const std::optional<std::string>& value);
  // The return value return_value.pkl holds as last written; none when removed or not written.
  const std::optional<std::string>& return_value() const { return return_value_; }

  // How long ago run.json was last written.
  Duration SinceWritten() const { return clock_.Now() - written_; }

  // error.txt: each failure of the run, one line each, then the first one's traceback and the
  // tail of its log. Errors: as RunStore::WriteError.
  Status WriteError(const std::vector<RankFailure>& failures);

 private:
  storage::RunStore& store_;
  const ControllerOptions& opts_;
  const Clock& clock_;
  const double start_time_;
  nlohmann::json attempts_ = nlohmann::json::array();  // earlier runs' too
  TimePoint written_;
  std::optional<int> resizes_;
  nlohmann::json state_;                     // run.json as last written
  std::optional<std::string> return_value_;  // return_value.pkl as last written
};

}  // namespace jaxtrain::controller
