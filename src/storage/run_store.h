// RunStore: the run directory of one run, as laid out in docs/architecture.md:
//
//   <storage_path>/<name>/
//     run.json        config, attempts, status; rewritten atomically
//     result.jsonl    one line per report round: {"round", "time", "metrics", ["checkpoint"]}
//     progress.csv    the same, flat, for spreadsheets
//     logs/rank-<r>.log
//     error.txt       on failure: the first failing rank's traceback
//
// Owned by the controller's event loop; not thread-safe.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/status.h"

namespace jaxtrain::storage {

class RunStore {
 public:
  // Creates the directory and logs/ if needed and checks that files can be written there.
  // Errors: kPermissionDenied / kFailedPrecondition / kInternal naming the path and the reason.
  static StatusOr<RunStore> Open(std::string run_dir);

  const std::string& dir() const { return dir_; }

  // For a resumed run: the last round in result.jsonl (0 if none) and the previous run.json
  // (null if none or unreadable).
  uint64_t LastRound() const;
  nlohmann::json PreviousRunState() const;
  std::string LogPath(int rank) const;

  // Rewrites run.json atomically.
  Status WriteRunState(const nlohmann::json& state);

  // Appends one report round (rank 0's metrics, a JSON object, and the checkpoint committed in
  // the round, if any) to result.jsonl and progress.csv. progress.csv takes its columns from the
  // first round it sees; nested objects are flattened with '/'; later keys that are not columns
  // appear only in result.jsonl. Errors: kInvalidArgument when `metrics_json` is not an object.
  Status AppendRound(uint64_t round, double unix_time, std::string_view metrics_json,
                     std::string_view checkpoint_dir_name = "");

  Status WriteError(std::string_view text);

  // Appends a line to every rank's log (e.g. the start of a new attempt).
  Status AppendToLogs(int world_size, std::string_view line) const;

 private:
  explicit RunStore(std::string dir) : dir_(std::move(dir)) {}

  std::string dir_;
  std::vector<std::string> csv_columns_;
};

}  // namespace jaxtrain::storage
