// TimerHeap: deadlines keyed by small non-negative integers (a rank, a slot), earliest first.
//
// A binary min-heap with each key's position kept beside it, so arming, moving and cancelling one
// key's timer cost O(log n) and finding the next deadline O(1): the event loop's wake costs
// O(timers that expired), never O(timers). Ties are broken by the smaller key. Pure state, no
// clock of its own (callers pass the time, from base/clock.h); owned by one thread; not
// thread-safe.
#pragma once

#include <optional>
#include <vector>

#include "base/clock.h"

namespace jaxtrain::controller {

class TimerHeap {
 public:
  // Arms `key`'s timer for `at`, or moves it there if it is armed.
  void Set(int key, TimePoint at);
  // Disarms `key`'s timer; nothing if it is not armed.
  void Cancel(int key);
  bool armed(int key) const;
  // The deadline of an armed key.
  TimePoint deadline(int key) const;

  // The earliest deadline, if any timer is armed.
  std::optional<TimePoint> Next() const;
  // Disarms and returns the key whose deadline is the earliest, if that deadline is <= `now`.
  std::optional<int> PopExpired(TimePoint now);

  size_t size() const { return heap_.size(); }
  bool empty() const { return heap_.empty(); }
  void Clear();

 private:
  struct Entry {
    TimePoint at;
    int key;
  };
  static bool Before(const Entry& a, const Entry& b) {
    return a.at < b.at || (a.at == b.at && a.key < b.key);
  }
  void Place(size_t i, Entry e);
  void SiftUp(size_t i);
  void SiftDown(size_t i);
  void RemoveAt(size_t i);

  std::vector<Entry> heap_;
  std::vector<int> position_;  // by key: its index in heap_, -1 when not armed
};

}  // namespace jaxtrain::controller
