#include "wire/channel.h"

#include <poll.h>
#include <sodium.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "wire/big_endian.h"

namespace jaxtrain::wire {
namespace {

constexpr char kMagic[] = "JXCH";
constexpr char kAccept = 'A';
constexpr char kRefuse = 'R';
constexpr std::string_view kUnauthenticatedReason = "the two ends do not hold the same secret";

std::string_view View(const Mac& mac) {
  return {reinterpret_cast<const char*>(mac.data()), mac.size()};
}

std::string Labeled(std::string_view label, std::string_view a, std::string_view b = {},
                    std::string_view c = {}) {
  std::string out(label);
  out.append(a).append(b).append(c);
  return out;
}

Status CheckName(std::string_view field, std::string_view value) {
  if (value.empty() || value.size() > kMaxChannelName) {
    return InvalidArgumentError("the channel's " + std::string(field) + " has " +
                                std::to_string(value.size()) + " bytes; 1 to " +
                                std::to_string(kMaxChannelName) + " are allowed");
  }
  return OkStatus();
}

void PutName(std::string* out, std::string_view name) {
  out->push_back(static_cast<char>(name.size() >> 8));
  out->push_back(static_cast<char>(name.size() & 0xff));
  out->append(name);
}

// Takes a u16-length-prefixed name off the front of `*in`; false when it does not fit.
bool TakeName(std::string_view* in, std::string* name) {
  if (in->size() < 2) return false;
  size_t n = (static_cast<uint8_t>((*in)[0]) << 8) | static_cast<uint8_t>((*in)[1]);
  if (n == 0 || n > kMaxChannelName || in->size() < 2 + n) return false;
  name->assign(in->substr(2, n));
  in->remove_prefix(2 + n);
  return true;
}

// The 96-bit record nonce for record number `n`.
std::array<uint8_t, crypto_aead_chacha20poly1305_IETF_NPUBBYTES> RecordNonce(uint64_t n) {
  std::array<uint8_t, crypto_aead_chacha20poly1305_IETF_NPUBBYTES> nonce{};
  for (int i = 0; i < 8; ++i) nonce[4 + i] = static_cast<uint8_t>(n >> (56 - 8 * i));
  return nonce;
}

std::string LengthPrefix(size_t n) {
  std::string out;
  PutU32(&out, static_cast<uint32_t>(n));
  return out;
}

}  // namespace

// --- the record layer ----------------------------------------------------------------------------

Session::Session(const Mac& send_key, const Mac& receive_key) {
  std::copy(send_key.begin(), send_key.end(), send_key_.begin());
  std::copy(receive_key.begin(), receive_key.end(), receive_key_.begin());
}

Session Session::FromHandshake(std::string_view secret, std::string_view label,
                               std::string_view transcript, SessionEnd end) {
  Mac k = Hmac(secret, Labeled(label, transcript));
  Mac initiator_key = Hmac(View(k), "initiator");
  Mac responder_key = Hmac(View(k), "responder");
  Session session = end == SessionEnd::kInitiator ? Session(initiator_key, responder_key)
                                                  : Session(responder_key, initiator_key);
  sodium_memzero(k.data(), k.size());
  sodium_memzero(initiator_key.data(), initiator_key.size());
  sodium_memzero(responder_key.data(), responder_key.size());
  return session;
}

StatusOr<std::string> Session::Seal(std::string_view plaintext) {
  std::string out;
  JT_RETURN_IF_ERROR(SealInto(plaintext, &out));
  return out;
}

Status Session::SealInto(std::string_view plaintext, std::string* out) {
  if (plaintext.size() > kMaxRecordPlaintext) {
    return InvalidArgumentError("a record of " + std::to_string(plaintext.size()) +
                                " bytes; at most " + std::to_string(kMaxRecordPlaintext));
  }
  std::string length = LengthPrefix(SealedSize(plaintext.size()));
  out->resize(length.size() + SealedSize(plaintext.size()));  // reuses the capacity it has
  std::memcpy(out->data(), length.data(), length.size());
  return SealAfter(length, plaintext, out->data() + length.size());
}

Status Session::SealAfter(std::string_view header, std::string_view plaintext, char* out) {
  if (sent_ == UINT64_MAX) return FailedPreconditionError("the channel's record numbers ran out");
  auto nonce = RecordNonce(sent_++);
  unsigned long long sealed = 0;
  crypto_aead_chacha20poly1305_ietf_encrypt(
      reinterpret_cast<unsigned char*>(out), &sealed,
      reinterpret_cast<const unsigned char*>(plaintext.data()), plaintext.size(),
      reinterpret_cast<const unsigned char*>(header.data()), header.size(), nullptr, nonce.data(),
      send_key_.data());
  return OkStatus();
}

StatusOr<std::string> Session::Open(std::string_view sealed) {
  std::string plaintext(sealed.size() >= kRecordTagSize ? sealed.size() - kRecordTagSize : 0, '\0');
  JT_ASSIGN_OR_RETURN(size_t n, OpenInto(sealed, plaintext.data(), plaintext.size()));
  plaintext.resize(n);
  return plaintext;
}

StatusOr<size_t> Session::OpenInto(std::string_view sealed, char* out, size_t capacity) {
  if (broken_) return UnauthenticatedError("the channel failed an earlier record");
  if (sealed.size() < kRecordTagSize || sealed.size() > SealedSize(kMaxRecordPlaintext)) {
    broken_ = true;
    return UnauthenticatedError("a record of " + std::to_string(sealed.size()) + " bytes");
  }
  if (sealed.size() - kRecordTagSize > capacity) {
    return InvalidArgumentError("a record of " + std::to_string(sealed.size() - kRecordTagSize) +
                                " bytes for a buffer of " + std::to_string(capacity));
  }
  return OpenAfter(LengthPrefix(sealed.size()), sealed, out);
}

StatusOr<size_t> Session::OpenAfter(std::string_view header, std::string_view sealed, char* out) {
  if (broken_) return UnauthenticatedError("the channel failed an earlier record");
  if (sealed.size() < kRecordTagSize) {
    broken_ = true;
    return UnauthenticatedError("a record of " + std::to_string(sealed.size()) + " bytes");
  }
  auto nonce = RecordNonce(received_);
  unsigned long long opened = 0;
  if (crypto_aead_chacha20poly1305_ietf_decrypt(
          reinterpret_cast<unsigned char*>(out), &opened, nullptr,
          reinterpret_cast<const unsigned char*>(sealed.data()), sealed.size(),
          reinterpret_cast<const unsigned char*>(header.data()), header.size(), nonce.data(),
          receive_key_.data()) != 0) {
    broken_ = true;
    return UnauthenticatedError(
        "a record that the other end did not seal as its next one (changed, forged, dropped, "
        "repeated or reordered on the way)");
  }
  ++received_;
  return static_cast<size_t>(opened);
}

// --- the handshake -------------------------------------------------------------------------------

ChannelInitiator::ChannelInitiator(std::string_view secret, ChannelEnds ends,
                                   std::optional<Nonce> nonce)
    : secret_(secret), ends_(std::move(ends)), nonce_(nonce ? *nonce : GenerateNonce()) {}

StatusOr<std::string> ChannelInitiator::Open() {
  JT_RETURN_IF_ERROR(CheckName("purpose", ends_.purpose));
  JT_RETURN_IF_ERROR(CheckName("initiator", ends_.initiator));
  JT_RETURN_IF_ERROR(CheckName("responder", ends_.responder));
  std::string out = kMagic;
  out.push_back(static_cast<char>(kChannelVersion >> 8));
  out.push_back(static_cast<char>(kChannelVersion & 0xff));
  PutName(&out, ends_.purpose);
  PutName(&out, ends_.initiator);
  PutName(&out, ends_.responder);
  out.append(reinterpret_cast<const char*>(nonce_.data()), nonce_.size());
  out.append(View(Hmac(secret_, Labeled("jaxtrain-channel-open", out))));
  open_ = out;
  return out;
}

StatusOr<std::string> ChannelInitiator::OnAnswer(std::string_view answer, Session* session) {
  if (open_.empty()) return FailedPreconditionError("OnAnswer() before Open()");
  if (answer.size() < 1 + kMacSize) {
    return DataLossError("an answer of " + std::to_string(answer.size()) + " bytes");
  }
  std::string_view signed_part = answer.substr(0, answer.size() - kMacSize);
  std::string_view mac = answer.substr(answer.size() - kMacSize);
  if (answer[0] == kRefuse) {
    std::string_view reason = signed_part.substr(1);
    if (!MacEquals(Hmac(secret_, Labeled("jaxtrain-channel-refuse", open_, signed_part)), mac)) {
      return UnauthenticatedError(std::string(kUnauthenticatedReason));
    }
    return PermissionDeniedError(std::string(reason));
  }
  if (answer[0] != kAccept || answer.size() != 1 + kNonceSize + kMacSize) {
    return DataLossError("an answer that is neither an accept nor a refusal");
  }
  if (!MacEquals(Hmac(secret_, Labeled("jaxtrain-channel-accept", open_, signed_part)), mac)) {
    return UnauthenticatedError(std::string(kUnauthenticatedReason));
  }
  *session = Session::FromHandshake(secret_, "jaxtrain-channel-keys", open_ + std::string(answer),
                                    SessionEnd::kInitiator);
  return std::string(View(Hmac(secret_, Labeled("jaxtrain-channel-confirm", open_, answer))));
}

ChannelResponder::ChannelResponder(std::string_view secret, std::string purpose, std::string me)
    : secret_(secret), purpose_(std::move(purpose)), me_(std::move(me)) {}

Status ChannelResponder::OnOpen(std::string_view open) {
  proven_open_ = false;
  if (open.size() < 6 + kNonceSize + kMacSize || open.size() > kMaxHandshakeMessage) {
    return UnauthenticatedError("an open of " + std::to_string(open.size()) + " bytes");
  }
  std::string_view fields = open.substr(0, open.size() - kMacSize);
  if (!MacEquals(Hmac(secret_, Labeled("jaxtrain-channel-open", fields)),
                 open.substr(open.size() - kMacSize))) {
    return UnauthenticatedError("it does not hold the secret");
  }
  std::string_view in = fields;
  if (in.substr(0, 4) != kMagic) return UnauthenticatedError("an open without the JXCH magic");
  uint16_t version =
      static_cast<uint16_t>((static_cast<uint8_t>(in[4]) << 8) | static_cast<uint8_t>(in[5]));
  in.remove_prefix(6);
  std::string purpose, initiator, responder;
  if (!TakeName(&in, &purpose) || !TakeName(&in, &initiator) || !TakeName(&in, &responder) ||
      in.size() != kNonceSize) {
    return UnauthenticatedError("a malformed open");
  }
  open_ = std::string(open);
  initiator_ = initiator;
  proven_open_ = true;
  if (version != kChannelVersion) {
    return PermissionDeniedError("channel version " + std::to_string(version) + ", expected " +
                                 std::to_string(kChannelVersion) +
                                 " (are both ends the same jaxtrain version?)");
  }
  if (purpose != purpose_) {
    return PermissionDeniedError("a connection for '" + purpose + "' reached '" + me_ +
                                 "', which serves '" + purpose_ + "'");
  }
  if (responder != me_) {
    return PermissionDeniedError("a connection meant for '" + responder + "' reached '" + me_ +
                                 "'");
  }
  return OkStatus();
}

std::string ChannelResponder::Accept() {
  Nonce nonce = GenerateNonce();
  std::string out(1, kAccept);
  out.append(reinterpret_cast<const char*>(nonce.data()), nonce.size());
  out.append(View(Hmac(secret_, Labeled("jaxtrain-channel-accept", open_, out))));
  accept_ = out;
  return out;
}

std::string ChannelResponder::Refuse(std::string_view reason) {
  std::string out(1, kRefuse);
  out.append(reason.substr(0, kMaxRefusal));
  out.append(View(Hmac(secret_, Labeled("jaxtrain-channel-refuse", open_, out))));
  return out;
}

std::string ChannelResponder::UnauthenticatedRefusal() {
  std::string out(1, kRefuse);
  out.append(kUnauthenticatedReason);
  out.append(kMacSize, '\0');
  return out;
}

Status ChannelResponder::OnConfirm(std::string_view confirm, Session* session) {
  if (!proven_open_ || accept_.empty()) {
    return FailedPreconditionError("OnConfirm() before an accepted open");
  }
  if (!MacEquals(Hmac(secret_, Labeled("jaxtrain-channel-confirm", open_, accept_)), confirm)) {
    return UnauthenticatedError("its confirm was not made with the secret");
  }
  *session = Session::FromHandshake(secret_, "jaxtrain-channel-keys", open_ + accept_,
                                    SessionEnd::kResponder);
  return OkStatus();
}

// --- over a socket -------------------------------------------------------------------------------

namespace {

// Waits until `fd` is ready for `events` or `deadline` passes.
Status WaitFor(int fd, short events, TimePoint deadline) {
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return DeadlineExceededError("timed out");
    pollfd p{fd, events, 0};
    int n = poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 60000)));
    if (n > 0) return OkStatus();
    if (n < 0 && errno != EINTR) return ErrnoError("poll", errno);
  }
}

