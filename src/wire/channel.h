// The secure channel: how every jaxtrain connection other than the control port's is made — the
// hosts' joins and relay sessions of a run started on every host (python/jaxtrain/hosts/join.py)
// and the peer copies of checkpoints (python/jaxtrain/worker/checkpoint_peers.py). Two ends that
// hold the same secret prove it to each other, bound to what the connection is for and to both
// ends' names, derive session keys from the handshake, and then exchange records that are encrypted
// and authenticated in order. docs/security.md says what it protects; docs/wire.md draws it. The
// control port keeps its own handshake (handshake.h) and framing (frame.h), and seals its frames
// with this record layer: Session::FromHandshake() and SealAfter()/OpenAfter().
//
// Every message on the wire is a u32 big-endian length followed by that many bytes.
//
//   initiator -> responder  open:    "JXCH" | u16 version | purpose | initiator | responder
//                                    (each: u16 length, bytes) | nonce_i (32) |
//                                    HMAC(secret, "jaxtrain-channel-open" | all of the above)
//   responder -> initiator  accept:  'A' | nonce_r (32) |
//                                    HMAC(secret, "jaxtrain-channel-accept" | open | 'A' | nonce_r)
//                       or  refuse:  'R' | reason | HMAC(secret, "jaxtrain-channel-refuse" | open |
//                                    'R' | reason)
//   initiator -> responder  confirm: HMAC(secret, "jaxtrain-channel-confirm" | open | accept)
//   then, either way         record:  ChaCha20-Poly1305 (IETF) of the plaintext under the
//                                    direction's key, the nonce the direction's record number
//                                    (u96, from 0), the record's length as additional data
//
// Keys: k = HMAC(secret, "jaxtrain-channel-keys" | open | accept); the initiator's records are
// sealed with HMAC(k, "initiator"), the responder's with HMAC(k, "responder").
//
// Why each part: the open's MAC lets a responder drop a peer without the secret before it answers
// anything (and answer nothing but a refusal it cannot check); the purpose and both names in every
// proof stop a proof made for one connection (a join, say) from opening another (an agent
// session), so relaying a handshake gains nothing; both nonces make every proof and key fresh, so
// nothing recorded can be replayed; the session keys make every later byte (commands, stdin,
// output, files) unreadable and unchangeable by anyone on the path, and the record numbers make a
// dropped, repeated or reordered record an error. A responder refuses an open for another purpose
// or another name with a refusal the initiator can check; to an open without a valid MAC it sends
// an unauthenticated refusal (the initiator can only say the two ends do not share the secret).
//
// Thread safety: the handshake objects are single-threaded; a Session and a Channel may send on
// one thread while they receive on another.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/clock.h"
#include "base/status.h"
#include "wire/handshake.h"

namespace jaxtrain::wire {

constexpr uint16_t kChannelVersion = 1;
// The longest purpose or end name.
constexpr size_t kMaxChannelName = 256;
// The longest refusal reason a responder sends (longer ones are cut).
constexpr size_t kMaxRefusal = 512;
// The largest plaintext of one record; larger messages are split by the sender (Channel::Send).
constexpr size_t kMaxRecordPlaintext = size_t{1} << 20;
constexpr size_t kRecordTagSize = 16;  // crypto_aead_chacha20poly1305_IETF_ABYTES
// The largest handshake message (an open with two full-length names and purpose).
constexpr size_t kMaxHandshakeMessage = 4 + 2 + 3 * (2 + kMaxChannelName) + kNonceSize + kMacSize;

// What a connection is for, and the names of its two ends. Each is 1 to kMaxChannelName bytes.
struct ChannelEnds {
  std::string purpose;    // e.g. "jaxtrain-join"
  std::string initiator;  // the connecting end, e.g. "host-1"
  std::string responder;  // the accepting end as the initiator means it, e.g. "host-0"
};

// Which end of a handshake a Session is: the one that connected or the one that accepted.
enum class SessionEnd { kInitiator, kResponder };

// The record layer once a handshake has finished: one key and record counter per direction.
class Session {
 public:
  Session() = default;
  Session(const Mac& send_key, const Mac& receive_key);
  // The session of `end` after a handshake whose messages are `transcript` (both nonces, both
  // ends' names and the purpose among them): k = HMAC(secret, label | transcript); the
  // initiator's records are sealed with HMAC(k, "initiator"), the responder's with
  // HMAC(k, "responder"). Every connection jaxtrain opens derives its keys here.
  static Session FromHandshake(std::string_view secret, std::string_view label,
                               std::string_view transcript, SessionEnd end);

  // `plaintext` (at most kMaxRecordPlaintext bytes) as one whole record: its length, then the
  // sealed bytes. Errors: kInvalidArgument when too long.
  StatusOr<std::string> Seal(std::string_view plaintext);
  // Seal() into `*out`, whose capacity is reused.
  Status SealInto(std::string_view plaintext, std::string* out);
  // The plaintext of the next record, given the bytes after its length. Errors: kUnauthenticated
  // when it was not sealed by the other end as its next record (forged, changed, dropped,
  // repeated or reordered); the session is unusable afterwards.
  StatusOr<std::string> Open(std::string_view sealed);
  // Open() into `out` (`capacity` bytes, not overlapping `sealed`); returns the plaintext's
  // length. Errors: as Open(), and kInvalidArgument when the plaintext would not fit.
  StatusOr<size_t> OpenInto(std::string_view sealed, char* out, size_t capacity);
  // The length a record of `plaintext_size` bytes has on the wire after its length field.
  static size_t SealedSize(size_t plaintext_size) { return plaintext_size + kRecordTagSize; }

