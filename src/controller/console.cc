#include "controller/console.h"

#include <pthread.h>
#include <signal.h>

#include <utility>

#include "base/fd_io.h"

namespace jaxtrain::controller {

Console::Console(size_t capacity) : capacity_(capacity), state_(std::make_shared<State>()) {
  writer_ = std::thread([state = state_] { Run(state); });
}

Console::~Console() {
  Flush(kFlushOnDestruction);
  bool busy;
  {
    MutexLock lock(state_->mu);
    state_->stop = true;
    busy = state_->writing;
    state_->changed.NotifyAll();
  }
  // A writer inside write() sees `stop` when that write returns; it holds its own reference to
  // the state, so it may outlive this object.
  if (busy) {
    writer_.detach();
  } else {
    writer_.join();
  }
}

bool Console::Write(int fd, std::string text) {
  if (fd < 0 || text.empty()) return true;
  State& st = *state_;
  MutexLock lock(st.mu);
  if (st.broken || st.queued_bytes + text.size() > capacity_) {
    st.dropped += text.size();
    if (!st.broken) {
      st.unsaid += text.size();
      st.notice_fd = fd;
    }
    return false;
  }
  st.queued_bytes += text.size();
  st.queue.push_back({fd, std::move(text)});
  st.changed.NotifyAll();
  return true;
}

bool Console::Flush(Duration timeout) {
  State& st = *state_;
  MutexLock lock(st.mu);
  return st.changed.WaitFor(st.mu, timeout, [&]() REQUIRES(st.mu) {
    return st.broken || (st.queue.empty() && !st.writing && st.unsaid == 0);
  });
}

uint64_t Console::dropped_bytes() const {
  MutexLock lock(state_->mu);
  return state_->dropped;
}

void Console::Run(const std::shared_ptr<State>& state) {
  // A reader that goes away makes write() fail with EPIPE here instead of killing the process:
  // SIGPIPE is raised in the thread that wrote, where it stays blocked.
  sigset_t pipe;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
  State& st = *state;
  for (;;) {
    Chunk chunk;
    {
      MutexLock lock(st.mu);
      st.changed.Wait(
          st.mu, [&]() REQUIRES(st.mu) { return st.stop || !st.queue.empty() || st.unsaid > 0; });
      if (st.stop) return;
      if (!st.queue.empty()) {
        chunk = std::move(st.queue.front());
        st.queue.pop_front();
        st.queued_bytes -= chunk.text.size();
      } else {
        // The queue has drained since output was dropped: say so where that output was going.
        chunk = {st.notice_fd, "jaxtrain: " + std::to_string(st.unsaid) +
                                   " bytes of worker output were not shown here: the console "
                                   "was not reading (every rank's log file has them)\n"};
        st.unsaid = 0;
      }
      st.writing = true;
    }
    // Not under the lock: write() may block for as long as the reader does not read.
    Status written = WriteAll(chunk.fd, chunk.text, "write to the console");
    {
      MutexLock lock(st.mu);
      st.writing = false;
      if (!written.ok()) {
        // The reader is gone (EPIPE) or the fd is unusable: nothing more can be shown.
        st.broken = true;
        st.dropped += chunk.text.size() + st.queued_bytes;
        st.queue.clear();
        st.queued_bytes = 0;
        st.unsaid = 0;
      }
    }
    st.changed.NotifyAll();
  }
}

}  // namespace jaxtrain::controller
