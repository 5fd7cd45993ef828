#include "controller/report_collector.h"

#include <algorithm>

namespace jaxtrain::controller {

ReportCollector::ReportCollector(int world_size, uint64_t first_round)
    : counts_(static_cast<size_t>(world_size), 0), next_round_(first_round) {}

std::vector<Round> ReportCollector::Add(int rank, std::string_view metrics_json,
                                        std::optional<CheckpointPart> checkpoint) {
  const uint64_t index = counts_[static_cast<size_t>(rank)]++;
  if (rank == 0) rank0_.emplace_back(metrics_json);
  if (checkpoint) checkpoints_[index].push_back(std::move(*checkpoint));
  if (index == complete_) ++ahead_;
  std::vector<Round> done;
  while (ahead_ == counts_.size()) {
    Round round{next_round_++, std::move(rank0_.front()), {}};
    rank0_.pop_front();
    if (auto it = checkpoints_.find(complete_); it != checkpoints_.end()) {
      round.checkpoints = std::move(it->second);
      checkpoints_.erase(it);
      std::sort(round.checkpoints.begin(), round.checkpoints.end(),
                [](const CheckpointPart& a, const CheckpointPart& b) {
                  return a.staged.rank < b.staged.rank;
                });
    }
    ++complete_;
    ahead_ = static_cast<size_t>(std::count_if(counts_.begin(), counts_.end(),
                                               [this](uint64_t c) { return c > complete_; }));
    done.push_back(std::move(round));
  }
  return done;
}

std::vector<Round> ReportCollector::TakeUnmatchedRank0() {
  std::vector<Round> out;
  for (auto& metrics : rank0_) out.push_back({next_round_++, std::move(metrics), {}});
  rank0_.clear();
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
