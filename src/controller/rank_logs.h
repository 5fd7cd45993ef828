// RankLogs: the ranks' log files (logs/rank-<r>.log), each opened when it is first written to.
//
// Nothing is created when an attempt starts, so starting thousands of ranks touches no file per
// rank: a rank's log is created by its first output byte of the run. Every log gets each
// attempt's header line ("===== jaxtrain: attempt N =====") before the rank's first text of that
// attempt; the headers of the attempts in which it printed nothing come first (an empty section
// each), or, at the end of the run, from HeadAll(). So once the run has ended, every rank has a
// log and every log numbers every attempt, as if each had been written when the attempt started;
// while it runs, a rank's log numbers the attempts up to its latest text, and a rank that has
// printed nothing has no log yet (readers skip a missing one). A restart therefore creates no
// file for the ranks that were silent (at 16k ranks, creating them took 1-3 s of every restart).
// Files are appended to (O_APPEND): a run resumed in the same directory continues its logs. A
// header always starts a line: a rank killed in the middle of one (Python writes a print's text
// and its newline apart) leaves its last line open, and the header ends it first.
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
  // The first call names the first attempt whose header the logs get.
  void BeginAttempt(int attempt) {
    if (first_attempt_ < 0) first_attempt_ = attempt;
    attempt_ = attempt;
  }

  // Appends `text` to rank's log, creating it and writing the headers it lacks (the attempts
  // since its last text, this one included) first if need be; an empty `text` only does that.
  // Errors: kPermissionDenied / kInternal / kResourceExhausted (the errno's kind) when the log
  // cannot be opened or written; the message names the path and the reason.
  Status Write(int rank, std::string_view text);

  // Writes the headers every log lacks, up to this attempt (creating the log if need be): for the
  // end of the run. O(ranks that printed nothing in the last attempt). Errors: as Write(), for the
  // first log that fails; the others are still tried.
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
  int first_attempt_ = -1;       // the first BeginAttempt(); -1 before it
  std::vector<int> fds_;         // by rank: its open log, or -1
  std::vector<int> headed_;      // by rank: the attempt whose header its log has, or -1
  std::vector<char> open_line_;  // by rank: its log (open now) ends in the middle of a line
  std::deque<int> open_;         // ranks whose log is open, the oldest opened first
  size_t max_open_ = 1024;
};

}  // namespace jaxtrain::controller
