#include "controller/timer_heap.h"

#include <cassert>

namespace jaxtrain::controller {

void TimerHeap::Place(size_t i, Entry e) {
  position_[static_cast<size_t>(e.key)] = static_cast<int>(i);
  heap_[i] = e;
}

void TimerHeap::SiftUp(size_t i) {
  Entry e = heap_[i];
  while (i > 0) {
    size_t parent = (i - 1) / 2;
    if (!Before(e, heap_[parent])) break;
    Place(i, heap_[parent]);
    i = parent;
  }
  Place(i, e);
}

void TimerHeap::SiftDown(size_t i) {
  Entry e = heap_[i];
  const size_t n = heap_.size();
  for (;;) {
    size_t child = 2 * i + 1;
    if (child >= n) break;
    if (child + 1 < n && Before(heap_[child + 1], heap_[child])) ++child;
    if (!Before(heap_[child], e)) break;
    Place(i, heap_[child]);
    i = child;
  }
  Place(i, e);
}

void TimerHeap::Set(int key, TimePoint at) {
  assert(key >= 0);
  const auto k = static_cast<size_t>(key);
  if (k >= position_.size()) position_.resize(k + 1, -1);
  if (position_[k] < 0) {
    heap_.push_back({at, key});
    SiftUp(heap_.size() - 1);
    return;
  }
  const auto i = static_cast<size_t>(position_[k]);
  const TimePoint before = heap_[i].at;
  heap_[i].at = at;
  if (at < before) {
    SiftUp(i);
  } else {
    SiftDown(i);
  }
}

void TimerHeap::RemoveAt(size_t i) {
  position_[static_cast<size_t>(heap_[i].key)] = -1;
  Entry last = heap_.back();
  heap_.pop_back();
  if (i == heap_.size()) return;
  Place(i, last);
  if (i > 0 && Before(last, heap_[(i - 1) / 2])) {
    SiftUp(i);
  } else {
    SiftDown(i);
  }
}

void TimerHeap::Cancel(int key) {
  if (armed(key)) RemoveAt(static_cast<size_t>(position_[static_cast<size_t>(key)]));
}

bool TimerHeap::armed(int key) const {
  return key >= 0 && static_cast<size_t>(key) < position_.size() &&
         position_[static_cast<size_t>(key)] >= 0;
}

TimePoint TimerHeap::deadline(int key) const {
  assert(armed(key));
  return heap_[static_cast<size_t>(position_[static_cast<size_t>(key)])].at;
}

std::optional<TimePoint> TimerHeap::Next() const {
  if (heap_.empty()) return std::nullopt;
  return heap_.front().at;
}

std::optional<int> TimerHeap::PopExpired(TimePoint now) {
  if (heap_.empty() || now < heap_.front().at) return std::nullopt;
  const int key = heap_.front().key;
  RemoveAt(0);
  return key;
}

void TimerHeap::Clear() {
  heap_.clear();
  position_.clear();
}

}  // namespace jaxtrain::controller
