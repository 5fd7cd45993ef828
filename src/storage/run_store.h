// RunStore: the run directory of one run, as laid out in docs/architecture.md:
//
//   <storage_path>/<name>/
//     run.json        config, attempts, status; rewritten atomically
//     result.jsonl    one line per report round: {"round", "time", "metrics"} (rank 0's metrics)
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
  std::string LogPath(int rank) const;

  // Rewrites run.json atomically.
  Status WriteRunState(const nlohmann::json& state);

  // Appends one report round (rank 0's metrics, a JSON object) to result.jsonl and progress.csv.
  // progress.csv takes its columns from the first round it sees; nested objects are flattened
  // with '/'; later keys that are not columns appear only in result.jsonl.
  // Errors: kInvalidArgument when `metrics_json` is not a JSON object.
  Status AppendRound(uint64_t round, double unix_time, std::string_view metrics_json);

  Status WriteError(std::string_view text);

 private:
  explicit RunStore(std::string dir) : dir_(std::move(dir)) {}

  std::string dir_;
  std::vector<std::string> csv_columns_;
};

}  // namespace jaxtrain::storage
