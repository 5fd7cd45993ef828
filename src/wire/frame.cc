#include "wire/frame.h"

#include <cstring>

#include "wire/big_endian.h"

namespace jaxtrain::wire {

StatusOr<std::string> EncodeFrameHeader(MessageType type, size_t body_size) {
  if (body_size > kMaxFrameBody) {
    return InvalidArgumentError("a frame body of " + std::to_string(body_size) +
                                " bytes is larger than the wire format's limit of " +
                                std::to_string(kMaxFrameBody));
  }
  std::string out;
  PutU32(&out, static_cast<uint32_t>(body_size + 1));
  out.push_back(static_cast<char>(type));
  return out;
}

StatusOr<std::string> EncodeFrame(MessageType type, std::string_view body) {
  JT_ASSIGN_OR_RETURN(std::string out, EncodeFrameHeader(type, body.size()));
  out.reserve(kFrameHeaderSize + body.size());
  out.append(body);
  return out;
}

std::string EncodeReportBody(uint64_t round, std::string_view metrics_json) {
  std::string out;
  out.reserve(8 + metrics_json.size());
  PutU32(&out, static_cast<uint32_t>(round >> 32));
  PutU32(&out, static_cast<uint32_t>(round));
  out.append(metrics_json);
  return out;
}

Status DecodeReportBody(std::string_view body, uint64_t* round, std::string_view* metrics_json) {
  if (body.size() < 8) {
    return DataLossError("report frame of " + std::to_string(body.size()) +
                         " bytes is shorter than its 8-byte round number");
  }
  *round = (uint64_t{GetU32(body.data())} << 32) | GetU32(body.data() + 4);
  *metrics_json = body.substr(8);
  return OkStatus();
}

StatusOr<std::string> EncodeCheckpointReportBody(uint64_t round, std::string_view checkpoint_json,
                                                 std::string_view metrics_json) {
  if (checkpoint_json.size() > 0xffffffffu) {
    return InvalidArgumentError("a checkpoint description of " +
                                std::to_string(checkpoint_json.size()) +
                                " bytes is larger than its u32 length field");
  }
  std::string out = EncodeReportBody(round, "");
  PutU32(&out, static_cast<uint32_t>(checkpoint_json.size()));
  out.append(checkpoint_json);
  out.append(metrics_json);
  return out;
}

Status DecodeCheckpointReportBody(std::string_view body, uint64_t* round,
                                  std::string_view* checkpoint_json,
                                  std::string_view* metrics_json) {
  std::string_view rest;
  JT_RETURN_IF_ERROR(DecodeReportBody(body, round, &rest));
  if (rest.size() < 4 || rest.size() - 4 < GetU32(rest.data())) {
    return DataLossError("checkpoint report frame too short for its checkpoint description");
  }
  uint32_t length = GetU32(rest.data());
  *checkpoint_json = rest.substr(4, length);
  *metrics_json = rest.substr(4 + length);
  return OkStatus();
}

std::string EncodeCollectiveBody(uint64_t sequence, uint8_t kind, std::string_view data) {
  std::string out = EncodeReportBody(sequence, "");
  out.reserve(kCollectiveHeaderSize + data.size());
  out.push_back(static_cast<char>(kind));
  out.append(data);
  return out;
}

Status DecodeCollectiveBody(std::string_view body, uint64_t* sequence, uint8_t* kind,
                            std::string_view* data) {
  if (body.size() < kCollectiveHeaderSize) {
    return DataLossError("collective frame of " + std::to_string(body.size()) +
                         " bytes is shorter than its 9-byte sequence number and kind");
  }
  std::string_view rest;
  JT_RETURN_IF_ERROR(DecodeReportBody(body, sequence, &rest));
  *kind = static_cast<uint8_t>(rest[0]);
  *data = rest.substr(1);
  return OkStatus();
}

Session ControlSession(std::string_view secret, std::string_view hello, std::string_view challenge,
                       SessionEnd end) {
  std::string transcript(hello);
  transcript.append(challenge);
  return Session::FromHandshake(secret, "jaxtrain-control-keys", transcript, end);
}

StatusOr<SharedFrame> SealShared(MessageType type, std::string_view body) {
  SharedFrame shared;
  shared.key = Mac(GenerateNonce());  // 32 random bytes
  JT_ASSIGN_OR_RETURN(std::string frame, EncodeFrameHeader(type, Session::SealedSize(body.size())));
  const size_t header = frame.size();
  frame.resize(header + Session::SealedSize(body.size()));
  // The key is used for this one frame: its first record number is the only nonce it meets.
  Session once(shared.key, shared.key);
  JT_RETURN_IF_ERROR(
      once.SealAfter(std::string_view(frame).substr(0, header), body, frame.data() + header));
  shared.frame = std::make_shared<const std::string>(std::move(frame));
  return shared;
}

StatusOr<Frame> OpenShared(const SharedFrame& shared) {
  FrameDecoder decoder(kMaxFrameBody);
  JT_RETURN_IF_ERROR(decoder.Feed(*shared.frame));
  JT_ASSIGN_OR_RETURN(std::optional<Frame> frame, decoder.Next());
  if (!frame || decoder.buffered() != 0) return DataLossError("not one whole frame");
  JT_ASSIGN_OR_RETURN(std::string header, EncodeFrameHeader(frame->type, frame->body.size()));
  Session once(shared.key, shared.key);
  JT_ASSIGN_OR_RETURN(size_t n, once.OpenAfter(header, frame->body, frame->body.data()));
  frame->body.resize(n);
  return *std::move(frame);
}

Status SealedFrames::Seal(MessageType type, std::string_view body, std::string* out) {
  JT_ASSIGN_OR_RETURN(std::string header,
                      EncodeFrameHeader(type, Session::SealedSize(body.size())));
  const size_t start = out->size();
  out->resize(start + header.size() + Session::SealedSize(body.size()));
  std::memcpy(out->data() + start, header.data(), header.size());
  return session_.SealAfter(header, body, out->data() + start + header.size());
}

Status SealedFrames::SealKeyOf(const SharedFrame& shared, std::string* out) {
  return Seal(MessageType::kSharedKey,
              std::string_view(reinterpret_cast<const char*>(shared.key.data()), shared.key.size()),
              out);
}

StatusOr<std::optional<FrameView>> SealedFrames::Open(MessageType type, char* body, size_t size) {
  if (broken_) return UnauthenticatedError("the connection failed an earlier frame");
  // The header as sent: the length counts the type byte and the sealed body.
  char header[kFrameHeaderSize];
  const uint32_t length = static_cast<uint32_t>(size + 1);
  for (int i = 0; i < 4; ++i) header[i] = static_cast<char>(length >> (24 - 8 * i));
  header[4] = static_cast<char>(type);
  const std::string_view ad(header, sizeof(header));
  std::optional<Session> once;  // the shared frame's own key, for the frame after its kSharedKey
  if (shared_key_) {
    once.emplace(*shared_key_, *shared_key_);
    shared_key_.reset();
  }
  StatusOr<size_t> opened =
      (once ? *once : session_).OpenAfter(ad, std::string_view(body, size), body);
  if (!opened.ok()) {
    broken_ = true;
    return UnauthenticatedError("a frame of type " + std::to_string(static_cast<int>(type)) +
                                " that the other end did not seal as its next one (changed, "
                                "forged, dropped, repeated, reordered or injected on the way)");
  }
  if (type == MessageType::kSharedKey) {
    if (*opened != kMacSize) {
      broken_ = true;
      return UnauthenticatedError("a shared frame's key of " + std::to_string(*opened) + " bytes");
    }
    Mac key;
    std::memcpy(key.data(), body, key.size());
    shared_key_ = key;
    return std::optional<FrameView>();
  }
  return std::optional<FrameView>(FrameView{type, std::string_view(body, *opened)});
}

Status FrameDecoder::CheckHead() {
  if (head_checked_ || buffered() < kFrameHeaderSize) return OkStatus();
  const char* p = buffer_.data() + consumed_;
  uint32_t length = GetU32(p);
  if (length == 0) return DataLossError("frame with length 0");
  if (length - 1 > max_body_) {
    return DataLossError("frame body of " + std::to_string(length - 1) +
                         " bytes exceeds the limit of " + std::to_string(max_body_));
  }
  uint8_t type = static_cast<uint8_t>(p[4]);
  if (type == 0 || type > kMaxMessageType) {
    return DataLossError("unknown message type " + std::to_string(type));
  }
  head_checked_ = true;
  return OkStatus();
}

Status FrameDecoder::Feed(std::string_view bytes) {
  if (consumed_ > 0) {
    buffer_.erase(0, consumed_);
    consumed_ = 0;
  }
  buffer_.append(bytes);
  return CheckHead();
}

void FrameDecoder::ReleaseConsumed() {
  if (consumed_ == 0 || consumed_ != buffer_.size()) return;
  buffer_.clear();
  consumed_ = 0;
  // A connection between frames keeps no buffer at all, so thousands of idle ones hold nothing
  // (a frame's bytes are copied in and freed once taken: one allocation per read, not per byte).
  std::string().swap(buffer_);
}

StatusOr<std::optional<FrameView>> FrameDecoder::NextView() {
  ReleaseConsumed();
  JT_RETURN_IF_ERROR(CheckHead());
  if (!head_checked_) return std::optional<FrameView>();
  const char* p = buffer_.data() + consumed_;
  uint32_t length = GetU32(p);
  if (buffered() < kFrameHeaderSize + length - 1) return std::optional<FrameView>();
  FrameView f{static_cast<MessageType>(p[4]), std::string_view(p + kFrameHeaderSize, length - 1)};
  last_body_ = consumed_ + kFrameHeaderSize;
  consumed_ += kFrameHeaderSize + length - 1;
  head_checked_ = false;
  return std::optional<FrameView>(f);
}

StatusOr<std::optional<Frame>> FrameDecoder::Next() {
  JT_ASSIGN_OR_RETURN(std::optional<FrameView> view, NextView());
  if (!view) return std::optional<Frame>();
  Frame f{view->type, std::string(view->body)};
  ReleaseConsumed();
  return std::optional<Frame>(std::move(f));
}

}  // namespace jaxtrain::wire
