// PreemptionNotice: one attempt's preemption notice, from the first rank that received one to the
// moment every rank agrees on it (docs/preemption.md). Pure; not thread-safe (owned by the
// controller's loop, made afresh for each attempt).
//
// A notice (a rank's SIGTERM, a Slurm or cloud signal its host passed on) names the rank's host;
// its ranks are the preempted ranks. The controller then asks every rank how many
// get_preemption_info() calls and report rounds it has made; once all have answered, the notice is
// agreed: the sync call is one past the most calls any rank had made, so that every rank's
// get_preemption_info() returns the notice first at the same call (a rank whose next call comes
// before the agreement waits for it). The group is stopped once a checkpoint of a round past
// every rank's answer is committed (one reported after the notice: the just-in-time checkpoint),
// or at the deadline.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "base/clock.h"

namespace jaxtrain::controller {

class PreemptionNotice {
 public:
  explicit PreemptionNotice(int world_size) : answers_(static_cast<size_t>(world_size)) {}

  // A notice from `rank`, on `host` (whose ranks are `host_ranks`), said by `source`. `deadline`
  // on the controller's clock and `deadline_ms` in UNIX ms are when the host goes. True when it
  // opens the notice: every rank is then to be asked (kPreemptionReply "query"). A notice for a
  // host not yet named, before the agreement, joins it (the earliest deadline counts); after it,
  // it is only noted.
  bool Notice(int rank, const std::string& host, std::vector<int> host_ranks,
              const std::string& source, TimePoint deadline, uint64_t deadline_ms);

  // `rank`'s answer: its calls and report rounds so far. Returns the agreement (the JSON body of
  // kPreemptionReply "agreed") once every rank has answered; then nothing more.
  std::optional<std::string> Answer(int rank, uint64_t calls, uint64_t rounds);

  bool open() const { return first_rank_ >= 0; }
  bool agreed() const { return agreed_; }
  TimePoint deadline() const { return deadline_; }
  int first_rank() const { return first_rank_; }
  // Once agreed: whether a checkpoint of `round` was reported after every rank's answer.
  bool AfterNotice(uint64_t round) const { return agreed_ && round > rounds_at_notice_; }
  // What run.json and PreemptionError say of it: {"deadline_ms", "preempted_node_to_ranks",
  // "drain_timed_out"} (true when the deadline, not a commit, ended the wait).
  std::string Info(bool drain_timed_out) const;
  // "host node-2 (ranks 2, 3), by SIGTERM".
  std::string Describe() const;

 private:
  struct Answered {
    bool given = false;
    uint64_t calls = 0;
    uint64_t rounds = 0;
  };
  int first_rank_ = -1;
  std::string source_;
  std::map<std::string, std::vector<int>> node_to_ranks_;
  TimePoint deadline_;
  uint64_t deadline_ms_ = 0;
  std::vector<Answered> answers_;
  size_t answered_ = 0;
  bool agreed_ = false;
  uint64_t rounds_at_notice_ = 0;
};

}  // namespace jaxtrain::controller
