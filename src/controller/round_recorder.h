// RoundRecorder: the run's completed report rounds, recorded in the run directory in their order
// (result.jsonl and progress.csv, through the RunStore), a round that carries a checkpoint
// committed first, on the CheckpointCommitter's thread (checkpoint_committer.h).
//
// A round with a checkpoint is held until its commit ends, and rounds completed meanwhile wait
// behind it: no round is recorded before an earlier one, and result.jsonl never names a
// checkpoint that is not committed. When a commit ends, committed or not, the ranks that passed a
// part of it are told (Delegate::OnSettled): a rank's next report(checkpoint=) waits for that,
// so at most one commit is in flight (back-pressure).
//
//   Add(round) ──without a checkpoint──> recorded (Delegate::OnRecorded)
//        │     ──with one──> committing ──commit ends: OnCommitReady()──> recorded
//        └─ while a round is committing ──> waiting, in order ──> as above, once it is recorded
//
// A round that cannot be committed or recorded fails the attempt (Delegate::OnFailed); the rounds
// behind it are still recorded in order, so what completed is not lost.
//
// Threads: not thread-safe; one owner (the controller's loop) calls every method, and the
// Delegate is called from within Add() and OnCommitReady(). The commit runs on the committer's
// thread, which makes ready_fd() readable when it ends.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/clock.h"
#include "base/status.h"
#include "controller/checkpoint_committer.h"
#include "controller/failure_policy.h"
#include "controller/report_collector.h"
#include "storage/run_store.h"

namespace jaxtrain::controller {

// Why a round failed the attempt.
struct RoundFailure {
  // The rank blamed (the first part's, for a checkpoint); -1: the run directory, or the ranks'
  // parts of a checkpoint that disagree (CommitJob())
  int rank = -1;
  FailureCause cause = FailureCause::kCheckpoint;  // kCheckpoint or kStorage
  StatusCode code = StatusCode::kOk;  // of the error behind it; kOk: never worth retrying
  std::string message;
};

class RoundRecorder {
 public:
  class Delegate {
   public:
    virtual ~Delegate() = default;
    // `round` is recorded; `committed` names its checkpoint's directory ("" for none).
    virtual void OnRecorded(const Round& round, const std::string& committed) = 0;
    // The commit of a checkpoint that `rank` passed a part of has ended.
    virtual void OnSettled(int rank, uint64_t round) = 0;
    // A round could not be committed or recorded: the attempt fails.
    virtual void OnFailed(RoundFailure failure) = 0;
    // A line for the driver's log (a checkpoint that retention could not delete).
    virtual void Say(const std::string& line) = 0;
  };

  // Records into `store` (which outlives the recorder) and commits through `committer`.
  RoundRecorder(storage::RunStore& store, std::unique_ptr<CheckpointCommitter> committer,
                const Clock& clock, Delegate& delegate);

  // A completed round, the next in order.
  void Add(Round round);

  // For the owner's poll(): readable when a commit has ended; then call OnCommitReady().
  int ready_fd() const { return committer_->ready_fd(); }
  // Takes the ended commit's result: its round is recorded, its ranks settled, and the rounds
  // that waited for it are recorded (or the next with a checkpoint committed).
  void OnCommitReady();

  // A commit is in flight: an attempt ends only once it has ended.
  bool busy() const { return committer_->busy(); }
  // The committed checkpoints, oldest first, as of the last commit that ended.
  std::vector<storage::CheckpointRecord> records() const { return committer_->records(); }

  // The last checkpoint committed: how long its commit took (submitted until it ended, on the
  // recorder's clock) and its bytes. Set before Delegate::OnRecorded() is told of its round.
  struct CommitStats {
    Duration took{};
    uint64_t bytes = 0;
  };
  const CommitStats& last_commit() const { return last_commit_; }

 private:
  void RecordOrCommit(Round round);
  void Record(const Round& round, const std::string& committed);
  void Settle(const Round& round);
  // Fails the attempt, blaming `rank` (-1: the ranks' parts together).
  void CommitFailed(const Round& round, const Status& why, int rank);

  storage::RunStore& store_;
  const std::unique_ptr<CheckpointCommitter> committer_;
  const Clock& clock_;
  Delegate& delegate_;
  std::optional<Round> committing_;  // the round whose checkpoint is being committed
  TimePoint commit_start_;           // when it was submitted
  CommitStats last_commit_;
  std::deque<Round> waiting_;  // rounds completed after it, in order
};

// The committer's job for a round's checkpoint, named as the ranks asked (checkpoint_dir_name)
// or checkpoint_<round, 6 digits>. A file that several ranks wrote with the same contents (size
// and CRC-32C) is committed once, the first rank's (Ray merges the ranks' directories).
// Errors: kInvalidArgument when ranks ask for different names: they are at different steps (they
// restored different states), so their files are not one checkpoint; and when two ranks wrote
// one file name with different contents. Nothing of the checkpoint is committed then.
StatusOr<CheckpointCommitter::Job> CommitJob(const Round& round);

}  // namespace jaxtrain::controller
