#include "controller/restore_verifier.h"

#include <poll.h>

#include <iterator>

#include "storage/files.h"
#include "storage/memory_copies.h"

namespace jaxtrain::controller {

RestoreVerifier::Result RestoreVerifier::Choose(
    const std::string& run_dir, const std::vector<storage::CheckpointRecord>& records,
    bool checksums, const std::atomic<bool>* cancel, const std::string& memory_store) {
  Result out;
  for (auto it = records.rbegin(); it != records.rend(); ++it) {
    std::string dir = storage::JoinPath(run_dir, it->dir_name);
    const bool crc =
        checksums && (memory_store.empty() || !storage::AllPartsHeldIn(memory_store, dir));
    Status s = storage::VerifyCheckpoint(dir, crc, /*threads=*/0, cancel);
    if (s.code() == StatusCode::kCancelled) {
      out.cancelled = true;
      return out;
    }
    if (s.ok()) {
      out.dir = std::move(dir);
      out.checksums_skipped = checksums && !crc;
      return out;
    }
    out.warnings.push_back(
        "not restoring checkpoint " + it->dir_name + ": " + s.message() +
        (std::next(it) == records.rend() ? "" : "; falling back to the one before it"));
  }
  if (!records.empty()) {
    out.warnings.push_back("none of the run's " + std::to_string(records.size()) +
                           " checkpoints can be restored; the run starts from scratch");
  }
  return out;
}

StatusOr<std::unique_ptr<RestoreVerifier>> RestoreVerifier::Create() {
  JT_ASSIGN_OR_RETURN(std::unique_ptr<Mailbox<Result>> results,
                      Mailbox<Result>::Create("restore verifier"));
  return std::unique_ptr<RestoreVerifier>(new RestoreVerifier(std::move(results)));
}

RestoreVerifier::~RestoreVerifier() {
  cancel_ = true;
  if (thread_.joinable()) thread_.join();
}

Status RestoreVerifier::Start(std::string run_dir, std::vector<storage::CheckpointRecord> records,
                              bool checksums, std::string memory_store) {
  if (busy_) {
    return FailedPreconditionError(
        "a checkpoint verification was started while another one is in flight");
  }
  busy_ = true;
  if (thread_.joinable()) thread_.join();  // the last one, whose result was taken
  cancel_ = false;
  thread_ = std::thread([this, run_dir = std::move(run_dir), records = std::move(records),
                         checksums, memory_store = std::move(memory_store)] {
    results_->Post(Choose(run_dir, records, checksums, &cancel_, memory_store));
  });
  return OkStatus();
}

std::optional<RestoreVerifier::Result> RestoreVerifier::TakeResult() {
  std::optional<Result> out = results_->Take();
  if (out) busy_ = false;
  return out;
}

RestoreVerifier::Result RestoreVerifier::Wait(int wake_fd, const std::function<bool()>& cancel) {
  for (;;) {
    pollfd fds[] = {{wake_fd, POLLIN, 0}, {ready_fd(), POLLIN, 0}};
    poll(fds, std::size(fds), -1);
    if (cancel()) Cancel();
    if (std::optional<Result> result = TakeResult()) return std::move(*result);
  }
}

}  // namespace jaxtrain::controller
