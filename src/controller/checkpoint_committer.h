// CheckpointCommitter: commits report rounds' checkpoints on its own thread, one at a time, so
// that the controller's event loop never waits on the filesystem for a commit.
//
// A commit is what storage/checkpoint.h describes (the staged parts checked, merged by renames,
// each file and directory fsynced, the manifest written last, one atomic rename into place), then
// the index checkpoints.json updated and retention applied: the index is saved before any
// directory is deleted, so it never names a deleted checkpoint. Retention scores each checkpoint
// with what its validation returned and keeps those whose validation is pending
// (storage::ApplyValidations). A process killed during a commit
// leaves its work under .staging/ only, which the next attempt or run sweeps: a reader sees the
// checkpoint whole or not at all.
//
// Ownership and threads: the committer owns the run's CheckpointIndex and one thread. One thread
// (the controller's event loop) calls every method; the commit runs on the committer's thread.
// When a commit ends, ready_fd() becomes readable and TakeResult() returns how it ended, so the
// loop learns of it through poll() like of any other event.
//
// Back-pressure: at most one commit is in flight. Submit() refuses a second one until the loop
// has taken the first one's result; the loop holds a later round until then (and the workers wait
// for the previous commit before they snapshot the next checkpoint, docs/architecture.md).
//
//   idle ──Submit()──> committing ──commit ends (ready_fd readable)──> done ──TakeResult()──> idle
//
// The destructor finishes a commit in flight before it returns: a commit is never cut short.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "base/clock.h"
#include "base/mailbox.h"
#include "base/mutex.h"
#include "base/status.h"
#include "storage/checkpoint.h"

namespace jaxtrain::controller {

class CheckpointCommitter {
 public:
  // One round's checkpoint.
  struct Job {
    uint64_t round = 0;
    std::string dir_name;
    std::string metrics_json;  // rank 0's metrics of the round
    std::vector<storage::RankCheckpoint> parts;
  };

  struct Result {
    uint64_t round = 0;
    StatusOr<storage::CheckpointRecord> record;  // not ok: nothing of the round is visible
    Status index;  // not ok: the checkpoint is committed, but checkpoints.json is not updated
    std::vector<std::string> warnings;  // one line per checkpoint that retention could not delete
  };

  // Commits `job` as <run_dir>/<dir_name> stamped with `time`; storage::CommitCheckpoint by
  // default, replaced in tests. Errors: as storage::CommitCheckpoint.
  using CommitFn = std::function<StatusOr<storage::CheckpointRecord>(const std::string& run_dir,
                                                                     const Job& job, double time)>;
  static StatusOr<storage::CheckpointRecord> CommitToStorage(const std::string& run_dir,
                                                             const Job& job, double time);

  // Errors: kInternal when the thread's wake-up descriptor cannot be created.
  static StatusOr<std::unique_ptr<CheckpointCommitter>> Create(std::string run_dir,
                                                               storage::CheckpointIndex index,
                                                               storage::RetentionPolicy retention,
                                                               const Clock& clock,
                                                               CommitFn commit = CommitToStorage);
  ~CheckpointCommitter();  // finishes a commit in flight, then ends the thread
  CheckpointCommitter(const CheckpointCommitter&) = delete;
  CheckpointCommitter& operator=(const CheckpointCommitter&) = delete;

  // Readable while a result waits for TakeResult().
  int ready_fd() const { return results_->fd(); }

  // Starts committing `job` in the background. Errors: kFailedPrecondition when a commit is in
  // flight or its result has not been taken (busy()); nothing is started then.
  Status Submit(Job job);

  // A commit was submitted and its result not yet taken.
  bool busy() const { return busy_; }

  // The result of the commit that ended, once; nullopt while it is still running or when none
  // was submitted.
  std::optional<Result> TakeResult();

  // Blocks until the commit in flight, if any, has ended; its result still waits for TakeResult().
  void WaitForCommit();

  // The committed checkpoints, oldest first, as of the last commit that ended.
  std::vector<storage::CheckpointRecord> records() const;

 private:
  CheckpointCommitter(std::string run_dir, storage::CheckpointIndex index,
                      storage::RetentionPolicy retention, const Clock& clock, CommitFn commit,
                      std::unique_ptr<Mailbox<Result>> results);
  void Run();
  Result Commit(const Job& job);

  const std::string run_dir_;
  const storage::RetentionPolicy retention_;
  const Clock& clock_;
  const CommitFn commit_;
  const std::unique_ptr<Mailbox<Result>> results_;  // ended, not yet taken
  bool busy_ = false;  // the loop's view: touched only by the thread that calls the methods

  mutable Mutex mu_;
  CondVar cv_;
  storage::CheckpointIndex index_ GUARDED_BY(mu_);
  std::optional<Job> job_ GUARDED_BY(mu_);   // submitted, not yet started
  bool committing_ GUARDED_BY(mu_) = false;  // the thread is committing a job
  bool stop_ GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts once every field above is initialised
};

}  // namespace jaxtrain::controller
