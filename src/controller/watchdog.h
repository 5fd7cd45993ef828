// Watchdog: the progress watchdog's policy over one attempt's ranks, apart from the event loop.
//
// A rank is armed by its first Progress() (its first report()) and is stale once `timeout` has
// passed since its last one; a rank marked Done() is never stale. Ranks waiting in a collective
// for a stuck one stall at the same time, so Check() names every stale rank and blames the one
// stale longest.
//
// Cost: Progress() is O(1) and touches no heap: each armed rank has one timer in a TimerHeap,
// possibly earlier than its real deadline; when that timer fires, Check() moves it to the rank's
// real deadline (last progress + timeout) or finds the rank stale. So a report costs O(1), a
// wake O(timers expired x log ranks), and each rank's timer fires at most about once per timeout
// while it keeps reporting. NextDeadline() may therefore be earlier than any rank's real
// deadline; a wake then only moves timers.
//
// The limit is fixed (FailureConfig(progress_timeout_s=N)) or automatic (the default,
// progress_timeout_s="auto"): max(floor, multiple x the attempt's median step time), the floor
// alone until a step time is known (SetStepTime()). The floor covers what a step's time does not
// foresee: a later compilation, a checkpoint, an evaluation; the first compilation needs no cover,
// since a rank is armed only by its first report. When the limit shrinks, a timer set under the
// longer one fires up to the difference late.
//
// Time comes from the Clock given (base/clock.h), so tests drive it with a FakeClock. Owned by
// the controller's loop thread; not thread-safe.
#pragma once

#include <optional>
#include <vector>

#include "base/clock.h"
#include "controller/timer_heap.h"

namespace jaxtrain::controller {

// The automatic limit's terms (docs/failure-detection.md).
struct AutoLimit {
  Duration floor = std::chrono::minutes(10);
  double multiple = 10;
};

class Watchdog {
 public:
  // `timeout` zero (or below): off; nothing is ever stale and no timer is armed.
  Watchdog(const Clock& clock, int world_size, Duration timeout);
  // The automatic limit.
  Watchdog(const Clock& clock, int world_size, AutoLimit limit);

  // The attempt's median step time now (automatic limit only; ignored otherwise).
  void SetStepTime(Duration median);

  // The rank reported now.
  void Progress(int rank);
  // The rank's training function returned: it is never stale from here on.
  void Done(int rank);

  // When Check() must next run, if any rank is armed.
  std::optional<TimePoint> NextDeadline() const { return timers_.Next(); }

  struct Stale {
    int blamed = -1;         // the rank stale longest (the lowest of those tied)
    std::vector<int> ranks;  // every stale rank, ascending
  };
  // The stale ranks now, if any. Stale ranks stay stale (a later Check() names them again).
  std::optional<Stale> Check();

  bool enabled() const { return timeout_ > Duration::zero(); }
  // The limit now.
  Duration timeout() const { return timeout_; }
  // The automatic limit's terms; none for a fixed limit.
  const std::optional<AutoLimit>& auto_limit() const { return auto_; }
  // The step time the automatic limit was last given; zero before.
  Duration step_time() const { return step_time_; }

 private:
  const Clock* clock_;
  Duration timeout_;
  std::optional<AutoLimit> auto_;
  Duration step_time_ = Duration::zero();
  std::vector<TimePoint> last_;  // by rank: its last Progress()
  std::vector<bool> done_;       // by rank
  TimerHeap timers_;             // one per armed rank, at or before its real deadline
};

}  // namespace jaxtrain::controller
