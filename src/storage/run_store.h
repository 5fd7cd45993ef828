// RunStore: the run directory of one run, as laid out in docs/architecture.md:
//
//   <storage_path>/<name>/
//     run.json        config, attempts, status; rewritten atomically
//     result.jsonl    one line per report round: {"round", "time", "metrics", ["checkpoint"]}
//     progress.csv    the same, flat, for spreadsheets: jaxtrain's columns "jaxtrain/round" and
//                     "jaxtrain/time" first, then the metrics (nested keys joined with '/')
//     logs/rank-<r>.log
//     error.txt       on failure: the first failing rank's traceback
//     LOCK            held by the driver that has the run open; says which one (host, pid)
//     LEASE           the same driver's heartbeat: host, pid, and the time it last wrote it
//
// One writer per run directory (LevelDB's LOCK file): Open() takes a lock on LOCK and the store
// keeps it until Unlock() or destruction, so a second driver of the same run is refused instead
// of sweeping the first one's files. The lock is an open-file-description lock (fcntl
// F_OFD_SETLK): the kernel drops it when its holder dies, however it dies, so a lock left by a
// killed driver is simply taken over; it conflicts within one process too; it works on NFS
// (where it becomes a POSIX lock on the server); and LockHolder() can ask who holds it without
// taking it, so `jaxtrain ls` never blocks a driver that starts at the same moment.
//
// Locks do not cross hosts everywhere: on FUSE mounts (GCS FUSE, s3fs), NFS mounted `nolock` and
// Lustre with `localflock` each host sees only its own. The lease covers those: while the store
// is open, a thread of its own rewrites LEASE (atomically, by rename) every kLeasePeriod with the
// current time, and Unlock() removes it. A lease is live (LeaseIsLive) when it names another
// process and was written less than kLeaseStaleAfter ago by the reader's clock, unless it names a
// process of this host that no longer exists; Open() refuses a run whose lease is live even when
// the lock was free, and LockHolder() reports its writer as holding the run. The hosts' clocks
// must agree to well within kLeaseStaleAfter; a driver whose storage cannot be written for that
// long may be taken over.
//
// Owned by the controller's event loop; not thread-safe (the lease's thread touches only its own
// state).
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace jaxtrain::storage {

// How often an open store rewrites its LEASE, and how old a lease may be and still count.
inline constexpr double kLeasePeriodSeconds = 10;
inline constexpr double kLeaseStaleAfterSeconds = 60;

// What a LEASE says: which driver holds the run, since when, and when it last said so (Unix
// seconds by the writer's clock).
struct Lease {
  std::string host;
  int64_t pid = 0;
  double since = 0;
  double heartbeat = 0;
};

// The lease of `text` (LEASE's contents), or nullopt when it is not one.
std::optional<Lease> ParseLease(std::string_view text);

// The liveness rule (see above), as a function: whether `lease` shows another driver that may
// still hold the run, read on `this_host` by process `this_pid` at `now` (Unix seconds);
// `process_exists` says whether a pid of this host is running.
bool LeaseIsLive(const Lease& lease, double now, std::string_view this_host, int64_t this_pid,
                 bool (*process_exists)(int64_t pid));

// progress.csv's own columns. Users' metrics never take these names: report() refuses a
// top-level key "jaxtrain" or one that starts with "jaxtrain/" (python/jaxtrain/records.py).
inline constexpr std::string_view kRoundColumn = "jaxtrain/round";
inline constexpr std::string_view kTimeColumn = "jaxtrain/time";

class LeaseKeeper;

class RunStore {
 public:
  // Creates the directory and logs/ if needed, checks that files can be written there and takes
  // the run's lock, writing this driver's host and pid into LOCK.
  // Errors: kFailedPrecondition when another driver holds the lock or a live lease (the message
  // names its host and pid); kPermissionDenied / kFailedPrecondition / kResourceExhausted /
  // kInternal naming the path and the reason (storage/files.h).
  static StatusOr<RunStore> Open(std::string run_dir);

  // Who holds the run in `run_dir`: "host H, pid P, since <UTC time>" (as LOCK says) when a
  // process holds its lock, else the writer of a live lease ("..., lease renewed N s ago"), or
  // nullopt when neither (no LOCK, its driver is gone, its lease stale). Thread-safe.
  // Errors: kPermissionDenied / kInternal when LOCK exists but cannot be opened or queried.
  static StatusOr<std::optional<std::string>> LockHolder(const std::string& run_dir);

  RunStore(RunStore&& other) noexcept;
  RunStore& operator=(RunStore&& other) noexcept;
  RunStore(const RunStore&) = delete;
  RunStore& operator=(const RunStore&) = delete;
  ~RunStore();  // releases the lock

  // Releases the lock and removes the lease: the run's last record is written and another
  // driver may open the run.
  void Unlock();

  const std::string& dir() const { return dir_; }

  // What LOCK said when Open() found it free: the driver that had the run open before this one
  // ("host H, pid P, since T"), or "" for a new LOCK. When run.json still says RUNNING, that
  // driver ended without recording how its attempt ended.
  const std::string& previous_holder() const { return previous_holder_; }

  // For a resumed run: the last round in result.jsonl (0 if none) and the previous run.json
  // (null if none or unreadable).
  uint64_t LastRound() const;
  nlohmann::json PreviousRunState() const;
  std::string LogPath(int rank) const;

  // Rewrites run.json atomically. Errors: as WriteFileAtomically (storage/files.h).
  Status WriteRunState(const nlohmann::json& state);

  // Appends one report round (rank 0's metrics, a JSON object, and the checkpoint committed in
  // the round, if any) to result.jsonl and progress.csv. progress.csv takes its columns from the
  // first round it sees; nested objects are flattened with '/'; later keys that are not columns
  // appear only in result.jsonl. A round is recorded in both files or in neither: on error, what
  // was appended is cut off again. Errors: kInvalidArgument when `metrics_json` is not an object;
  // as AppendToFile (storage/files.h) when a file cannot be written, e.g. kResourceExhausted for
  // a full disk.
  Status AppendRound(uint64_t round, double unix_time, std::string_view metrics_json,
                     std::string_view checkpoint_dir_name = "");

  Status WriteError(std::string_view text);

 private:
  explicit RunStore(std::string dir);

  std::string dir_;
  int lock_fd_ = -1;
  std::unique_ptr<LeaseKeeper> lease_;  // set while the lock is held
  std::string previous_holder_;
  std::vector<std::string> csv_columns_;
};

}  // namespace jaxtrain::storage
