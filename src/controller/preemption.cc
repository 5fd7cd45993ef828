#include "controller/preemption.h"

#include <algorithm>
#include <nlohmann/json.hpp>

namespace jaxtrain::controller {

bool PreemptionNotice::Notice(int rank, const std::string& host, std::vector<int> host_ranks,
                              const std::string& source, TimePoint deadline, uint64_t deadline_ms) {
  if (agreed_ || node_to_ranks_.count(host) != 0) return false;
  std::sort(host_ranks.begin(), host_ranks.end());
  node_to_ranks_[host] = std::move(host_ranks);
  if (!open()) {
    first_rank_ = rank;
    source_ = source;
    deadline_ = deadline;
    deadline_ms_ = deadline_ms;
    return true;
  }
  deadline_ = std::min(deadline_, deadline);
  deadline_ms_ = std::min(deadline_ms_, deadline_ms);
  return false;
}

namespace {

nlohmann::json NodeToRanks(const std::map<std::string, std::vector<int>>& node_to_ranks) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [node, ranks] : node_to_ranks) j[node] = ranks;
  return j;
}

}  // namespace

std::string PreemptionNotice::Info(bool drain_timed_out) const {
  return nlohmann::json{{"deadline_ms", deadline_ms_},
                        {"preempted_node_to_ranks", NodeToRanks(node_to_ranks_)},
                        {"drain_timed_out", drain_timed_out}}
      .dump();
}

std::optional<std::string> PreemptionNotice::Answer(int rank, uint64_t calls, uint64_t rounds) {
  if (!open() || agreed_ || rank < 0 || static_cast<size_t>(rank) >= answers_.size()) {
    return std::nullopt;
  }
  Answered& a = answers_[static_cast<size_t>(rank)];
  if (!a.given) ++answered_;
  a = {.given = true, .calls = calls, .rounds = rounds};
  if (answered_ < answers_.size()) return std::nullopt;
  agreed_ = true;
  uint64_t calls_max = 0;
  for (const Answered& each : answers_) {
    calls_max = std::max(calls_max, each.calls);
    rounds_at_notice_ = std::max(rounds_at_notice_, each.rounds);
  }
  return nlohmann::json{{"kind", "agreed"},
                        {"sync_call", calls_max + 1},
                        {"deadline_ms", deadline_ms_},
                        {"preempted_node_to_ranks", NodeToRanks(node_to_ranks_)}}
      .dump();
}

std::string PreemptionNotice::Describe() const {
  std::string text;
  for (const auto& [node, ranks] : node_to_ranks_) {
    if (!text.empty()) text += "; ";
    text += "host " + node + " (rank" + (ranks.size() == 1 ? " " : "s ");
    for (size_t i = 0; i < ranks.size(); ++i) {
      text += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
    }
    text += ")";
  }
  return text + ", by " + source_;
}

}  // namespace jaxtrain::controller
