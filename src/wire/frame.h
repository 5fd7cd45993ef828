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
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "base/status.h"

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
};
constexpr uint8_t kMaxMessageType = 19;

constexpr size_t kFrameHeaderSize = 5;
// The largest body the u32 length field can describe (it counts the type byte too).
constexpr size_t kMaxFrameBody = 0xffffffffu - 1;
// The largest body the controller accepts from an authenticated worker (reports, tracebacks).
constexpr size_t kMaxWorkerFrameBody = size_t{16} << 20;
// The largest body a worker accepts from the controller (the pickled training function).
constexpr size_t kMaxControllerFrameBody = (size_t{1} << 31) - 1;
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
  bool head_checked_ = false;  // whether the next frame's header passed CheckHead()
};

}  // namespace jaxtrain::wire
