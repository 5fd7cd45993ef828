// RestoreVerifier: chooses the checkpoint an attempt restores from, the newest committed one that
// verifies against its manifest (storage::VerifyCheckpoint: sizes, and CRC-32C of every file
// unless checksums are off), falling back to older ones with a warning each. Reading a large
// checkpoint takes as long as the disk needs, so the verification runs on a thread of its own and
// the controller's event loop stays free to honour Abort() meanwhile.
//
// Ownership and threads: one thread (the controller's loop) calls every method; each Start()
// verifies on a new thread, which ends with the verification. When it ends, ready_fd() becomes
// readable and TakeResult() returns the choice, so the loop learns of it through poll().
//
//   idle ──Start()──> verifying ──ends, or Cancel() (ready_fd readable)──> done ──TakeResult()──>
//   idle
//
// Wait() is that loop for a caller with nothing else to do meanwhile but watch its own wake-up
// descriptor (the controller between attempts: no worker alive, no commit in flight, only
// Abort() to honour).
//
// Cancel() stops a verification soon (between files and between a file's 4 MiB chunks); the
// destructor cancels the one in flight and waits for its thread.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "base/mailbox.h"
#include "base/status.h"
#include "storage/checkpoint.h"

namespace jaxtrain::controller {

class RestoreVerifier {
 public:
  struct Result {
    std::string dir;                    // the checkpoint to restore from; "" = from the start
    std::vector<std::string> warnings;  // one line per checkpoint passed over, then a summary
    bool cancelled = false;             // Cancel() stopped it: `dir` is "" and means nothing
    // `dir` was checked by sizes only because every part of it has its copy in memory_store:
    // a rank that reads any of it from storage must check it first.
    bool checksums_skipped = false;
  };

  // The choice itself, on the calling thread: the newest of `records` (oldest first, directories
  // of `run_dir`) that verifies. Stops early, with `cancelled`, once `cancel` (if given) is true.
  // With `memory_store` (the store of ranks that keep their checkpoints in this host's memory,
  // storage/memory_copies.h), a checkpoint whose every part has its copy there is checked by
  // sizes only: its ranks restore from those copies, not from storage.
  static Result Choose(const std::string& run_dir,
                       const std::vector<storage::CheckpointRecord>& records, bool checksums,
                       const std::atomic<bool>* cancel = nullptr,
                       const std::string& memory_store = "");

  // Errors: kInternal when the wake-up descriptor cannot be created.
  static StatusOr<std::unique_ptr<RestoreVerifier>> Create();
  ~RestoreVerifier();  // cancels the verification in flight and joins its thread
  RestoreVerifier(const RestoreVerifier&) = delete;
  RestoreVerifier& operator=(const RestoreVerifier&) = delete;

  // Readable while a result waits for TakeResult().
  int ready_fd() const { return results_->fd(); }

  // Starts Choose() on a thread of its own. Errors: kFailedPrecondition while a verification is
  // in flight or its result has not been taken; nothing is started then.
  Status Start(std::string run_dir, std::vector<storage::CheckpointRecord> records, bool checksums,
               std::string memory_store = "");

  // Asks the verification in flight to stop; its result (cancelled) still comes through ready_fd.
  void Cancel() { cancel_ = true; }

  // The result of the verification that ended, once; nullopt while it runs or when none was
  // started.
  std::optional<Result> TakeResult();

  // Waits for the result of the verification in flight (Start()), watching `wake_fd` meanwhile:
  // each time poll() returns, `cancel` is asked, and true cancels the verification (the result
  // then says cancelled). `cancel` resets `wake_fd` itself.
  Result Wait(int wake_fd, const std::function<bool()>& cancel);

 private:
  explicit RestoreVerifier(std::unique_ptr<Mailbox<Result>> results)
      : results_(std::move(results)) {}

  const std::unique_ptr<Mailbox<Result>> results_;  // ended, not yet taken
  bool busy_ = false;  // the loop's view: started, result not yet taken
  std::atomic<bool> cancel_{false};
  std::thread thread_;
};

}  // namespace jaxtrain::controller
