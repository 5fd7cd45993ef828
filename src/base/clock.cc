#include "base/clock.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace jaxtrain {
namespace {

class SteadyClock : public Clock {
 public:
  TimePoint Now() const override { return std::chrono::steady_clock::now(); }
  double UnixSeconds() const override {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
};

constexpr std::chrono::milliseconds kMaxPollWait{60000};

}  // namespace

Clock& RealClock() {
  static SteadyClock clock;
  return clock;
}

int PollTimeoutMs(const Clock& clock, std::optional<TimePoint> deadline) {
  if (!deadline) return -1;
  const TimePoint now = clock.Now();
  if (*deadline <= now) return 0;
  if (clock.wake_fd() >= 0) return -1;
  auto wait = std::chrono::ceil<std::chrono::milliseconds>(*deadline - now);
  return static_cast<int>(std::min(wait, kMaxPollWait).count());
}

void ClearWake(const Clock& clock) {
  if (clock.wake_fd() < 0) return;
  uint64_t count;
  [[maybe_unused]] ssize_t n = read(clock.wake_fd(), &count, sizeof(count));
}

FakeClock::FakeClock() : wake_fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  // Only tests make one; without its descriptor they could not be woken, so they stop here.
  if (wake_fd_ < 0) {
    std::perror("FakeClock: eventfd");
    std::abort();
  }
}

FakeClock::~FakeClock() { close(wake_fd_); }

void FakeClock::Advance(Duration d) {
  now_ns_ += d.count();
  uint64_t one = 1;
  // Fails only when the counter would overflow, which leaves it readable: no wake-up is lost.
  [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof(one));
}

}  // namespace jaxtrain
