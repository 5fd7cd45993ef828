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
  pending_bytes_ += bytes.size();
  owned_bytes_ += bytes.size();
  chunks_.push_back({.owned = std::move(bytes)});
}

void OutQueue::PushShared(std::shared_ptr<const std::string> bytes) {
  if (!bytes || bytes->empty()) return;
  pending_bytes_ += bytes->size();
  chunks_.push_back({.shared = std::move(bytes)});
}

void OutQueue::Consume(size_t n) {
  pending_bytes_ -= n;
  while (n > 0) {
    Chunk& c = chunks_.front();
    size_t left = c.rest().size();
    if (n < left) {
      c.offset += n;
      if (!c.shared) owned_bytes_ -= n;
      return;
    }
    n -= left;
    if (!c.shared) owned_bytes_ -= left;
    chunks_.pop_front();
  }
}

Status OutQueue::Flush(int fd) {
  while (!chunks_.empty()) {
    iovec iov[kMaxIov];
    size_t count = 0;
    for (const Chunk& c : chunks_) {
      if (count == kMaxIov) break;
      std::string_view rest = c.rest();
      iov[count++] = {const_cast<char*>(rest.data()), rest.size()};
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = count;
    ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return OkStatus();
    if (n < 0) {
      return UnavailableError(std::string("connection lost while sending: ") +
                              std::strerror(errno));
    }
    Consume(static_cast<size_t>(n));
  }
  return OkStatus();
}

}  // namespace jaxtrain::wire
