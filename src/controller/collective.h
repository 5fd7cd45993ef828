// Collectives: one attempt's jaxtrain.collective calls (barrier(), broadcast_from_rank_zero()),
// matched across ranks apart from the event loop.
//
// Each rank numbers its calls 1, 2, ... and blocks in each until it is released, so every rank
// that waits waits in the same call, the one numbered next(). A call is released once every rank
// has made it; a broadcast's release carries rank 0's data. A call that can never be released ends
// the attempt: ranks that make different calls under one number (one barrier(), another
// broadcast_from_rank_zero()), or a call that a rank whose training function returned never made.
// While ranks wait, a warning names the ranks missing, every kWarnInterval (as Ray Train's
// RAY_TRAIN_COLLECTIVE_WARN_INTERVAL_S); there is no timeout of its own (as in Ray Train): the
// progress watchdog (watchdog.h) ends a group stuck for good, and a rank's arrival counts as its
// progress there.
//
// Cost: Arrive() is O(1) but for the call's last arrival and a mismatch, O(world size). Memory:
// O(world size) plus rank 0's data of the call pending.
// Pure state, time passed in; owned by the controller's loop; not thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "base/clock.h"
#include "base/status.h"
#include "wire/messages.h"

namespace jaxtrain::controller {

class Collectives {
 public:
  static constexpr Duration kWarnInterval = std::chrono::seconds(60);

  explicit Collectives(int world_size);

  struct Release {
    uint64_t sequence = 0;
    wire::CollectiveKind kind = wire::CollectiveKind::kBarrier;
    std::string data;  // rank 0's, for a broadcast; sent to every rank
  };

  // `rank` made `call` at `now`. Returns the release when every rank has now made it.
  // Errors: kInvalidArgument when the call is out of order (its number is not next(), or the rank
  // made it already): the rank broke the protocol. kFailedPrecondition when the call can never be
  // released: an earlier rank made a different call under its number, or a rank's training
  // function returned before making it; the message names the ranks and their calls.
  StatusOr<std::optional<Release>> Arrive(int rank, const wire::Collective& call, TimePoint now);

  // `rank`'s training function returned. Errors: kFailedPrecondition when other ranks wait in a
  // call it never made (the message names them and the call).
  Status Done(int rank);

  // When TakeWarning() must next run, while ranks wait.
  std::optional<TimePoint> NextWarning() const;
  // The warning due at `now` that names the ranks waited for, or "" when none is due.
  std::string TakeWarning(TimePoint now);

  uint64_t next() const { return next_; }
  // The first rank whose training function returned (Done()), or -1: the rank to blame when a
  // later call fails because of it.
  int first_returned() const { return returned_; }

 private:
  // "call N, barrier()" for the call pending of `kind`.
  std::string CallName(wire::CollectiveKind kind) const;
  // The ranks that have (`arrived`) or have not made the call pending.
  std::vector<int> Ranks(bool arrived) const;

  int world_size_;
  uint64_t next_ = 1;  // the number of the call pending
  // By rank: whether it made the call pending. Its kind is kind_: a rank that makes another is
  // refused before it is counted.
  std::vector<bool> arrived_;
  int arrivals_ = 0;
  wire::CollectiveKind kind_ = wire::CollectiveKind::kBarrier;
  std::string data_;  // rank 0's of the call pending
  TimePoint first_arrival_;
  int warnings_ = 0;   // said about the call pending
  int returned_ = -1;  // the first rank whose training function returned
};

// "rank 3", "ranks 0, 1, 2", "ranks 0, 1, ... (40 ranks)": a list of ascending ranks as messages
// name it, cut short when long.
std::string RankList(const std::vector<int>& ranks);

}  // namespace jaxtrain::controller
