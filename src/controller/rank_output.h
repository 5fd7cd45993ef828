// RankOutput: one launched process's output (stdout and stderr merged), split into what goes to
// each of its ranks' logs and what goes to the console.
//
// A process that runs one rank: its output goes to that rank's log as it arrives, and to the
// console line by line, each line with "(rank=N) " before it. A line ends at '\n', or at '\r' so
// that a progress bar (tqdm redraws its line after a '\r') is shown as it moves; "\r\n" ends one
// line; a line longer than kLineCap is shown in pieces, so output without newlines never grows a
// buffer without bound.
//
// A process that runs several ranks (a Slurm job step: srun --label; the Kubernetes supervisor)
// labels each line of its ranks "<rank>: " (the number may be padded with spaces). A labelled line
// of one of its ranks goes to that rank's log and, prefixed, to the console. The launcher's own
// lines go to the console as they are, and to the log of the ranks they name (how some ranks
// ended: `parse_task_end`, e.g. srun's "task 1: Killed"), or else to every rank's log. The first
// error line of the launcher's own ("srun: error: ...", "slurmstepd-node1: error: ...") is kept as
// launcher_error() until the group is being stopped (Stopping()): what the launcher says then is a
// consequence of the stop, not a cause.
//
// Not thread-safe; the controller's loop owns one per process.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "launch/launcher.h"

namespace jaxtrain::controller {

// "12: text" -> "text" and *rank = 12; any other line is returned whole, with *rank = -1.
std::string_view StripRankLabel(std::string_view line, int* rank);

class RankOutput {
 public:
  static constexpr size_t kLineCap = 64 << 10;

  using LogFn = std::function<void(int rank, std::string_view text)>;
  using TaskEndFn = std::function<std::optional<launch::TaskEnd>(std::string_view line)>;

  // `ranks`: the process's ranks (at least one). `echo`: whether console text is made at all.
  // `log` receives each rank's log text; `parse_task_end` reads the launcher's own lines.
  RankOutput(std::vector<int> ranks, bool echo, LogFn log, TaskEndFn parse_task_end);

  // Takes the next piece of output; returns the text for the console ("" for none).
  std::string Take(std::string_view chunk);

  // The output has ended: the rest of an unended line, taken as ended.
  std::string Close();

  // The group is being stopped: later error lines are not kept as launcher_error().
  void Stopping() { stopping_ = true; }

  // How ranks of this process ended, by rank, as the launcher's lines said (in their order).
  const std::vector<std::pair<int, launch::TaskEnd>>& task_ends() const { return task_ends_; }
  // The launcher's first error line (without its '\n'); "" for none.
  const std::string& launcher_error() const { return launcher_error_; }

 private:
  std::string SplitLabelled(std::string_view chunk);
  std::string Echo(std::string_view chunk);
  bool IsOurs(int rank) const;

  const std::vector<int> ranks_;
  const bool echo_;
  const LogFn log_;
  const TaskEndFn parse_task_end_;
  const std::string prefix_;  // "(rank=N) " of a one-rank process
  std::string partial_;       // the unended line
  bool after_cr_ = false;     // the last text shown ended with '\r'
  bool stopping_ = false;
  std::vector<std::pair<int, launch::TaskEnd>> task_ends_;
  std::string launcher_error_;
};

}  // namespace jaxtrain::controller
