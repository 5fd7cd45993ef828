#include "controller/run_metrics.h"

#include <nlohmann/json.hpp>

namespace jaxtrain::controller {
namespace {

nlohmann::json Summary(const DurationSummary& d) {
  return {{"count", d.count}, {"sum_s", d.sum_s}, {"last_s", d.last_s}};
}

}  // namespace

std::string RunMetricsJson(const RunMetrics& m) {
  nlohmann::json steps = nlohmann::json::array();
  for (const auto& s : m.rank_step_s) steps.push_back(s ? nlohmann::json(*s) : nlohmann::json());
  return nlohmann::json{{"state", m.state},
                        {"attempt", m.attempt},
                        {"world_size", m.world_size},
                        {"ranks_up", m.ranks_up},
                        {"reports", m.reports},
                        {"rounds", m.rounds},
                        {"last_round", m.last_round},
                        {"attempts_by_cause", m.attempts_by_cause},
                        {"group_start", Summary(m.group_start)},
                        {"restart", Summary(m.restart)},
                        {"checkpoint_commit", Summary(m.checkpoint_commit)},
                        {"checkpoint_bytes", m.checkpoint_bytes},
                        {"last_checkpoint_bytes", m.last_checkpoint_bytes},
                        {"rank_step_s", steps},
                        {"stragglers", m.stragglers}}
      .dump();
}

}  // namespace jaxtrain::controller