Status WriteAllBy(int fd, std::string_view data, TimePoint deadline) {
  while (!data.empty()) {
    ssize_t n = send(fd, data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      JT_RETURN_IF_ERROR(WaitFor(fd, POLLOUT, deadline));
      continue;
    }
    return UnavailableError(std::string("the connection failed: ") + std::strerror(errno));
  }
  return OkStatus();
}

Status ReadExactlyBy(int fd, char* out, size_t size, TimePoint deadline) {
  while (size > 0) {
    ssize_t n = recv(fd, out, size, MSG_DONTWAIT);
    if (n > 0) {
      out += n;
      size -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return UnavailableError("the connection closed");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      JT_RETURN_IF_ERROR(WaitFor(fd, POLLIN, deadline));
      continue;
    }
    return UnavailableError(std::string("the connection failed: ") + std::strerror(errno));
  }
  return OkStatus();
}

// One length-prefixed message of at most `limit` bytes, into `*body` (its capacity reused).
Status ReadMessageInto(int fd, size_t limit, TimePoint deadline, std::string* body) {
  char length[4];
  JT_RETURN_IF_ERROR(ReadExactlyBy(fd, length, sizeof(length), deadline));
  size_t n = GetU32(length);
  if (n > limit) {
    return DataLossError("a message of " + std::to_string(n) + " bytes; at most " +
                         std::to_string(limit) + " are allowed");
  }
  body->resize(n);
  return ReadExactlyBy(fd, body->data(), n, deadline);
}

