// Mailbox<T>: one result at a time, handed from a worker thread to an event loop. Post() stores
// it and makes fd() readable; Take() returns it once and makes fd() unreadable again. So the loop
// learns of a result through poll() and never sees the descriptor readable without a result.
//
// Threads: Post() from the worker thread, Take() and fd() from the loop's.
#pragma once

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "base/mutex.h"
#include "base/status.h"

namespace jaxtrain {

template <typename T>
class Mailbox {
 public:
  // Errors: as ErrnoError when the eventfd cannot be created; the message names `owner`.
  static StatusOr<std::unique_ptr<Mailbox>> Create(std::string_view owner) {
    int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (fd < 0) return ErrnoError("cannot create the " + std::string(owner) + "'s eventfd", errno);
    return std::unique_ptr<Mailbox>(new Mailbox(fd));
  }
  ~Mailbox() { close(fd_); }
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;

  // Readable while a result waits for Take().
  int fd() const { return fd_; }

  void Post(T value) EXCLUDES(mu_) {
    // Under the lock, so that Take() never reads the count back without the result.
    MutexLock lock(mu_);
    value_ = std::move(value);
    uint64_t one = 1;
    // Fails only when the counter would overflow, which leaves it readable: nothing is lost.
    [[maybe_unused]] ssize_t n = write(fd_, &one, sizeof(one));
  }

  // The result posted, once; nullopt while none waits.
  std::optional<T> Take() EXCLUDES(mu_) {
    std::optional<T> out;
    {
      MutexLock lock(mu_);
      if (!value_) return std::nullopt;
      out = std::move(value_);
      value_.reset();
    }
    uint64_t count;
    [[maybe_unused]] ssize_t n = read(fd_, &count, sizeof(count));
    return out;
  }

 private:
  explicit Mailbox(int fd) : fd_(fd) {}

  const int fd_;
  Mutex mu_;
  std::optional<T> value_ GUARDED_BY(mu_);
};

}  // namespace jaxtrain
