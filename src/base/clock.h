// Clock: the one way the core reads time, so tests can use FakeClock instead of sleeping.
// Thread-safety: RealClock is stateless; FakeClock is safe to read and advance from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <optional>

namespace jaxtrain {

using Duration = std::chrono::nanoseconds;
using TimePoint = std::chrono::steady_clock::time_point;

class Clock {
 public:
  virtual ~Clock() = default;
  virtual TimePoint Now() const = 0;
  // Wall-clock seconds since the Unix epoch, for timestamps written to files.
  virtual double UnixSeconds() const = 0;
  // A descriptor that becomes readable when the time moves, for a clock whose time moves only
  // when told to (FakeClock); -1 for one that moves by itself. A loop that waits for a deadline on
  // this clock polls it beside its own descriptors, with the timeout PollTimeoutMs() gives.
  virtual int wake_fd() const { return -1; }
};

// The process's steady clock and system clock.
Clock& RealClock();

// The poll() timeout that wakes a loop at `deadline` on `clock`: -1 (no timeout) without one, 0
// once it has passed, else the milliseconds to it (at most a minute) — or -1 on a clock that moves
// only when told to, whose wake_fd() wakes the loop instead.
int PollTimeoutMs(const Clock& clock, std::optional<TimePoint> deadline);

// Takes what made a clock's wake_fd() readable, so that it is readable again only when the time
// moves again. For a loop that found it readable.
void ClearWake(const Clock& clock);

// A clock that moves only when told to.
class FakeClock : public Clock {
 public:
  FakeClock();
  ~FakeClock() override;
  FakeClock(const FakeClock&) = delete;
  FakeClock& operator=(const FakeClock&) = delete;

  TimePoint Now() const override { return TimePoint(Duration(now_ns_.load())); }
  double UnixSeconds() const override { return 1.7e9 + now_ns_.load() / 1e9; }
  int wake_fd() const override { return wake_fd_; }
  // Moves the time on and wakes whoever waits on it (wake_fd()).
  void Advance(Duration d);

 private:
  std::atomic<long long> now_ns_{0};
  const int wake_fd_;  // an eventfd
};

}  // namespace jaxtrain
