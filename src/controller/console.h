// Console: the driver's console (a terminal, a pipe, a file), written by a thread of its own so
// that a reader that stops reading (`jaxtrain run ... | less`, paused) never blocks the
// controller's loop: no reaping, no watchdog, no Ctrl-C would happen while a write() blocks.
//
// Output waits in a queue bounded by `capacity` bytes. Output that finds the queue full is dropped
// (every rank's log file has all of it), and once the queue has drained a line on the console says
// how many bytes were not shown. Chunks are written in the order they were queued, whatever fd
// each goes to, so that jaxtrain's own lines on stderr and a status line on stdout stay in order.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include "base/clock.h"
#include "base/mutex.h"

namespace jaxtrain::controller {

class Console {
 public:
  static constexpr size_t kDefaultCapacity = 4 << 20;
  static constexpr Duration kFlushOnDestruction = std::chrono::seconds(2);

  explicit Console(size_t capacity = kDefaultCapacity);
  // Waits up to kFlushOnDestruction for what is queued, then stops the writer and joins it: the
  // writer waits for room in poll(), never inside a write() that could block, and looks at `stop`
  // every kStopCheckMs, so a reader that never reads does not hold it; once this returns, no fd
  // is written again. What is still queued then is not written.
  ~Console();
  Console(const Console&) = delete;
  Console& operator=(const Console&) = delete;

  // Queues `text` for `fd`; never blocks. False when it was dropped because the queue is full,
  // or the fd can no longer be written (a closed pipe).
  bool Write(int fd, std::string text);

  // Waits until everything queued is written, at most `timeout`; false if some is still queued.
  bool Flush(Duration timeout);

  // Bytes dropped so far (queue full or fd broken).
  uint64_t dropped_bytes() const;

 private:
  struct Chunk {
    int fd;
    std::string text;
  };
  struct State {
    mutable Mutex mu;
    CondVar changed;
    std::deque<Chunk> queue GUARDED_BY(mu);
    size_t queued_bytes GUARDED_BY(mu) = 0;
    uint64_t dropped GUARDED_BY(mu) = 0;  // in all
    uint64_t unsaid GUARDED_BY(mu) = 0;   // dropped since the last notice
    int notice_fd GUARDED_BY(mu) = -1;    // where the next notice goes
    bool writing GUARDED_BY(mu) = false;  // the writer is writing a chunk
    bool broken GUARDED_BY(mu) = false;   // a write failed (EPIPE, EBADF, ...)
    bool stop GUARDED_BY(mu) = false;
  };
  enum class Written { kAll, kFailed, kStopped };
  static constexpr int kStopCheckMs = 100;
  static void Run(State& state);
  // Writes `text` to `fd` in pieces a pipe takes whole (PIPE_BUF) once poll() says there is room;
  // kStopped once `stop` is seen while waiting for room.
  static Written WriteUnlessStopped(State& state, int fd, std::string_view text);

  const size_t capacity_;
  std::unique_ptr<State> state_;
  std::thread writer_;
};

}  // namespace jaxtrain::controller
