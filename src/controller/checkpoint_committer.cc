#include "controller/checkpoint_committer.h"

#include "storage/files.h"

namespace jaxtrain::controller {

StatusOr<storage::CheckpointRecord> CheckpointCommitter::CommitToStorage(const std::string& run_dir,
                                                                         const Job& job,
                                                                         double time) {
  return storage::CommitCheckpoint(run_dir, job.dir_name, job.round, time, job.metrics_json,
                                   job.parts);
}

StatusOr<std::unique_ptr<CheckpointCommitter>> CheckpointCommitter::Create(
    std::string run_dir, storage::CheckpointIndex index, storage::RetentionPolicy retention,
    const Clock& clock, CommitFn commit) {
  JT_ASSIGN_OR_RETURN(std::unique_ptr<Mailbox<Result>> results,
                      Mailbox<Result>::Create("checkpoint committer"));
  return std::unique_ptr<CheckpointCommitter>(
      new CheckpointCommitter(std::move(run_dir), std::move(index), std::move(retention), clock,
                              std::move(commit), std::move(results)));
}

CheckpointCommitter::CheckpointCommitter(std::string run_dir, storage::CheckpointIndex index,
                                         storage::RetentionPolicy retention, const Clock& clock,
                                         CommitFn commit, std::unique_ptr<Mailbox<Result>> results)
    : run_dir_(std::move(run_dir)),
      retention_(std::move(retention)),
      clock_(clock),
      commit_(std::move(commit)),
      results_(std::move(results)),
      index_(std::move(index)),
      thread_([this] { Run(); }) {}

CheckpointCommitter::~CheckpointCommitter() {
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  cv_.NotifyAll();
  thread_.join();
}

Status CheckpointCommitter::Submit(Job job) {
  if (busy_) {
    return FailedPreconditionError("the checkpoint of round " + std::to_string(job.round) +
                                   " was submitted while another commit is in flight");
  }
  busy_ = true;
  {
    MutexLock lock(mu_);
    job_ = std::move(job);
  }
  cv_.NotifyAll();
  return OkStatus();
}

std::optional<CheckpointCommitter::Result> CheckpointCommitter::TakeResult() {
  std::optional<Result> out = results_->Take();
  if (out) busy_ = false;
  return out;
}

void CheckpointCommitter::WaitForCommit() {
  MutexLock lock(mu_);
  cv_.Wait(mu_, [this]() REQUIRES(mu_) { return !job_ && !committing_; });
}

std::vector<storage::CheckpointRecord> CheckpointCommitter::records() const {
  MutexLock lock(mu_);
  return index_.records();
}

void CheckpointCommitter::Run() {
  for (;;) {
    Job job;
    {
      MutexLock lock(mu_);
      // A submitted job is committed even when stop_ is set: a commit is never dropped.
      cv_.Wait(mu_, [this]() REQUIRES(mu_) { return job_.has_value() || stop_; });
      if (!job_) return;
      job = std::move(*job_);
      job_.reset();
      committing_ = true;
    }
    Result result = Commit(job);
    results_->Post(std::move(result));  // before WaitForCommit() returns
    {
      MutexLock lock(mu_);
      committing_ = false;
    }
    cv_.NotifyAll();
  }
}

CheckpointCommitter::Result CheckpointCommitter::Commit(const Job& job) {
  Result out{.round = job.round,
             .record = commit_(run_dir_, job, clock_.UnixSeconds()),
             .index = OkStatus()};
  if (!out.record.ok()) return out;
  std::vector<std::string> doomed;
  {
    // The lock is held for the index's small rewrite only; the loop reads the index between
    // commits, so it never waits for it.
    MutexLock lock(mu_);
    index_.Add(*out.record);
    if (retention_.num_to_keep) {
      // Scored with what validations returned; a checkpoint whose validation is pending stays.
      storage::Validations v = storage::ApplyValidations(run_dir_, index_.records());
      doomed = storage::SelectForDeletion(v.records, retention_, v.pending);
    }
    for (const auto& d : doomed) index_.Remove(d);
    out.index = index_.Save();
  }
  if (!out.index.ok()) return out;  // keep every directory: the index may still name them
  for (const auto& d : doomed) {
    Status s = storage::RemoveTree(storage::JoinPath(run_dir_, d));
    if (!s.ok()) out.warnings.push_back("cannot delete checkpoint " + d + ": " + s.message());
  }
  return out;
}

}  // namespace jaxtrain::controller
