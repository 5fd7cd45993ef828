// ControlPort: the controller's control port — its listening socket and every connection to it —
// up to the point where a connection is a rank's, and the framed, non-blocking sends to the ranks.
//
// A peer must complete the handshake (wire/handshake.h, docs/wire.md) within the handshake
// timeout, for a rank of the current attempt that has no connection yet; anything else is closed
// without a reply beyond the handshake. A connection is "unproven" until it has sent a hello made
// with the run's secret: at most MaxUnproven(world size) are held, the oldest dropped first when
// another arrives, so a flood of them never keeps a worker out (a worker whose connection is
// dropped connects again). A hello's nonce is answered once per attempt: a replayed hello is
// refused.
//
// Once a connection is a rank's, every frame both ways is sealed with the session its handshake
// derived (wire/frame.h): a frame that does not open (changed, forged, replayed, reordered or
// injected on the way) is reported to the delegate (OnBadFrame) and the connection closed at once,
// before anything of it is parsed.
//
// Buffers are bounded: a connection's decoder holds at most one frame under the limit of its
// stage plus one read chunk, and its queue only the frames sent to it (a shared frame, such as the
// payload every rank gets, is sealed once and queued by reference, not copied).
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
//
// An interface, because it is where the controller meets the network: Create() makes the TCP
// port; tests of the controller's state machine use FakeControlPort (testing/).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/clock.h"
#include "base/status.h"
#include "wire/frame.h"

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
    // the owner closes it, except after a frame that failed authentication: the port has closed
    // it (OnClosed follows).
    virtual void OnBadFrame(int rank, const std::string& what) = 0;
    // `rank`'s connection has closed: the peer closed it, a send failed, or Close(rank).
    // `timed_out`: the kernel gave up on the peer (its keepalive probes or retransmissions went
    // unanswered, or its host became unreachable): the host may be cut off or frozen.
    virtual void OnClosed(int rank, bool timed_out) = 0;
    // A line for the driver's log: refused connections (the first few), a flood being dropped.
    virtual void Say(const std::string& line) = 0;
  };

  // The port over TCP. Takes `listen_fd` (a listening, non-blocking socket), closed with the
  // port. Hellos must be made with `secret`. Errors: kResourceExhausted / kInternal when the epoll
  // set cannot be made.
  static StatusOr<std::unique_ptr<ControlPort>> Create(int listen_fd, std::string secret,
                                                       const Clock& clock,
                                                       Duration handshake_timeout,
                                                       Delegate& delegate);
  // The cap on unproven connections of the TCP port for `world_size` ranks: 2 x world size + 64.
  static size_t MaxUnproven(size_t world_size) { return world_size * 2 + 64; }

  // Closes every connection, without telling the delegate, and the listener.
  virtual ~ControlPort() = default;

  // A new attempt: every connection is closed (the delegate is not told), and from now on hellos
  // are answered for ranks below `world_size` of `attempt` only.
  virtual void BeginAttempt(int attempt, size_t world_size) = 0;

  // For the owner's poll(): the listener, readable when a peer is waiting to be accepted (-1 for
  // a port without one), and a descriptor readable when a connection has events.
  virtual int listen_fd() const = 0;
  virtual int ready_fd() const = 0;

  // Handles the connections' events: at most 1,024 per call, the rest stay ready.
  virtual void OnConnsReady() = 0;
  // Accepts waiting peers, at most half the unproven cap per call, each read at once (its hello
  // is often there already). Call it after OnConnsReady(): a connection accepted in one call is
  // read again before enough newer ones can arrive to push it out.
  virtual void Accept() = 0;
  // Closes the connections whose handshake deadline has passed.
  virtual void ExpireHandshakes() = 0;
  // The next handshake deadline, if a connection is in its handshake.
  virtual std::optional<TimePoint> NextDeadline() = 0;
  // Frees the closed connections.
  virtual void Sweep() = 0;

  virtual bool connected(int rank) const = 0;
  // Queues a frame for `rank` and writes what its socket takes now; nothing when it has no
  // connection. `body` is one of the controller's own messages: never over the frame limit.
  virtual void Send(int rank, wire::MessageType type, std::string_view body) = 0;
  // Queues a frame sealed once for many ranks (wire::SealShared()), by reference, after the
  // kSharedKey frame that opens it; as Send() otherwise.
  virtual void SendShared(int rank, const wire::SharedFrame& shared) = 0;
  // Reads what `rank`'s connection has received now (the last frames of a process that exited).
  virtual void Read(int rank) = 0;
  // Closes `rank`'s connection (OnClosed follows); nothing when it has none.
  virtual void Close(int rank) = 0;

  // Unproven connections dropped in this attempt (pushed out by newer ones, or timed out).
  virtual int dropped() const = 0;
};

}  // namespace jaxtrain::controller
