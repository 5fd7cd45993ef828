// RunOutput: what the run shows on the driver's console and keeps in the ranks' logs, across its
// attempts: rank output copied to the console (console.h, written by a thread of its own, so
// that a console that does not read never blocks the loop) and to each rank's log (rank_logs.h),
// jaxtrain's own lines on stderr, and the live status line (status_line.h) kept below them on a
// terminal. Rank output and jaxtrain's lines are written above the status line: it is erased
// and drawn again after them.
//
// A log that cannot be written is said once and is not fatal: the output still reaches the
// console, and the metrics and checkpoints are recorded elsewhere.
//
// Threads: the controller's event-loop thread only.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>

#include "base/clock.h"
#include "base/status.h"
#include "controller/console.h"
#include "controller/rank_logs.h"
#include "controller/status_line.h"

namespace jaxtrain::controller {

class RunOutput {
 public:
  // Rank output goes to `console_fd` (-1: nowhere), with a live status line below it when
  // `status_line`; jaxtrain's own lines go to `stderr_fd`. `log_path` names a rank's log file.
  RunOutput(int console_fd, bool status_line, std::function<std::string(int)> log_path,
            int world_size, int stderr_fd = 2);
  RunOutput(const RunOutput&) = delete;
  RunOutput& operator=(const RunOutput&) = delete;

  // "jaxtrain: <line>" on stderr.
  void Say(const std::string& line);
  // A rank's output on the console.
  void ToConsole(std::string text);

  // The status line shows `view` (a run with a status line on a console only).
  void ShowStatus(const StatusView& view);
  // The status line is erased, until the next ShowStatus().
  void ClearStatus();

  // Each log gets attempt `number`'s header before its first output from now on.
  void BeginAttempt(int number) { logs_.BeginAttempt(number); }
  // How many logs may be held open (rank_logs.h).
  void set_max_open_logs(size_t n) { logs_.set_max_open(n); }
  // A rank's output to its log. The first log that cannot be written is said; its error is
  // returned then, for the run's warnings, and "" otherwise.
  std::string WriteLog(int rank, std::string_view text);
  // The run ends: every log numbers every attempt (RankLogs::HeadAll), and is closed. Returns
  // an error as WriteLog() does.
  std::string CloseLogs();

  // Waits up to `timeout` for the console to write what is queued; false when it stopped reading.
  bool Flush(Duration timeout) { return console_.Flush(timeout); }

 private:
  std::string WarnLogs(const Status& s);

  const int console_fd_;
  const bool status_line_;
  const int stderr_fd_;
  Console console_;
  std::string status_;  // the status line on the console now; "" = none
  RankLogs logs_;       // created on each rank's first output
  bool log_failed_ = false;
};

// The columns of the terminal on `fd`, or 100 when it is not a terminal.
size_t TerminalWidth(int fd);

}  // namespace jaxtrain::controller
