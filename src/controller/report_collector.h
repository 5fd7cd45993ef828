// ReportCollector: turns each rank's stream of report() calls into rounds. A round is complete
// when every rank has sent its report for it; rank 0's metrics are the round's metrics.
// Pure state, no I/O; owned by the controller's event loop; not thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "storage/checkpoint.h"

namespace jaxtrain::controller {

// One rank's part of a round's checkpoint.
struct CheckpointPart {
  storage::RankCheckpoint staged;
  std::optional<std::string> dir_name;  // as the rank asked for it
};

struct Round {
  uint64_t round = 0;
  std::string metrics_json;                 // rank 0's
  std::vector<CheckpointPart> checkpoints;  // from the ranks that passed one, by rank
};

class ReportCollector {
 public:
  // `first_round` is the number the next round gets (rounds continue across attempts).
  ReportCollector(int world_size, uint64_t first_round);

  // Records rank's next report. Returns the rounds this report completed (zero or one).
  std::vector<Round> Add(int rank, std::string metrics_json,
                         std::optional<CheckpointPart> checkpoint = std::nullopt);

  // At the end of a run: rank 0's reports that not every rank matched, in order, without their
  // checkpoints (a checkpoint needs every rank's round).
  std::vector<Round> TakeUnmatchedRank0();

  // A warning naming the ranks whose report() count differs from the others', or "" when every
  // rank reported the same number of times.
  std::string CountMismatchWarning() const;

  uint64_t next_round() const { return next_round_; }

 private:
  struct Pending {
    std::string metrics_json;
    std::optional<CheckpointPart> checkpoint;
  };
  std::vector<std::deque<Pending>> pending_;
  std::vector<uint64_t> counts_;
  uint64_t next_round_;
};

}  // namespace jaxtrain::controller
