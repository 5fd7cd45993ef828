// OutQueue: the bytes waiting to be written to one non-blocking socket, in the order queued.
//
// A body that many connections send (the pickled training function, to every rank) is queued as a
// shared reference, not copied, so N connections waiting for the same payload hold it once:
// O(payload), not O(N x payload). Not thread-safe (one owner, e.g. the controller's loop).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace jaxtrain::wire {

class OutQueue {
 public:
  void Push(std::string bytes);
  // `bytes` is read, never copied, until it has been written.
  void PushShared(std::shared_ptr<const std::string> bytes);

  bool empty() const { return head_ == chunks_.size(); }
  // Bytes queued and not yet written, shared ones included.
  size_t pending_bytes() const { return pending_bytes_; }
  // Bytes this queue holds a copy of (queued with Push and not yet written).
  size_t owned_bytes() const { return owned_bytes_; }

  // Writes as much as the socket takes now, without blocking. Errors: kUnavailable when the peer
  // is gone (the queue is then left as it was; send_errno() says why).
  Status Flush(int fd);
  // The errno of the last Flush() that failed (a socket's pending error, such as ETIMEDOUT, is
  // taken by the send that meets it); 0 when none failed.
  int send_errno() const { return send_errno_; }

 private:
  struct Chunk {
    std::string owned;
    std::shared_ptr<const std::string> shared;
    size_t offset = 0;  // bytes of it already written
    std::string_view rest() const {
      return std::string_view(shared ? *shared : owned).substr(offset);
    }
  };
  void Consume(size_t n);
  // Drops the chunks already written once they are half of the vector.
  void Compact();

  // chunks_[head_ ..] are queued. An empty queue holds no allocation: thousands of idle
  // connections keep nothing (a std::deque allocates its first block even when empty).
  std::vector<Chunk> chunks_;
  size_t head_ = 0;
  int send_errno_ = 0;
  size_t pending_bytes_ = 0;
  size_t owned_bytes_ = 0;
};

}  // namespace jaxtrain::wire
