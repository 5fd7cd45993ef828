#include "controller/round_recorder.h"

#include <cstdio>
#include <map>
#include <utility>

#include "storage/files.h"

namespace jaxtrain::controller {
namespace {

std::string DefaultCheckpointName(uint64_t round) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "checkpoint_%06llu", static_cast<unsigned long long>(round));
  return buf;
}

// Whether two ranks' files of one name have the same contents (by size and CRC-32C, and by
// SHA-256 where both have one), or are links to the same target.
bool SameContents(const storage::FileEntry& a, const storage::FileEntry& b) {
  if (!a.link.empty() || !b.link.empty()) return a.link == b.link;
  return a.size == b.size && a.crc32c == b.crc32c &&
         (a.sha256.empty() || b.sha256.empty() || a.sha256 == b.sha256);
}

std::string Describe(const storage::FileEntry& f) {
  if (!f.link.empty()) return "a link to '" + f.link + "'";
  char crc[16];
  std::snprintf(crc, sizeof(crc), "%08x", f.crc32c);
  return std::to_string(f.size) + " bytes, CRC-32C " + crc;
}

}  // namespace

StatusOr<CheckpointCommitter::Job> CommitJob(const Round& round) {
  std::optional<std::string> name;
  int name_rank = -1;
  CheckpointCommitter::Job job{.round = round.round, .metrics_json = round.metrics_json};
  // Each file name's first writer: a later rank's file of that name is committed only once.
  std::map<std::string, std::pair<int, storage::FileEntry>> written;
  for (const auto& part : round.checkpoints) {
    if (part.dir_name && name && *part.dir_name != *name) {
      return InvalidArgumentError(
          "rank " + std::to_string(name_rank) + " names it '" + *name + "' and rank " +
          std::to_string(part.staged.rank) + " '" + *part.dir_name +
          "': the ranks are at different steps, so their files are not one "
          "checkpoint and none of them was committed; every rank must call report() "
          "the same number of times, with the same checkpoint_dir_name");
    }
    if (!name && part.dir_name) {
      name = part.dir_name;
      name_rank = part.staged.rank;
    }
    storage::RankCheckpoint staged = part.staged;
    staged.files.clear();
    for (const storage::FileEntry& f : part.staged.files) {
      auto [first, inserted] = written.try_emplace(f.path, part.staged.rank, f);
      if (inserted) {
        staged.files.push_back(f);
        continue;
      }
      // Ray merges the ranks' directories: the same file from several ranks is one file. Its
      // later copies stay in their staging directories, which the commit removes.
      if (SameContents(first->second.second, f)) continue;
      return InvalidArgumentError(
          "rank " + std::to_string(first->second.first) + " and rank " +
          std::to_string(part.staged.rank) + " both wrote '" + f.path +
          "' to the checkpoint of round " + std::to_string(round.round) +
          " with different contents (rank " + std::to_string(first->second.first) +
          "'s: " + Describe(first->second.second) + "; rank " + std::to_string(part.staged.rank) +
          "'s: " + Describe(f) +
          "), so none of it was committed; several ranks may write a file of the same name only "
          "with the same contents: write it from one rank, or name the files by rank");
    }
    job.parts.push_back(std::move(staged));
  }
  job.dir_name = name.value_or(DefaultCheckpointName(round.round));
  return job;
}

RoundRecorder::RoundRecorder(storage::RunStore& store,
                             std::unique_ptr<CheckpointCommitter> committer, const Clock& clock,
                             Delegate& delegate)
    : store_(store), committer_(std::move(committer)), clock_(clock), delegate_(delegate) {}

void RoundRecorder::Add(Round round) {
  if (committing_ || !waiting_.empty()) {
    waiting_.push_back(std::move(round));
    return;
  }
  RecordOrCommit(std::move(round));
}

void RoundRecorder::RecordOrCommit(Round round) {
  if (round.checkpoints.empty()) return Record(round, "");
  StatusOr<CheckpointCommitter::Job> job = CommitJob(round);
  if (!job.ok()) {
    // The ranks' parts disagree (names, contents): no one rank is to blame.
    Settle(round);
    return CommitFailed(round, job.status(), /*rank=*/-1);
  }
  Status submitted = committer_->Submit(*std::move(job));
  if (!submitted.ok()) {
    Settle(round);
    return CommitFailed(round, submitted, round.checkpoints.front().staged.rank);
  }
  committing_ = std::move(round);
  commit_start_ = clock_.Now();
}

void RoundRecorder::OnCommitReady() {
  std::optional<CheckpointCommitter::Result> result = committer_->TakeResult();
  if (!result) return;
  Round round = *std::move(committing_);
  committing_.reset();
  Settle(round);
  for (const auto& w : result->warnings) delegate_.Say(w);
  if (!result->record.ok()) {
    CommitFailed(round, result->record.status(), round.checkpoints.front().staged.rank);
  } else {
    const std::string committed = result->record->dir_name;
    last_commit_ = {.took = clock_.Now() - commit_start_, .bytes = result->record->bytes};
    if (!result->index.ok()) {
      // The directory is committed (complete, with its manifest) and the next start adds it back
      // to the index; say exactly that, record the round, and stop the run. No status code: a
      // restart could not see the checkpoint, so this is never retried.
      delegate_.OnFailed(
          {.rank = round.checkpoints.front().staged.rank,
           .cause = FailureCause::kCheckpoint,
           .message = "the checkpoint of round " + std::to_string(round.round) +
                      " is committed as '" + storage::JoinPath(store_.dir(), committed) +
                      "', but the index checkpoints.json could not be updated (" +
                      result->index.message() +
                      "); the run stops here, and resuming it by name adds the checkpoint back "
                      "to the index and restores from it"});
    }
    Record(round, committed);
  }
  while (!waiting_.empty() && !committing_) {
    Round next = std::move(waiting_.front());
    waiting_.pop_front();
    RecordOrCommit(std::move(next));
  }
}

void RoundRecorder::CommitFailed(const Round& round, const Status& why, int rank) {
  delegate_.OnFailed({.rank = rank,
                      .cause = FailureCause::kCheckpoint,
                      .code = why.code(),
                      .message = "the checkpoint of round " + std::to_string(round.round) +
                                 " could not be committed: " + why.message()});
}

void RoundRecorder::Settle(const Round& round) {
  for (const auto& part : round.checkpoints) delegate_.OnSettled(part.staged.rank, round.round);
}

void RoundRecorder::Record(const Round& round, const std::string& committed) {
  Status s = store_.AppendRound(round.round, clock_.UnixSeconds(), round.metrics_json, committed);
  if (!s.ok()) {
    // A round that is not on disk must not be counted as done: the attempt fails, and a restart
    // (FailureConfig.max_failures) repeats the round from the latest checkpoint.
    delegate_.OnFailed({.rank = -1,
                        .cause = FailureCause::kStorage,
                        .code = s.code(),
                        .message = "report round " + std::to_string(round.round) +
                                   " could not be recorded in the run directory: " + s.message()});
    return;
  }
  delegate_.OnRecorded(round, committed);
}

}  // namespace jaxtrain::controller
