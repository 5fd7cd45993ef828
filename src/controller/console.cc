#include "controller/console.h"

#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

namespace jaxtrain::controller {

Console::Console(size_t capacity) : capacity_(capacity), state_(std::make_unique<State>()) {
  writer_ = std::thread([this] { Run(*state_); });
}

Console::~Console() {
  Flush(kFlushOnDestruction);
  {
    MutexLock lock(state_->mu);
    state_->stop = true;
    state_->changed.NotifyAll();
  }
  writer_.join();  // a writer waiting for room sees `stop` within kStopCheckMs
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

void Console::Run(State& st) {
  // A reader that goes away makes write() fail with EPIPE here instead of killing the process:
  // SIGPIPE is raised in the thread that wrote, where it stays blocked.
  sigset_t pipe;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
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
    // Not under the lock: the reader may take its time.
    const Written written = WriteUnlessStopped(st, chunk.fd, chunk.text);
    if (written == Written::kStopped) return;
    {
      MutexLock lock(st.mu);
      st.writing = false;
      if (written == Written::kFailed) {
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

Console::Written Console::WriteUnlessStopped(State& st, int fd, std::string_view text) {
  while (!text.empty()) {
    pollfd out = {.fd = fd, .events = POLLOUT, .revents = 0};
    const int ready = poll(&out, 1, kStopCheckMs);
    if (ready < 0 && errno != EINTR) return Written::kFailed;
    if (ready <= 0) {
      MutexLock lock(st.mu);
      if (st.stop) return Written::kStopped;
      continue;
    }
    if (out.revents & POLLNVAL) return Written::kFailed;
    // At most PIPE_BUF: a pipe that polls writable takes that much without blocking.
    const ssize_t n = write(fd, text.data(), std::min<size_t>(text.size(), PIPE_BUF));
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return Written::kFailed;  // the reader is gone (EPIPE) or the fd is unusable
    }
    text.remove_prefix(static_cast<size_t>(n));
  }
  return Written::kAll;
}

}  // namespace jaxtrain::controller
