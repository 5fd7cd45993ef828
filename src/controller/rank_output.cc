#include "controller/rank_output.h"

#include <algorithm>
#include <cstdlib>

namespace jaxtrain::controller {

std::string_view StripRankLabel(std::string_view line, int* rank) {
  *rank = -1;
  size_t i = line.find_first_not_of(' ');
  size_t digits = i == std::string_view::npos ? 0 : line.find_first_not_of("0123456789", i);
  if (i == std::string_view::npos || digits == i || digits == std::string_view::npos ||
      digits - i > 7 || line.substr(digits, 2) != ": ") {
    return line;
  }
  *rank = std::atoi(std::string(line.substr(i, digits - i)).c_str());
  return line.substr(digits + 2);
}

RankOutput::RankOutput(std::vector<int> ranks, bool echo, LogFn log, TaskEndFn parse_task_end)
    : ranks_(std::move(ranks)),
      echo_(echo),
      log_(std::move(log)),
      parse_task_end_(std::move(parse_task_end)),
      prefix_("(rank=" + std::to_string(ranks_.front()) + ") ") {}

std::string RankOutput::Take(std::string_view chunk) {
  if (ranks_.size() > 1) return SplitLabelled(chunk);
  log_(ranks_.front(), chunk);
  return echo_ ? Echo(chunk) : "";
}

std::string RankOutput::Close() {
  if (partial_.empty()) return "";
  return ranks_.size() > 1 ? SplitLabelled("\n") : Echo("\n");
}

bool RankOutput::IsOurs(int rank) const {
  return std::find(ranks_.begin(), ranks_.end(), rank) != ranks_.end();
}

std::string RankOutput::SplitLabelled(std::string_view chunk) {
  partial_.append(chunk);
  std::string console;
  size_t start = 0;
  for (size_t nl; (nl = partial_.find('\n', start)) != std::string::npos; start = nl + 1) {
    std::string_view line(partial_.data() + start, nl + 1 - start);
    int rank = -1;
    std::string_view text = StripRankLabel(line, &rank);
    if (IsOurs(rank)) {
      // Slurm's own messages on a task's output: "slurmstepd-node1: error: *** STEP 8.0 ..."
      if (launcher_error_.empty() && !stopping_ && text.substr(0, 10) == "slurmstepd" &&
          text.find("error") != std::string_view::npos) {
        launcher_error_ = std::string(text.substr(0, text.size() - 1));
      }
      log_(rank, text);
      if (echo_) console += "(rank=" + std::to_string(rank) + ") " + std::string(text);
      continue;
    }
    std::vector<int> targets;
    if (std::optional<launch::TaskEnd> end = parse_task_end_(line)) {
      for (int t : end->tasks) {
        if (!IsOurs(t)) continue;
        targets.push_back(t);
        task_ends_.emplace_back(t, *end);
      }
    } else if (launcher_error_.empty() && !stopping_ &&
               line.find("error") != std::string_view::npos) {
      launcher_error_ = std::string(line.substr(0, line.size() - 1));
    }
    if (targets.empty()) targets = ranks_;
    for (int r : targets) log_(r, line);
    if (echo_) console += line;
  }
  partial_.erase(0, start);
  // A line longer than the cap is taken as ended (what follows of it is the launcher's text).
  if (partial_.size() >= kLineCap) console += SplitLabelled("\n");
  return console;
}

std::string RankOutput::Echo(std::string_view chunk) {
  partial_.append(chunk);
  size_t start = 0;
  std::string text;
  auto emit = [&](size_t end) {
    std::string_view piece(partial_.data() + start, end - start);
    if (piece == "\n" && after_cr_) {
      text += piece;  // the '\n' of a "\r\n" that arrived on its own
    } else if (piece != "\r") {
      text += prefix_;
      text += piece;
    }
    after_cr_ = !piece.empty() && piece.back() == '\r';
    start = end;
  };
  for (size_t end; (end = partial_.find_first_of("\r\n", start)) != std::string::npos;) {
    if (partial_[end] == '\r' && end + 1 < partial_.size() && partial_[end + 1] == '\n') {
      ++end;  // "\r\n" ends one line
    }
    emit(end + 1);
  }
  if (partial_.size() - start >= kLineCap) emit(partial_.size());
  partial_.erase(0, start);
  return text;
}

}  // namespace jaxtrain::controller
