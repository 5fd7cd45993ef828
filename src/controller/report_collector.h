// ReportCollector: turns each rank's stream of report() calls into rounds. A round is complete
// when every rank has sent its report for it; rank 0's metrics are the round's metrics.
//
// Cost: Add() is O(1) amortized and copies only rank 0's metrics (the other ranks' are never
// kept); completing a round is O(world size), once per round. Only the checkpoints passed are
// held apart from counters, so memory is O(world size) counters plus what is pending of rank 0
// and of the checkpoints.
// Pure state, no I/O; owned by the controller's event loop; not thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <string_view>
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
  std::vector<Round> Add(int rank, std::string_view metrics_json,
                         std::optional<CheckpointPart> checkpoint = std::nullopt);

  // At the end of a run: rank 0's reports that not every rank matched, in order, without their
  // checkpoints (a checkpoint needs every rank's round).
  std::vector<Round> TakeUnmatchedRank0();

  // A warning naming the ranks whose report() count differs from the others', or "" when every
  // rank reported the same number of times.
  std::string CountMismatchWarning() const;

  uint64_t next_round() const { return next_round_; }
  // The reports `rank` has made, and the rounds every rank has reported (both counted from this
  // collector's first round).
  uint64_t reports(int rank) const { return counts_[static_cast<size_t>(rank)]; }
  uint64_t complete() const { return complete_; }

 private:
  std::vector<uint64_t> counts_;   // by rank: its reports
  uint64_t complete_ = 0;          // reports every rank has made: the rounds completed
  size_t ahead_ = 0;               // ranks with more than complete_ reports
  std::deque<std::string> rank0_;  // rank 0's metrics of the rounds not yet complete
  // The checkpoints of rounds not yet complete, by the report's index (counts_ before it).
  std::map<uint64_t, std::vector<CheckpointPart>> checkpoints_;
  uint64_t next_round_;
};

}  // namespace jaxtrain::controller