  // The record layer under another framing (the control port's frames, wire/frame.h): seals
  // `plaintext` as the next record with `header` (the frame's header, sent in the clear) as its
  // additional data, into out[0, SealedSize(plaintext.size())). No size limit: the framing has
  // its own. Errors: kFailedPrecondition when the record numbers ran out.
  Status SealAfter(std::string_view header, std::string_view plaintext, char* out);
  // Opens the next record sealed after `header` into `out` (which may be `sealed.data()`:
  // opened in place), returning the plaintext's length. Errors: kUnauthenticated as Open().
  StatusOr<size_t> OpenAfter(std::string_view header, std::string_view sealed, char* out);

 private:
  std::array<uint8_t, 32> send_key_{};
  std::array<uint8_t, 32> receive_key_{};
  uint64_t sent_ = 0;
  uint64_t received_ = 0;
  bool broken_ = false;
};

// The connecting end's side of the handshake.
class ChannelInitiator {
 public:
  // Errors of the ends (empty or too long) surface from Open(). `nonce`: a fixed one, for the
  // fuzzers only (a fresh random one otherwise).
  ChannelInitiator(std::string_view secret, ChannelEnds ends,
                   std::optional<Nonce> nonce = std::nullopt);

  // The open message's body. Errors: kInvalidArgument naming an empty or too long field.
  StatusOr<std::string> Open();
  // The responder's answer (accept or refuse). On accept: the confirm message's body, and
  // `*session` ready. Errors: kPermissionDenied with the responder's reason when it refused with
  // a refusal made with the secret; kUnauthenticated when the answer was not made with the secret
  // (a wrong secret on either end, or someone else answering); kDataLoss for a malformed answer.
  StatusOr<std::string> OnAnswer(std::string_view answer, Session* session);

 private:
  std::string secret_;
  ChannelEnds ends_;
  Nonce nonce_{};
  std::string open_;
};

// The accepting end's side of the handshake.
class ChannelResponder {
 public:
  // `purpose` and `me`: what this end accepts connections for, and its own name; an open that
  // names another purpose or another responder is refused.
  ChannelResponder(std::string_view secret, std::string purpose, std::string me);

  // Checks an open. OK: the peer holds the secret and means this end; the answer to send is
  // Accept() or Refuse(). Errors: kUnauthenticated (malformed, or not made with the secret: send
  // UnauthenticatedRefusal() and close), kPermissionDenied naming what does not match (send
  // Refuse(message)).
  Status OnOpen(std::string_view open);
  // The initiator's name from a checked open.
  const std::string& initiator() const { return initiator_; }
  // The accept message's body (after OnOpen returned OK).
  std::string Accept();
  // A refusal the initiator can check (after OnOpen returned OK or kPermissionDenied).
  std::string Refuse(std::string_view reason);
  // The refusal sent to an open without a valid MAC.
  static std::string UnauthenticatedRefusal();
  // The initiator's confirm. OK: `*session` ready. Errors: kUnauthenticated.
  Status OnConfirm(std::string_view confirm, Session* session);

 private:
  std::string secret_;
  std::string purpose_;
  std::string me_;
  std::string open_;
  std::string initiator_;
  std::string accept_;
  bool proven_open_ = false;
};

// A secure channel over a connected stream socket `fd` (blocking or not; not owned: the caller
// closes it once no call is in progress on any thread, or a waiting call could read from the
// next socket given that number). Sends and receives whole records, with deadlines.
class Channel {
 public:
  // The initiator's handshake. Errors: as ChannelInitiator::OnAnswer, kDeadlineExceeded when
  // `timeout` passes first, kUnavailable when the connection fails or closes.
  static StatusOr<Channel> Connect(int fd, std::string_view secret, const ChannelEnds& ends,
                                   Duration timeout);
  // The responder's handshake, all of it within `timeout`. `initiators`: the names accepted
  // (empty: any). Errors: kUnauthenticated, kPermissionDenied (a refusal was sent),
  // kDeadlineExceeded, kUnavailable.
  static StatusOr<Channel> Accept(int fd, std::string_view secret, std::string_view purpose,
                                  std::string_view me, const std::vector<std::string>& initiators,
                                  Duration timeout);

  Channel(Channel&& other) noexcept;
  Channel& operator=(Channel&& other) noexcept;

  // The other end's name.
  const std::string& peer() const { return peer_; }

  // Sends `data` as records of at most kMaxRecordPlaintext bytes (an empty `data` is one empty
  // record). Errors: kUnavailable when the connection fails, kDeadlineExceeded after `timeout`.
  Status Send(std::string_view data, Duration timeout);
  // The next record's plaintext. Errors: kUnavailable when the connection closes or fails (with
  // "closed" in its message on an orderly end), kDeadlineExceeded after `timeout`,
  // kUnauthenticated (see Session::Open), kDataLoss for a record longer than allowed.
  StatusOr<std::string> Receive(Duration timeout);
  // Receive() into `out` (`capacity` bytes, kMaxRecordPlaintext hold any record); returns the
  // record's length. Errors: as Receive(), and kInvalidArgument when the record would not fit.
  StatusOr<size_t> ReceiveInto(char* out, size_t capacity, Duration timeout);
  // Sends `size` bytes of the file open at `file_fd` from its start, in records. Errors: as
  // Send(), and kDataLoss when the file ends before `size` bytes.
  Status SendFile(int file_fd, uint64_t size, Duration timeout);

 private:
  Channel(int fd, Session session, std::string peer);

  int fd_;
  std::string peer_;
  Session session_;
  std::mutex send_mu_;
  std::string sealed_;       // the record being sent (send_mu_), its memory reused
  std::string file_buffer_;  // a file's bytes being sent (send_mu_)
  std::mutex receive_mu_;
  std::string received_;  // the record being received (receive_mu_)
};

}  // namespace jaxtrain::wire
