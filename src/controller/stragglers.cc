#include "controller/stragglers.h"

#include <algorithm>
#include <chrono>

namespace jaxtrain::controller {
namespace {

double Median(std::vector<double> v) {
  const size_t mid = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid), v.end());
  if (v.size() % 2 == 1) return v[mid];
  const double upper = v[mid];
  return (*std::max_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid)) + upper) / 2;
}

// The median of sorted `v` without one copy of `value` (which it holds), in O(log n).
double MedianWithout(const std::vector<double>& v, double value) {
  const size_t skip = static_cast<size_t>(std::lower_bound(v.begin(), v.end(), value) - v.begin());
  auto at = [&](size_t i) { return v[i < skip ? i : i + 1]; };
  const size_t n = v.size() - 1;
  return n % 2 == 1 ? at(n / 2) : (at(n / 2 - 1) + at(n / 2)) / 2;
}

}  // namespace

StragglerDetector::StragglerDetector(int world_size, StragglerRule rule)
    : rule_(rule), ranks_(static_cast<size_t>(world_size)) {
  rule_.window = std::max(rule_.window, 1);
  rule_.rounds = std::max(rule_.rounds, 1);
}

void StragglerDetector::Report(int rank, TimePoint at) {
  RankTimes& r = ranks_[static_cast<size_t>(rank)];
  if (r.last) {
    const double s = std::chrono::duration<double>(at - *r.last).count();
    if (r.intervals.size() < static_cast<size_t>(rule_.window)) {
      r.intervals.push_back(s);
    } else {
      r.intervals[r.next] = s;
      r.next = (r.next + 1) % r.intervals.size();
    }
  }
  r.last = at;
}

std::vector<StragglerChange> StragglerDetector::Evaluate() {
  std::vector<double> known;  // every known step time, for the others' medians
  for (RankTimes& r : ranks_) {
    if (!r.intervals.empty()) {
      r.step_s = Median(r.intervals);
      known.push_back(*r.step_s);
    }
  }
  std::vector<StragglerChange> changes;
  if (known.size() < 2) return changes;
  std::sort(known.begin(), known.end());
  const double min_excess = std::chrono::duration<double>(rule_.min_excess).count();
  for (size_t rank = 0; rank < ranks_.size(); ++rank) {
    RankTimes& r = ranks_[rank];
    if (r.intervals.size() < static_cast<size_t>(rule_.window)) continue;
    const double others_s = MedianWithout(known, *r.step_s);
    const bool slow = *r.step_s > rule_.factor * others_s && *r.step_s - others_s >= min_excess;
    r.streak = slow != r.straggler ? r.streak + 1 : 0;
    if (r.streak < rule_.rounds) continue;
    r.straggler = slow;
    r.streak = 0;
    changes.push_back(
        {.rank = static_cast<int>(rank), .slow = slow, .step_s = *r.step_s, .others_s = others_s});
  }
  return changes;
}

std::optional<double> StragglerDetector::StepSeconds(int rank) const {
  return ranks_[static_cast<size_t>(rank)].step_s;
}

std::vector<int> StragglerDetector::Stragglers() const {
  std::vector<int> out;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    if (ranks_[r].straggler) out.push_back(static_cast<int>(r));
  }
  return out;
}

}  // namespace jaxtrain::controller
