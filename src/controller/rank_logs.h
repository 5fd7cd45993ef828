// RankLogs: the ranks' log files (logs/rank-<r>.log), each opened when it is first written to.
//
// Nothing is created when an attempt starts, so starting thousands of ranks touches no file per
// rank: a rank's log is created by its first output byte of the run. Every log gets each
// attempt's header line ("===== jaxtrain: attempt N =====") before the rank's first text of that
// attempt, or, for a rank that printed nothing in it, when the attempt ends (HeadAll()). So once
// an attempt has ended, every rank has a log and every log numbers every attempt, as if each had
// been written when the attempt started; while it runs, a rank that has printed nothing has no
// log yet (readers skip a missing one). Files are appended to (O_APPEND): a run resumed in the
// same directory continues its logs.
//
// Descriptors: at most `max_open` logs are held open (set_max_open()); opening one more closes
// the one opened longest ago, which is opened again when next written to. So the controller's
// need for descriptors is its connections plus a budget, not two per rank. The budget is a
// guess (the process holds other descriptors too): when the process runs out of descriptors,
// logs are closed, oldest first, until the one being opened fits.
//
// Owned by the controller's loop thread; not thread-safe.
#pragma once

#include <deque>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace jaxtrain::controller {

class RankLogs {
 public:
  // `path(r)`: rank r's log file, for ranks 0 .. world_size - 1.
  RankLogs(std::function<std::string(int)> path, int world_size);
  ~RankLogs();
  RankLogs(const RankLogs&) = delete;
  RankLogs& operator=(const RankLogs&) = delete;

  // Text written from now on belongs to `attempt`: each log gets its header before its first text.
  void BeginAttempt(int attempt) { attempt_ = attempt; }

  // Appends `text` to rank's log, creating it (and writing the attempt's header) first if need
  // be; an empty `text` only does that. Errors: kPermissionDenied / kInternal / kResourceExhausted
  // (the errno's kind) when the log cannot be opened or written; the message names the path and
  // the reason.
  Status Write(int rank, std::string_view text);

  // Writes the attempt's header to every log that lacks it (creating the log if need be): for the
  // end of an attempt. O(ranks that printed nothing in it). Errors: as Write(), for the first log
  // that fails; the others are still tried.
  Status HeadAll();

  // At most `n` (>= 1) logs open at a time.
  void set_max_open(size_t n);
  size_t open_count() const { return open_.size(); }

  std::string Path(int rank) const { return path_(rank); }

  // Closes every open log (they are opened again when written to).
  void CloseAll();

 private:
  void CloseOldest();

  std::function<std::string(int)> path_;
  int attempt_ = 0;
  std::vector<int> fds_;     // by rank: its open log, or -1
  std::vector<int> headed_;  // by rank: the attempt whose header its log has, or -1
  std::deque<int> open_;     // ranks whose log is open, the oldest opened first
  size_t max_open_ = 1024;
};

}  // namespace jaxtrain::controller
