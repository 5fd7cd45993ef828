// Clock: the one way the core reads time, so tests can use FakeClock instead of sleeping.
// Thread-safety: RealClock is stateless; FakeClock is safe to read from any thread.
#pragma once

#include <atomic>
#include <chrono>

namespace jaxtrain {

using Duration = std::chrono::nanoseconds;
using TimePoint = std::chrono::steady_clock::time_point;

class Clock {
 public:
  virtual ~Clock() = default;
  virtual TimePoint Now() const = 0;
  // Wall-clock seconds since the Unix epoch, for timestamps written to files.
  virtual double UnixSeconds() const = 0;
};

// The process's steady clock and system clock.
Clock& RealClock();

// A clock that moves only when told to.
class FakeClock : public Clock {
 public:
  TimePoint Now() const override { return TimePoint(Duration(now_ns_.load())); }
  double UnixSeconds() const override { return 1.7e9 + now_ns_.load() / 1e9; }
  void Advance(Duration d) { now_ns_ += d.count(); }

 private:
  std::atomic<long long> now_ns_{0};
};

}  // namespace jaxtrain
