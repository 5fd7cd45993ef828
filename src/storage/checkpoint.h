// Checkpoints in the run directory: staging a rank's files, committing a round's checkpoint
// atomically, the index of committed checkpoints, retention, verification.
//
// A checkpoint is committed when its directory appears under its final name in the run directory,
// holding every rank's files and, written last, its manifest (MANIFEST_NAME: files, sizes, CRC-32C
// checksums, round, rank 0's metrics). It appears by one atomic rename, after every file and
// directory in it has been fsynced, so a reader sees all of it or none of it. checkpoints.json is a
// rebuildable index of the committed ones, rewritten atomically; anything under .staging/ is an
// interrupted commit and is swept at the next start.
//
// Layout:  <run>/.staging/a<attempt>-r<round>-rank<r>/...   one rank's staged files
//          <run>/<dir_name>/...  + <run>/<dir_name>/.jaxtrain_manifest.json
//          <run>/checkpoints.json
//
// Functions are thread-safe except that one run directory must have one writer (the controller).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"

namespace jaxtrain::storage {

inline constexpr char kManifestName[] = ".jaxtrain_manifest.json";
inline constexpr char kStagingDir[] = ".staging";

struct FileEntry {
  std::string path;  // relative to the checkpoint directory
  uint64_t size = 0;
  uint32_t crc32c = 0;
};

// Copies every regular file under `src` into `dst` (created), streaming, computing each file's
// CRC-32C on the way, and fsyncs every file and directory written. Symbolic links are followed.
// Errors: kNotFound when `src` does not exist, kInvalidArgument when it is not a directory,
// kPermissionDenied / kInternal naming the file and the reason.
StatusOr<std::vector<FileEntry>> StageDirectory(const std::string& src, const std::string& dst);

// The staging directory of one rank's files for one report round.
std::string StagingPath(const std::string& run_dir, int attempt, uint64_t round, int rank);

struct RankCheckpoint {
  int rank = 0;
  std::string staging_dir;
  std::vector<FileEntry> files;
};

struct CheckpointRecord {
  std::string dir_name;
  uint64_t round = 0;
  double time = 0;
  nlohmann::json metrics;  // rank 0's metrics of the round (non-finite floats as strings)
  uint64_t bytes = 0;
  uint64_t files = 0;
};

// Commits one round's checkpoint as <run_dir>/<dir_name> (replacing a directory of that name
// atomically). Errors: kInvalidArgument for a dir_name that is not one plain directory name,
// for a file written by two ranks (naming both and the file) or for the reserved manifest name;
// kInternal / kPermissionDenied for filesystem failures, naming the path.
StatusOr<CheckpointRecord> CommitCheckpoint(const std::string& run_dir, const std::string& dir_name,
                                            uint64_t round, double time,
                                            const std::string& metrics_json,
                                            const std::vector<RankCheckpoint>& ranks);

// Checks a committed checkpoint against its manifest: every file present with its size, and with
// `checksums` also its CRC-32C. Errors: kDataLoss naming the file and what differs; kNotFound when
// the directory or its manifest is missing.
Status VerifyCheckpoint(const std::string& dir, bool checksums);

// Reads the manifest's record of a committed checkpoint directory.
StatusOr<CheckpointRecord> ReadCheckpointRecord(const std::string& dir);

// The committed checkpoints of a run, oldest first.
class CheckpointIndex {
 public:
  // Loads checkpoints.json and reconciles it with the directory: entries whose directory or
  // manifest is gone are dropped, committed directories missing from the index are added.
  // `warnings` (not null) receives a line for each change. Errors: kDataLoss for an index that
  // cannot be read or parsed.
  static StatusOr<CheckpointIndex> Load(const std::string& run_dir,
                                        std::vector<std::string>* warnings);

  const std::vector<CheckpointRecord>& records() const { return records_; }
  // Adds or replaces (same dir_name) a record as the newest.
  void Add(CheckpointRecord record);
  void Remove(const std::string& dir_name);
  Status Save() const;

 private:
  std::string run_dir_;
  std::vector<CheckpointRecord> records_;
};

struct RetentionPolicy {
  std::optional<int> num_to_keep;
  std::optional<std::string> score_attribute;  // a metric; nested keys joined with '/'
  bool higher_is_better = true;
};

// The checkpoints to delete: all but the best `num_to_keep` by score (or the newest, without a
// score attribute); the newest is never deleted. A checkpoint without the score counts as worst.
std::vector<std::string> SelectForDeletion(const std::vector<CheckpointRecord>& records,
                                           const RetentionPolicy& policy);

// `records` ordered best first by the policy's score (newest first without one).
std::vector<CheckpointRecord> RankByScore(std::vector<CheckpointRecord> records,
                                          const RetentionPolicy& policy);

// Removes a directory tree. Errors: kInternal naming the path.
Status RemoveTree(const std::string& path);

}  // namespace jaxtrain::storage
