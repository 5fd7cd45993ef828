// The live status line that `jaxtrain run` keeps at the bottom of a terminal while a run is in
// progress: attempt, ranks up, the last report round, rank 0's metrics and the rate of rounds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace jaxtrain::controller {

struct StatusView {
  int attempt = 0;
  int ranks_up = 0;  // registered with the controller in this attempt
  int world_size = 0;
  uint64_t round = 0;           // the last round recorded; 0 = none yet
  std::string metrics_json;     // rank 0's metrics of that round; "" = none
  double rounds_per_s = 0;      // over this attempt's rounds; 0 = not known yet
  std::vector<int> stragglers;  // ascending (stragglers.h)
};

// One line, without a newline, at most `width` columns (cut with "..."), e.g.
// "[jaxtrain] attempt 0 | 4/4 ranks up | round 12 | loss=0.0123 step=11 | 3.20 rounds/s", with
// "straggler: rank 3" (or "stragglers: ranks 3,5") after the ranks up while there are any.
// Metrics show their scalar values in the order reported, numbers to 4 significant digits.
std::string FormatStatus(const StatusView& view, size_t width);

// Terminal control: back to the start of the line and erase it.
inline constexpr char kEraseLine[] = "\r\x1b[K";

}  // namespace jaxtrain::controller
