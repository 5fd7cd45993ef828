#include "controller/run_metrics.h"

#include <nlohmann/json.hpp>
#include <utility>

#include "controller/stragglers.h"

namespace jaxtrain::controller {
namespace {

nlohmann::json Summary(const DurationSummary& d) {
  return {{"count", d.count}, {"sum_s", d.sum_s}, {"last_s", d.last_s}};
}

double Seconds(Duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

void MetricsBook::CountRound(uint64_t round) {
  ++m_.rounds;
  m_.last_round = round;
}

void MetricsBook::CountCommit(Duration took, uint64_t bytes) {
  m_.checkpoint_commit.Add(Seconds(took));
  m_.checkpoint_bytes += bytes;
  m_.last_checkpoint_bytes = bytes;
}

void MetricsBook::NoticeFailure(std::optional<TimePoint> at) {
  if (!failure_noticed_) failure_noticed_ = at;
}

void MetricsBook::TrainingStarted(Duration group_start, TimePoint now) {
  m_.group_start.Add(Seconds(group_start));
  if (failure_noticed_) m_.restart.Add(Seconds(now - *failure_noticed_));
  failure_noticed_.reset();
}

const RunMetrics& MetricsBook::Update(std::string state, int attempt, int world_size, int ranks_up,
                                      const StragglerDetector& stragglers) {
  m_.state = std::move(state);
  m_.attempt = attempt;
  m_.world_size = world_size;
  m_.ranks_up = ranks_up;
  m_.rank_step_s.resize(static_cast<size_t>(world_size));
  for (size_t r = 0; r < m_.rank_step_s.size(); ++r) {
    m_.rank_step_s[r] = stragglers.StepSeconds(static_cast<int>(r));
  }
  m_.stragglers = stragglers.Stragglers();
  return m_;
}

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
