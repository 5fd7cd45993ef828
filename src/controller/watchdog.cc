#include "controller/watchdog.h"

#include <algorithm>

namespace jaxtrain::controller {

Watchdog::Watchdog(const Clock& clock, int world_size, Duration timeout)
    : clock_(&clock),
      timeout_(timeout),
      last_(static_cast<size_t>(world_size)),
      done_(static_cast<size_t>(world_size), false) {}

Watchdog::Watchdog(const Clock& clock, int world_size, AutoLimit limit)
    : Watchdog(clock, world_size, limit.floor) {
  auto_ = limit;
}

void Watchdog::SetStepTime(Duration median) {
  if (!auto_) return;
  step_time_ = median;
  timeout_ = std::max(auto_->floor, std::chrono::duration_cast<Duration>(median * auto_->multiple));
}

void Watchdog::Progress(int rank) {
  if (!enabled() || done_[static_cast<size_t>(rank)]) return;
  const TimePoint now = clock_->Now();
  last_[static_cast<size_t>(rank)] = now;
  if (!timers_.armed(rank)) timers_.Set(rank, now + timeout_);
}

void Watchdog::Done(int rank) {
  done_[static_cast<size_t>(rank)] = true;
  timers_.Cancel(rank);
}

std::optional<Watchdog::Stale> Watchdog::Check() {
  const TimePoint now = clock_->Now();
  std::vector<int> stale;
  while (std::optional<int> rank = timers_.PopExpired(now)) {
    const TimePoint real = last_[static_cast<size_t>(*rank)] + timeout_;
    if (real > now) {
      timers_.Set(*rank, real);
    } else {
      stale.push_back(*rank);
    }
  }
  if (stale.empty()) return std::nullopt;
  // A timer may have fired before its rank's real deadline, so the order popped is not the order
  // of staleness: the rank stale longest is the one with the oldest last progress.
  std::sort(stale.begin(), stale.end());
  Stale out{.blamed = stale.front(), .ranks = stale};
  for (int rank : stale) {
    if (last_[static_cast<size_t>(rank)] < last_[static_cast<size_t>(out.blamed)]) {
      out.blamed = rank;
    }
    timers_.Set(rank, last_[static_cast<size_t>(rank)] + timeout_);
  }
  return out;
}

}  // namespace jaxtrain::controller
