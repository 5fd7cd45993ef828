// StragglerDetector: each rank's step time, read from the times its reports arrive, and the rule
// that names a rank persistently slower than the others (a straggler). No collective and no
// message beyond the reports the controller receives anyway.
//
// A rank's step time is the median of its last `window` intervals between consecutive reports
// (the first report of an attempt only starts the clock). At every completed round, Evaluate()
// compares each rank whose window is full with the median of the other ranks' step times
// (ranks with at least one interval): the rank is slow in that round when
//
//     its step time > factor x the others' median   and   the difference >= min_excess.
//
// A rank slow for `rounds` consecutive evaluations becomes a straggler; a straggler that is not
// slow for `rounds` consecutive evaluations stops being one. Each change is returned once. With
// fewer than two ranks nobody is ever a straggler.
//
// Cost: Report() is O(1); Evaluate() is O(world size x (window + log world size)), once per
// round.
// Pure state, no I/O: the caller passes the arrival times (the controller's Clock). Owned by the
// controller's loop thread; not thread-safe.
#pragma once

#include <optional>
#include <vector>

#include "base/clock.h"

namespace jaxtrain::controller {

struct StragglerRule {
  int window = 5;       // intervals per rank its step time is the median of
  double factor = 1.5;  // how much slower than the others' median
  Duration min_excess = std::chrono::milliseconds(50);  // and by at least this much
  int rounds = 3;  // consecutive evaluations to start or stop being a straggler
};

struct StragglerChange {
  int rank = -1;
  bool slow = false;    // true: it became a straggler; false: it no longer is one
  double step_s = 0;    // its step time at the change
  double others_s = 0;  // the other ranks' median step time at the change
};

class StragglerDetector {
 public:
  StragglerDetector(int world_size, StragglerRule rule = {});

  // The rank's report arrived at `at`.
  void Report(int rank, TimePoint at);

  // Applies the rule once (call once per completed round); returns the ranks that started or
  // stopped being stragglers, by rank.
  std::vector<StragglerChange> Evaluate();

  // The rank's step time in seconds as of the last Evaluate(); nullopt before its first interval.
  std::optional<double> StepSeconds(int rank) const;
  // The current stragglers, ascending.
  std::vector<int> Stragglers() const;

 private:
  struct RankTimes {
    std::optional<TimePoint> last;  // its last report
    std::vector<double> intervals;  // ring buffer of its last `window` intervals, seconds
    size_t next = 0;                // where the next interval goes once the ring is full
    std::optional<double> step_s;   // median of intervals, as of the last Evaluate()
    int streak = 0;                 // consecutive evaluations against its current state
    bool straggler = false;
  };
  StragglerRule rule_;
  std::vector<RankTimes> ranks_;
};

}  // namespace jaxtrain::controller