StatusOr<std::string> ReadMessage(int fd, size_t limit, TimePoint deadline) {
  std::string body;
  JT_RETURN_IF_ERROR(ReadMessageInto(fd, limit, deadline, &body));
  return body;
}

Status WriteMessage(int fd, std::string_view body, TimePoint deadline) {
  return WriteAllBy(fd, LengthPrefix(body.size()) + std::string(body), deadline);
}

TimePoint DeadlineIn(Duration timeout) { return std::chrono::steady_clock::now() + timeout; }

}  // namespace

Channel::Channel(int fd, Session session, std::string peer)
    : fd_(fd), peer_(std::move(peer)), session_(std::move(session)) {}

Channel::Channel(Channel&& other) noexcept
    : fd_(other.fd_), peer_(std::move(other.peer_)), session_(std::move(other.session_)) {}

Channel& Channel::operator=(Channel&& other) noexcept {
  fd_ = other.fd_;
  peer_ = std::move(other.peer_);
  session_ = std::move(other.session_);
  return *this;
}

StatusOr<Channel> Channel::Connect(int fd, std::string_view secret, const ChannelEnds& ends,
                                   Duration timeout) {
  TimePoint deadline = DeadlineIn(timeout);
  ChannelInitiator initiator(secret, ends);
  JT_ASSIGN_OR_RETURN(std::string open, initiator.Open());
  JT_RETURN_IF_ERROR(WriteMessage(fd, open, deadline));
  JT_ASSIGN_OR_RETURN(std::string answer, ReadMessage(fd, kMaxHandshakeMessage, deadline));
  Session session;
  JT_ASSIGN_OR_RETURN(std::string confirm, initiator.OnAnswer(answer, &session));
  JT_RETURN_IF_ERROR(WriteMessage(fd, confirm, deadline));
  return Channel(fd, std::move(session), ends.responder);
}

