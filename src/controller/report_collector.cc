#include "controller/report_collector.h"

#include <algorithm>
#include <map>

namespace jaxtrain::controller {

ReportCollector::ReportCollector(int world_size, uint64_t first_round)
    : pending_(static_cast<size_t>(world_size)),
      counts_(static_cast<size_t>(world_size), 0),
      next_round_(first_round) {}

std::vector<Round> ReportCollector::Add(int rank, std::string metrics_json,
                                        std::optional<CheckpointPart> checkpoint) {
  pending_[static_cast<size_t>(rank)].push_back({std::move(metrics_json), std::move(checkpoint)});
  ++counts_[static_cast<size_t>(rank)];
  std::vector<Round> done;
  while (std::all_of(pending_.begin(), pending_.end(), [](const auto& q) { return !q.empty(); })) {
    Round round{next_round_++, std::move(pending_[0].front().metrics_json), {}};
    for (auto& q : pending_) {
      if (q.front().checkpoint) round.checkpoints.push_back(std::move(*q.front().checkpoint));
      q.pop_front();
    }
    done.push_back(std::move(round));
  }
  return done;
}

std::vector<Round> ReportCollector::TakeUnmatchedRank0() {
  std::vector<Round> out;
  for (auto& p : pending_[0]) out.push_back({next_round_++, std::move(p.metrics_json), {}});
  pending_[0].clear();
  return out;
}

std::string ReportCollector::CountMismatchWarning() const {
  std::map<uint64_t, std::vector<size_t>> by_count;
  for (size_t r = 0; r < counts_.size(); ++r) by_count[counts_[r]].push_back(r);
  if (by_count.size() <= 1) return "";
  std::string out = "ranks called report() different numbers of times (";
  bool first = true;
  for (const auto& [count, ranks] : by_count) {
    out += first ? "" : "; ";
    first = false;
    out += ranks.size() == 1 ? "rank " : "ranks ";
    for (size_t i = 0; i < ranks.size(); ++i) out += (i ? "," : "") + std::to_string(ranks[i]);
    out += ": " + std::to_string(count);
  }
  return out + "); every rank must call report() the same number of times, in the same order";
}

}  // namespace jaxtrain::controller
