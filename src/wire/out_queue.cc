#include "wire/out_queue.h"

#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstring>

namespace jaxtrain::wire {
namespace {

constexpr size_t kMaxIov = 16;  // chunks handed to one sendmsg()

}  // namespace

void OutQueue::Push(std::string bytes) {
  if (bytes.empty()) return;
  Compact();
  pending_bytes_ += bytes.size();
  owned_bytes_ += bytes.size();
  chunks_.push_back({.owned = std::move(bytes)});
}

void OutQueue::PushShared(std::shared_ptr<const std::string> bytes) {
  if (!bytes || bytes->empty()) return;
  Compact();
  pending_bytes_ += bytes->size();
  chunks_.push_back({.shared = std::move(bytes)});
}

void OutQueue::Consume(size_t n) {
  pending_bytes_ -= n;
  while (n > 0) {
    Chunk& c = chunks_[head_];
    size_t left = c.rest().size();
    if (n < left) {
      c.offset += n;
      if (!c.shared) owned_bytes_ -= n;
      return;
    }
    n -= left;
    if (!c.shared) owned_bytes_ -= left;
    c = Chunk{};
    if (++head_ == chunks_.size()) {
      std::vector<Chunk>().swap(chunks_);
      head_ = 0;
    }
  }
}

void OutQueue::Compact() {
  if (head_ > 0 && head_ * 2 >= chunks_.size()) {
    chunks_.erase(chunks_.begin(), chunks_.begin() + static_cast<std::ptrdiff_t>(head_));
    head_ = 0;
  }
}

Status OutQueue::Flush(int fd) {
  while (!empty()) {
    iovec iov[kMaxIov];
    size_t count = 0;
    for (size_t i = head_; i < chunks_.size() && count < kMaxIov; ++i) {
      std::string_view rest = chunks_[i].rest();
      iov[count++] = {const_cast<char*>(rest.data()), rest.size()};
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = count;
    ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return OkStatus();
    if (n < 0) {
      send_errno_ = errno;
      return UnavailableError(std::string("connection lost while sending: ") +
                              std::strerror(send_errno_));
    }
    Consume(static_cast<size_t>(n));
  }
  return OkStatus();
}

}  // namespace jaxtrain::wire
