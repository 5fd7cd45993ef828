// ControlPort: the controller's control port — its listening socket and every connection to it —
// up to the point where a connection is a rank's, and the framed, non-blocking sends to the ranks.
//
// A peer must complete the handshake (wire/handshake.h, docs/wire.md) within the handshake
// timeout, for a rank of the current attempt that has no connection yet; anything else is closed
// without a reply beyond the handshake. A connection is "unproven" until it has sent a hello made
// with the run's secret: at most MaxUnproven() are held, the oldest dropped first when another
// arrives, so a flood of them never keeps a worker out (a worker whose connection is dropped
// connects again). A hello's nonce is answered once per attempt: a replayed hello is refused.
//
// Buffers are bounded: a connection's decoder holds at most one frame under the limit of its
// stage plus one read chunk, and its queue only the frames sent to it (a shared body, such as the
// payload every rank gets, is queued by reference, not copied).
//
// Connection states:
//
//   accepted ──hello with the secret──> answered ──auth proof──> the rank's ──close──> closed
//      │  (unproven: capped, the oldest      │   (Delegate::OnFrame for
//      │   dropped first)                    │    each frame from here on)
//      └──── bad hello / deadline / cap ─────┴──> refused (closed; a peer that proved the
//                                                 secret is told why in a kRefused frame)
//
// Threads: not thread-safe; one owner (the controller's loop) calls every method. The Delegate is
// called from within OnConnsReady(), Accept(), ExpireHandshakes(), Send(), Read() and Close(), and
// may call back into the port (send to other ranks, close a connection). Closed connections are
// freed by Sweep(), which the owner calls when no call into the port is under way.
#pragma once

#include <deque>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "base/clock.h"
#include "base/status.h"
#include "wire/frame.h"
#include "wire/handshake.h"
#include "wire/out_queue.h"

namespace jaxtrain::controller {

class ControlPort {
 public:
  // What the port tells its owner about the ranks' connections.
  class Delegate {
   public:
    virtual ~Delegate() = default;
    // A frame from `rank`'s connection, which has completed the handshake.
    virtual void OnFrame(int rank, const wire::FrameView& frame) = 0;
    // `rank`'s connection sent what is not a valid frame (`what` says why). It stays open until
    // the owner closes it.
    virtual void OnBadFrame(int rank, const std::string& what) = 0;
    // `rank`'s connection has closed: the peer closed it, a send failed, or Close(rank).
    virtual void OnClosed(int rank) = 0;
    // A line for the driver's log: refused connections (the first few), a flood being dropped.
    virtual void Say(const std::string& line) = 0;
  };

  // Takes `listen_fd` (a listening, non-blocking socket), closed with the port. Hellos must be
  // made with `secret`. Errors: kResourceExhausted / kInternal when the epoll set cannot be made.
  static StatusOr<std::unique_ptr<ControlPort>> Create(int listen_fd, std::string secret,
                                                       const Clock& clock,
                                                       Duration handshake_timeout,
                                                       Delegate& delegate);
  ~ControlPort();  // closes every connection, without telling the delegate, and the listener
  ControlPort(const ControlPort&) = delete;
  ControlPort& operator=(const ControlPort&) = delete;

  // A new attempt: every connection is closed (the delegate is not told), and from now on hellos
  // are answered for ranks below `world_size` of `attempt` only.
  void BeginAttempt(int attempt, size_t world_size);

  // For the owner's poll(): the listener, readable when a peer is waiting to be accepted, and a
  // descriptor readable when a connection has events.
  int listen_fd() const { return listen_fd_; }
  int ready_fd() const { return epoll_fd_; }

  // Handles the connections' events: at most 1,024 per call, the rest stay ready.
  void OnConnsReady();
  // Accepts waiting peers, at most half the unproven cap per call, each read at once (its hello
  // is often there already). Call it after OnConnsReady(): a connection accepted in one call is
  // read again before enough newer ones can arrive to push it out.
  void Accept();
  // Closes the connections whose handshake deadline has passed.
  void ExpireHandshakes();
  // The next handshake deadline, if a connection is in its handshake.
  std::optional<TimePoint> NextDeadline();
  // Frees the closed connections.
  void Sweep();

  bool connected(int rank) const { return by_rank_[static_cast<size_t>(rank)] != nullptr; }
  // Queues a frame for `rank` and writes what its socket takes now; nothing when it has no
  // connection. `body` is one of the controller's own messages: never over the frame limit.
  void Send(int rank, wire::MessageType type, std::string_view body);
  // Queues bytes shared by many ranks (already framed), by reference; as Send() otherwise.
  void SendShared(int rank, const std::vector<std::shared_ptr<const std::string>>& parts);
  // Reads what `rank`'s connection has received now (the last frames of a process that exited).
  void Read(int rank);
  // Closes `rank`'s connection (OnClosed follows); nothing when it has none.
  void Close(int rank);

  // The cap on unproven connections: 2 x world size + 64.
  size_t MaxUnproven() const { return by_rank_.size() * 2 + 64; }
  // Unproven connections dropped in this attempt (pushed out by newer ones, or timed out).
  int dropped() const { return dropped_; }

 private:
  struct Conn {
    int fd = -1;
    std::string peer;
    wire::FrameDecoder decoder{wire::kHelloSize};
    wire::OutQueue out;
    // kHello: nothing valid received yet (unproven). kAuth: its hello was made with the secret
    // and answered. kAuthed: the connection is `rank`'s.
    enum class Stage { kHello, kAuth, kAuthed } stage = Stage::kHello;
    wire::Hello hello;
    wire::Nonce nonce{};
    TimePoint deadline;
    int rank = -1;
    bool closed = false;
    bool watching_out = false;  // EPOLLOUT is in its interest set
  };

  ControlPort(int listen_fd, int epoll_fd, std::string secret, const Clock& clock,
              Duration handshake_timeout, Delegate& delegate);

  void DropOldestUnproven();
  void Refuse(Conn& c, const std::string& why, bool tell = false);
  void CloseConn(Conn& c);
  void Flush(Conn& c);
  void ReadConn(Conn& c);
  void DecoderError(Conn& c, const Status& s);
  void OnFrame(Conn& c, const wire::FrameView& f);
  void OnHello(Conn& c, const wire::FrameView& f);
  void OnAuth(Conn& c, const wire::FrameView& f);
  const Conn* OldestHandshaking();

  const int listen_fd_;
  const int epoll_fd_;  // every open connection (data.ptr: its Conn): a wake costs O(ready)
  const std::string secret_;
  const Clock& clock_;
  const Duration handshake_timeout_;
  Delegate& delegate_;

  int attempt_ = 0;
  std::vector<std::unique_ptr<Conn>> conns_;
  std::vector<Conn*> by_rank_;   // the rank's authenticated connection, or null
  std::vector<Conn*> answered_;  // by rank: the connection whose hello was answered, until auth
  // Connections not yet authenticated, in accept order, which is their deadlines' order (the same
  // timeout from a monotonic clock); closed or authenticated ones are skipped.
  std::deque<Conn*> handshaking_;
  std::deque<Conn*> unproven_;  // Stage::kHello connections, oldest first; stale entries skipped
  size_t unproven_count_ = 0;   // the live ones among them
  std::set<wire::Nonce> hello_nonces_;  // of this attempt's answered hellos
  bool any_closed_ = false;             // a connection was closed since the last Sweep()
  int dropped_ = 0;
  int refusals_ = 0;  // of the whole run: only the first few are said
};

}  // namespace jaxtrain::controller
