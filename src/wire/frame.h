// The control protocol's framing. Every message between the controller and a worker is one frame:
//
//   u32 big-endian length of what follows | u8 message type | body (length - 1 bytes)
//
// Bodies: kHello, kChallenge, kAuth are fixed-size binary (handshake.h); kReport is a u64
// big-endian round number followed by the metrics as JSON; kReportCheckpoint adds the rank's
// checkpoint (below); kCollective and kCollectiveRelease are a u64 big-endian sequence number, a
// u8 kind and the data (below); kPayload is opaque bytes; the rest are JSON objects. The full
// message sequence is drawn in docs/wire.md. FrameDecoder never allocates more than its limit,
// whatever the peer sends, and no encoder truncates a length: a body too large for its length field
// is an error.
//
// After the handshake (kHello, kChallenge, kAuth: handshake.h) every frame, both ways, is sealed:
//
//   u32 big-endian length (1 + body + 16) | u8 type | ChaCha20-Poly1305 of the body
//
// under the connection's session (ControlSession(): keys from the handshake's two messages, one
// per direction), the frame's 5-byte header its additional data and the direction's frame number
// (from 0) its nonce, as the secure channel's records (channel.h). A frame changed, dropped,
// repeated, reordered or injected on the way does not open, and the connection ends. A body that
// many connections get alike (the payload, a collective's release) is sealed once, under a fresh
// random key (SealShared()); each connection gets that key in a kSharedKey frame sealed by its own
// session, right before the shared frame, which the key then opens once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "base/status.h"
#include "wire/channel.h"
#include "wire/handshake.h"

namespace jaxtrain::wire {

enum class MessageType : uint8_t {
  kHello = 1,      // worker -> controller: who I am, my nonce
  kChallenge = 2,  // controller -> worker: proof the controller holds the secret, its nonce
  kAuth = 3,       // worker -> controller: proof the worker holds the secret
  kRegister = 4,   // worker -> controller: host, pid, and (rank 0) the JAX coordinator address
  kStart = 5,      // controller -> worker: the JAX coordinator and the run's context
  kPayload = 6,    // controller -> worker: the pickled training function and its config
  kReport = 7,     // worker -> controller: one report() round's metrics
  kError = 8,      // worker -> controller: the training function raised; traceback
  kDone = 9,       // worker -> controller: the training function returned
  kReportCheckpoint = 10,  // worker -> controller: a report() round with this rank's checkpoint
  kRefused = 11,           // controller -> worker: its proven hello is refused; the reason as text
  // controller -> worker: a checkpoint this rank reported has been committed (or its commit
  // ended otherwise), or no commit is ahead of it any more; the worker may snapshot its next one
  kCheckpointSettled = 12,
  // worker -> controller: a jaxtrain.collective call (barrier, broadcast_from_rank_zero): its
  // sequence number, its kind and, for rank 0's broadcast, the pickled data
  kCollective = 13,
  // controller -> worker: every rank has made that call: its sequence number, its kind and, for a
  // broadcast, rank 0's data
  kCollectiveRelease = 14,
  // worker -> controller: a preemption notice this rank's host received, or its answer to the
  // controller's query (how many get_preemption_info() calls and report rounds it has made)
  kPreemption = 16,
  // controller -> worker: the query, the agreed preemption, "noted" or "stop" (docs/wire.md)
  kPreemptionReply = 17,
  // controller -> worker: is this rank's process alive? (empty; asked of ranks the progress
  // watchdog finds stale together, answered by the worker's connection thread)
  kPing = 18,
  // worker -> controller: the answer to a kPing (empty)
  kPong = 19,
  // controller -> worker: the key of the shared frame that follows (SealShared())
  kSharedKey = 20,
};
constexpr uint8_t kMaxMessageType = 20;

constexpr size_t kFrameHeaderSize = 5;
// The largest body the u32 length field can describe (it counts the type byte too).
constexpr size_t kMaxFrameBody = 0xffffffffu - 1;
// The largest body the controller accepts from an authenticated worker (reports, tracebacks).
constexpr size_t kMaxWorkerFrameBody = size_t{16} << 20;
// The largest body a worker accepts from the controller (the pickled training function).
constexpr size_t kMaxControllerFrameBody = (size_t{1} << 31) - 1;
// What sealing adds to a body (the AEAD's tag): the decoders' limits after the handshake are the
// limits above plus this.
constexpr size_t kSealedFrameOverhead = kRecordTagSize;
// The fixed part of a kReport body (the round) and of a kReportCheckpoint body (round, length).
constexpr size_t kReportHeaderSize = 8;
constexpr size_t kCheckpointReportHeaderSize = 12;
// The fixed part of a kCollective or kCollectiveRelease body (sequence number, kind).
constexpr size_t kCollectiveHeaderSize = 9;
// The most data broadcast_from_rank_zero() carries (the pickled object): small objects, as in
// Ray Train; a worker refuses more before it sends anything.
constexpr size_t kMaxCollectiveData = size_t{1} << 20;

struct Frame {
  MessageType type;
  std::string body;
};

// A frame whose body is a view into the decoder's buffer (FrameDecoder::NextView()).
struct FrameView {
  MessageType type;
  std::string_view body;
};

// A whole frame. Errors: kInvalidArgument when the body is larger than kMaxFrameBody.
StatusOr<std::string> EncodeFrame(MessageType type, std::string_view body);
// The 5-byte header of a frame whose body of `body_size` bytes is sent separately (a body shared
// by many connections). Errors: as EncodeFrame().
StatusOr<std::string> EncodeFrameHeader(MessageType type, size_t body_size);

// The kReport body.
std::string EncodeReportBody(uint64_t round, std::string_view metrics_json);
// Errors: kDataLoss when the body is shorter than the round number.
Status DecodeReportBody(std::string_view body, uint64_t* round, std::string_view* metrics_json);

// The kReportCheckpoint body: u64 round, u32 length of the checkpoint JSON, the checkpoint JSON,
// then the metrics JSON. Errors: kInvalidArgument when the checkpoint JSON is larger than its u32
// length field.
StatusOr<std::string> EncodeCheckpointReportBody(uint64_t round, std::string_view checkpoint_json,
                                                 std::string_view metrics_json);
// Errors: kDataLoss when the body is too short for its lengths.
Status DecodeCheckpointReportBody(std::string_view body, uint64_t* round,
                                  std::string_view* checkpoint_json,
                                  std::string_view* metrics_json);

// The kCollective and kCollectiveRelease body: u64 sequence number, u8 kind, then the data.
std::string EncodeCollectiveBody(uint64_t sequence, uint8_t kind, std::string_view data);
// Errors: kDataLoss when the body is shorter than its sequence number and kind.
Status DecodeCollectiveBody(std::string_view body, uint64_t* sequence, uint8_t* kind,
                            std::string_view* data);

// The session of a control connection after its handshake, at `end` (the worker initiates, the
// controller responds): keys from "jaxtrain-control-keys" and the handshake's kHello and
// kChallenge bodies, which hold both nonces and both ends (the controller's proof, and the rank,
// attempt and pid of the worker), so no two connections share a key.
Session ControlSession(std::string_view secret, std::string_view hello, std::string_view challenge,
                       SessionEnd end);

// A frame sealed once for many connections (the payload, a collective's release).
struct SharedFrame {
  Mac key{};                                 // fresh and random: it opens this frame only
  std::shared_ptr<const std::string> frame;  // the whole frame, as every connection sends it
};
// Errors: kInvalidArgument when the body is too large for a frame.
StatusOr<SharedFrame> SealShared(MessageType type, std::string_view body);
// The frame's type and body, opened with its key (what a worker reads; for tests and fakes).
// Errors: kUnauthenticated when it does not open; kDataLoss when it is not one whole frame.
StatusOr<Frame> OpenShared(const SharedFrame& shared);

// One end of a control connection after the handshake: seals the frames it sends and opens the
// ones it receives (above). Sending and receiving may run on two threads; each on one at a time.
class SealedFrames {
 public:
  SealedFrames() = default;
  explicit SealedFrames(Session session) : session_(std::move(session)) {}

