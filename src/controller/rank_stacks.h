// RankStacks: what each rank was doing when the progress watchdog fired, from its answer to the
// controller's ping "stacks" (wire::Pong), and which rank(s) the others wait for.
//
// A hung SPMD group stalls as one: every rank waits in a collective for the rank(s) that never
// arrived. Those are told apart (FindBehind()) first by their report() count (a rank that made
// fewer report() calls than the others is behind them), else by their training thread's stack:
// a rank whose innermost frame (past the standard library) is in JAX, or that waits in a
// jaxtrain collective or for a checkpoint's commit, waits; a rank elsewhere (in its own code, its
// data loader) is the one the others wait for. A guess from stacks, not a proof: the message
// says which evidence it used, and every rank's stacks are kept in the run directory
// (StacksFileText()) to check it by.
//
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "wire/messages.h"

namespace jaxtrain::controller {

// One frame of a faulthandler dump: `  File "<file>", line <line> in <function>`.
struct StackFrame {
  std::string file;
  int line = 0;
  std::string function;
  bool operator==(const StackFrame&) const = default;
};

// The frames of thread `thread` in a faulthandler dump (all_threads=True), innermost first; empty
// when the dump does not name that thread.
std::vector<StackFrame> ThreadFrames(std::string_view dump, uint64_t thread);

// One rank's answer, as the controller knows it.
struct RankStacks {
  int rank = -1;
  std::string host;
  uint64_t reports = 0;  // its report() calls in this attempt
  wire::Pong pong;       // has_stacks: the worker took them
};

// Where the rank's training thread is, in one phrase: "in JAX at multihost_utils.py:235 in
// process_allgather, called from train.py:20 in loop", "in barrier() call 3 (a jaxtrain
// collective)", "at train.py:12 in block_forever (threading.py:629 in wait)".
std::string DescribeWhere(const RankStacks& r);
// Whether the rank waits for others: in a jaxtrain collective, for a checkpoint's commit, or in
// JAX (a collective, or a computation that contains one).
bool Waits(const RankStacks& r);

struct Behind {
  std::vector<int> ranks;  // ascending
  std::string why;         // one clause for the failure message (ranks named with their hosts)
};
// The ranks the others wait for, among those that sent stacks; none when the stacks and report
// counts do not single any out (every rank waits, or none does).
std::optional<Behind> FindBehind(const std::vector<RankStacks>& ranks);

// The text of `<run>/stacks/attempt-<N>/rank-<R>.txt`: a header of what jaxtrain knows of the
// rank (host, report() calls, collective, checkpoint commit, training thread, where it is), then
// the dump as faulthandler wrote it.
std::string StacksFileText(const RankStacks& r, int attempt);

}  // namespace jaxtrain::controller