StatusOr<Channel> Channel::Accept(int fd, std::string_view secret, std::string_view purpose,
                                  std::string_view me, const std::vector<std::string>& initiators,
                                  Duration timeout) {
  TimePoint deadline = DeadlineIn(timeout);
  ChannelResponder responder(secret, std::string(purpose), std::string(me));
  JT_ASSIGN_OR_RETURN(std::string open, ReadMessage(fd, kMaxHandshakeMessage, deadline));
  Status checked = responder.OnOpen(open);
  if (checked.ok() && !initiators.empty() &&
      std::find(initiators.begin(), initiators.end(), responder.initiator()) == initiators.end()) {
    checked = PermissionDeniedError("'" + std::string(me) + "' accepts no connection from '" +
                                    responder.initiator() + "'");
  }
  if (checked.code() == StatusCode::kUnauthenticated) {
    (void)WriteMessage(fd, ChannelResponder::UnauthenticatedRefusal(), deadline);
    return checked;
  }
  if (!checked.ok()) {
    (void)WriteMessage(fd, responder.Refuse(checked.message()), deadline);
    return checked;
  }
  JT_RETURN_IF_ERROR(WriteMessage(fd, responder.Accept(), deadline));
  JT_ASSIGN_OR_RETURN(std::string confirm, ReadMessage(fd, kMacSize, deadline));
  Session session;
  JT_RETURN_IF_ERROR(responder.OnConfirm(confirm, &session));
  return Channel(fd, std::move(session), responder.initiator());
}