  // Appends the sealed frame to `*out` (its capacity reused). Errors: kInvalidArgument when the
  // body is too large for a frame; kFailedPrecondition when the frame numbers ran out.
  Status Seal(MessageType type, std::string_view body, std::string* out);
  // Appends the kSharedKey frame that opens `shared`, to be sent right before it. Errors: as
  // Seal().
  Status SealKeyOf(const SharedFrame& shared, std::string* out);
  // Opens a received frame, `size` bytes of body at `body`, in place. Returns the frame with its
  // plaintext body (a view of `body`), or nothing for a kSharedKey frame (its key opens the next
  // frame). Errors: kUnauthenticated when it was not sealed by the other end as its next frame
  // (changed, forged, dropped, repeated, reordered or injected); every later call fails too and
  // the connection must end.
  StatusOr<std::optional<FrameView>> Open(MessageType type, char* body, size_t size);

 private:
  Session session_;
  std::optional<Mac> shared_key_;  // from a kSharedKey frame: opens the next frame
  bool broken_ = false;
};

// Splits a byte stream into frames.
class FrameDecoder {
 public:
  // `max_body` bounds a frame's body; a larger announced length is an error before any of it is
  // buffered.
  explicit FrameDecoder(size_t max_body) : max_body_(max_body) {}
  void set_max_body(size_t max_body) { max_body_ = max_body; }

  // Appends received bytes (callers feed bounded chunks). Errors: kDataLoss for a zero length, a
  // length above the limit or an unknown message type in the next frame's header, so an oversized
  // frame is refused before its body is buffered. After an error the decoder must be discarded.
  Status Feed(std::string_view bytes);

  // The next complete frame, if one has arrived. A frame's header is checked against the limit in
  // force when the frame becomes the next one, so a caller may change the limit after each frame
  // (e.g. once the peer has authenticated). Errors: as for Feed().
  StatusOr<std::optional<Frame>> Next();
  // As Next(), without copying the body (no allocation per frame): the view is valid until the
  // next call of Feed(), Next() or NextView().
  StatusOr<std::optional<FrameView>> NextView();
  // The body of the frame NextView() returned last, writable (a sealed body is opened in place),
  // as long as that view is valid.
  char* last_body() { return buffer_.data() + last_body_; }

  size_t buffered() const { return buffer_.size() - consumed_; }
  // Bytes allocated for the buffer; none beyond std::string's inline capacity once every frame
  // received has been taken.
  size_t capacity() const { return buffer_.capacity(); }

 private:
  Status CheckHead();
  // Once every buffered frame has been taken: empties the buffer, and frees it when it is large.
  void ReleaseConsumed();

  size_t max_body_;
  std::string buffer_;
  size_t consumed_ = 0;        // start of the next frame
  size_t last_body_ = 0;       // start of the body NextView() returned last
  bool head_checked_ = false;  // whether the next frame's header passed CheckHead()
};

}  // namespace jaxtrain::wire
