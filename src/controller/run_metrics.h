// RunMetrics: what a running controller shows to a metrics endpoint
// (python/jaxtrain/driver/metrics.py, docs/observability.md): the run's state, its attempts by
// cause, how long worker groups took to start and restart, checkpoint commits, reports, and each
// rank's step time and stragglers (stragglers.h). The controller's loop publishes a copy at each
// change that matters (a round, a registration, a commit, a phase change); Controller::metrics()
// returns the latest copy.
//
// MetricsBook keeps them as the run goes, on the loop's thread: it counts attempts, reports,
// rounds and commits, times group starts and restarts (a failure noticed until the next group
// has registered), and makes the copy the loop publishes (Update()).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "base/clock.h"

namespace jaxtrain::controller {

// Durations of one kind of event: how many, their sum and the last one.
struct DurationSummary {
  uint64_t count = 0;
  double sum_s = 0;
  double last_s = 0;
  void Add(double s) {
    ++count;
    sum_s += s;
    last_s = s;
  }
};

struct RunMetrics {
  // QUEUED (an attempt's launch waits to be admitted: Kueue), STARTING (the first group), RUNNING,
  // STOPPING (an attempt ends), RESTARTING (a later group starts), then FINISHED, ERRORED or
  // ABORTED.
  std::string state = "STARTING";
  int attempt = 0;
  int world_size = 0;
  int ranks_up = 0;         // registered in this attempt
  uint64_t reports = 0;     // report() calls received from every rank, in this run
  uint64_t rounds = 0;      // report rounds recorded in this run
  uint64_t last_round = 0;  // the run's number of the last round recorded (0: none)
  // Attempts started in this run, by what started them: "start" for the first, else the cause
  // of the previous attempt's failure (failure_policy.h's names).
  std::map<std::string, uint64_t> attempts_by_cause;
  DurationSummary group_start;        // the group spawned until every rank registered
  DurationSummary restart;            // a failure noticed until the next group all registered
  DurationSummary checkpoint_commit;  // a round's checkpoint submitted until committed
  uint64_t checkpoint_bytes = 0;      // committed, in this run
  uint64_t last_checkpoint_bytes = 0;
  std::vector<std::optional<double>> rank_step_s;  // by rank: its step time (stragglers.h)
  std::vector<int> stragglers;                     // ascending
};

class StragglerDetector;

class MetricsBook {
 public:
  // An attempt starts; `cause`: "start", "resize", or the cause of the failure before it.
  void CountAttempt(const std::string& cause) { ++m_.attempts_by_cause[cause]; }
  void CountReport() { ++m_.reports; }
  // Round `round` was recorded.
  void CountRound(uint64_t round);
  // A checkpoint was committed: its commit took `took`, and it has `bytes`.
  void CountCommit(Duration took, uint64_t bytes);
  // A failure was noticed at `at` (none: no failure); the first since training last ran counts.
  void NoticeFailure(std::optional<TimePoint> at);
  // Every rank of the group has registered, `group_start` after the group started, at `now`: the
  // group start is timed, and so is the restart since the failure noticed, if any.
  void TrainingStarted(Duration group_start, TimePoint now);
  // The metrics now: in `state`, the attempt `attempt` of `world_size` ranks, `ranks_up` of them
  // registered, with their step times and stragglers.
  const RunMetrics& Update(std::string state, int attempt, int world_size, int ranks_up,
                           const StragglerDetector& stragglers);

 private:
  RunMetrics m_;
  std::optional<TimePoint> failure_noticed_;  // the first failure since training last ran
};

// As one JSON object, for the Python binding.
std::string RunMetricsJson(const RunMetrics& m);

}  // namespace jaxtrain::controller