Status Channel::Send(std::string_view data, Duration timeout) {
  TimePoint deadline = DeadlineIn(timeout);
  std::lock_guard<std::mutex> lock(send_mu_);
  do {
    std::string_view part = data.substr(0, kMaxRecordPlaintext);
    data.remove_prefix(part.size());
    JT_RETURN_IF_ERROR(session_.SealInto(part, &sealed_));
    JT_RETURN_IF_ERROR(WriteAllBy(fd_, sealed_, deadline));
  } while (!data.empty());
  return OkStatus();
}

Status Channel::SendFile(int file_fd, uint64_t size, Duration timeout) {
  TimePoint deadline = DeadlineIn(timeout);
  std::lock_guard<std::mutex> lock(send_mu_);
  file_buffer_.resize(std::min<uint64_t>(size, kMaxRecordPlaintext));
  std::string& buffer = file_buffer_;
  uint64_t offset = 0;
  while (offset < size) {
    size_t want = static_cast<size_t>(std::min<uint64_t>(size - offset, buffer.size()));
    ssize_t n = pread(file_fd, buffer.data(), want, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoError("reading the file to send", errno);
    if (n == 0) {
      return DataLossError("the file ended after " + std::to_string(offset) + " of " +
                           std::to_string(size) + " bytes");
    }
    JT_RETURN_IF_ERROR(
        session_.SealInto(std::string_view(buffer.data(), static_cast<size_t>(n)), &sealed_));
    JT_RETURN_IF_ERROR(WriteAllBy(fd_, sealed_, deadline));
    offset += static_cast<uint64_t>(n);
  }
  return OkStatus();
}

StatusOr<std::string> Channel::Receive(Duration timeout) {
  TimePoint deadline = DeadlineIn(timeout);
  std::lock_guard<std::mutex> lock(receive_mu_);
  JT_RETURN_IF_ERROR(
      ReadMessageInto(fd_, Session::SealedSize(kMaxRecordPlaintext), deadline, &received_));
  return session_.Open(received_);
}

StatusOr<size_t> Channel::ReceiveInto(char* out, size_t capacity, Duration timeout) {
  TimePoint deadline = DeadlineIn(timeout);
  std::lock_guard<std::mutex> lock(receive_mu_);
  JT_RETURN_IF_ERROR(
      ReadMessageInto(fd_, Session::SealedSize(kMaxRecordPlaintext), deadline, &received_));
  return session_.OpenInto(received_, out, capacity);
}

}  // namespace jaxtrain::wire
