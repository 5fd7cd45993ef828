// RunMetrics: what a running controller shows to a metrics endpoint
// (python/jaxtrain/driver/metrics.py, docs/observability.md): the run's state, its attempts by
// cause, how long worker groups took to start and restart, checkpoint commits, reports, and each
// rank's step time and stragglers (stragglers.h). The controller's loop publishes a copy at each
// change that matters (a round, a registration, a commit, a phase change); Controller::metrics()
// returns the latest copy.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

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

// As one JSON object, for the Python binding.
std::string RunMetricsJson(const RunMetrics& m);

}  // namespace jaxtrain::controller
