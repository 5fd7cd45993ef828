// Fuzzes FrameDecoder the way the controller drives it (controller.cc, ReadConn and OnFrame): the
// peer's bytes arrive in chunks, every complete frame is taken with Next() before the next chunk,
// and the frame limit follows the handshake: kHelloSize, kAuthSize once the hello is accepted, 16
// MiB (and the seal's tag) once the auth is, from when every frame must open under the session the
// handshake derived (frame.h), as the controller opens it. A reference model of the framing checks
// every answer: each frame returned is exactly the bytes sent and within the limit in force, an
// error comes only from a header that breaks a rule, the decoder holds no more than one partial
// frame plus the last chunk, and no call allocates more than that. Every body also goes through the
// body decoders, whose successes must round-trip.
//
// Input: byte 0 picks the variant (the k* bits below), bytes 1-8 seed the chunk sizes, the rest is
// the byte stream the peer sends. corpus/frame_decoder (from make_corpus.cc) holds valid
// conversations behind such a prefix.
#include <sanitizer/allocator_interface.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "wire/frame.h"
#include "wire/fuzz/fuzz_support.h"
#include "wire/handshake.h"

namespace jaxtrain::wire::fuzz {
namespace {

// The controller's limit after auth.
constexpr size_t kMaxAuthedBody = kMaxWorkerFrameBody + kSealedFrameOverhead;
constexpr size_t kReadChunk = 64 << 10;  // controller.cc: the largest recv() it feeds
constexpr size_t kPrefixSize = 9;        // variant byte and chunking seed
constexpr size_t kMessageSlack = 256;    // allocations for an error's message

// Variant bits.
constexpr uint8_t kStartAuthenticated = 1;  // the peer is past the handshake from the first byte
constexpr uint8_t kLenient = 2;  // every frame advances the handshake, whatever the controller says
constexpr uint8_t kOneByteChunks = 4;  // a slow peer: one byte per recv()

// The largest single allocation of this thread while `watching`, from the sanitizer allocator's
// hook. Per thread: libFuzzer's own threads (its RSS watcher) allocate whenever they like.
thread_local bool watching = false;
thread_local size_t largest_allocation = 0;

void OnMalloc(const volatile void*, size_t size) {
  if (watching) largest_allocation = std::max(largest_allocation, size);
}
void OnFree(const volatile void*) {}

// Runs `call` and returns the largest single allocation it made.
template <typename F>
size_t LargestAllocationOf(F&& call) {
  largest_allocation = 0;
  watching = true;
  call();
  watching = false;
  return largest_allocation;
}

uint32_t GetU32(std::string_view p) {
  const auto* u = reinterpret_cast<const unsigned char*>(p.data());
  return (uint32_t{u[0]} << 24) | (uint32_t{u[1]} << 16) | (uint32_t{u[2]} << 8) | u[3];
}

// The reference model: what the decoder must make of the frame at the start of `rest`.
enum class Head { kIncomplete, kComplete, kInvalid };

Head Classify(std::string_view rest, size_t limit) {
  if (rest.size() < kFrameHeaderSize) return Head::kIncomplete;
  uint32_t length = GetU32(rest);
  auto type = static_cast<uint8_t>(rest[4]);
  if (length == 0 || length - 1 > limit || type == 0 || type > kMaxMessageType) {
    return Head::kInvalid;
  }
  return rest.size() - kFrameHeaderSize < length - 1 ? Head::kIncomplete : Head::kComplete;
}

// Chunk sizes as recv() might return them: single bytes, a few bytes, a packet, a full buffer.
class ChunkSizes {
 public:
  ChunkSizes(uint64_t seed, bool one_byte) : state_(seed), one_byte_(one_byte) {}

  size_t Next() {
    if (one_byte_) return 1;
    uint64_t r = SplitMix64();
    switch (r % 4) {
      case 0: return 1;
      case 1: return 1 + (r >> 8) % 8;
      case 2: return 1 + (r >> 8) % 512;
      default: return kReadChunk;
    }
  }

 private:
  uint64_t SplitMix64() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9;
    z = (z ^ (z >> 27)) * 0x94d049bb133111eb;
    return z ^ (z >> 31);
  }

  uint64_t state_;
  bool one_byte_;
};

// Every body through every body decoder: a success must re-encode to the same bytes and point into
// the body; a failure must be the documented code.
void CheckBodyDecoders(std::string_view body) {
  StatusOr<Hello> hello = DecodeHello(body, FixedSecret());
  if (hello.ok()) {
    JT_FUZZ_CHECK(EncodeHello(*hello, FixedSecret()) == body);
  } else {
    JT_FUZZ_CHECK(hello.status().code() == StatusCode::kUnauthenticated);
  }

  uint64_t round = 0;
  std::string_view metrics;
  Status s = DecodeReportBody(body, &round, &metrics);
  if (s.ok()) {
    JT_FUZZ_CHECK(metrics.data() == body.data() + 8 && metrics.size() == body.size() - 8);
    JT_FUZZ_CHECK(EncodeReportBody(round, metrics) == body);
  } else {
    JT_FUZZ_CHECK(s.code() == StatusCode::kDataLoss && body.size() < 8);
  }

  std::string_view checkpoint;
  s = DecodeCheckpointReportBody(body, &round, &checkpoint, &metrics);
  if (s.ok()) {
    const char* end = body.data() + body.size();
    JT_FUZZ_CHECK(checkpoint.data() == body.data() + 12);
    JT_FUZZ_CHECK(checkpoint.data() + checkpoint.size() == metrics.data());
    JT_FUZZ_CHECK(metrics.data() + metrics.size() == end);
    JT_FUZZ_CHECK(EncodeCheckpointReportBody(round, checkpoint, metrics).value() == body);
  } else {
    JT_FUZZ_CHECK(s.code() == StatusCode::kDataLoss);
    JT_FUZZ_CHECK(body.size() < 12 || body.size() - 12 < GetU32(body.substr(8)));
  }
}

// One control connection as the controller sees it.
class Connection {
 public:
  Connection(std::string_view stream, uint8_t variant)
      : stream_(stream),
        lenient_(variant & kLenient),
        stage_((variant & kStartAuthenticated) ? Stage::kAuthed : Stage::kHello),
        limit_(stage_ == Stage::kAuthed ? kMaxAuthedBody : kHelloSize),
        decoder_(limit_) {
    if (stage_ == Stage::kAuthed) StartSession();
  }

  bool all_fed() const { return fed_ == stream_.size(); }

  // Feeds up to `chunk` more bytes and takes every complete frame. False once the decoder has
  // refused the stream or the controller would have closed the connection: a refused decoder is
  // discarded, never fed again.
  bool Receive(size_t chunk) {
    std::string_view bytes = stream_.substr(fed_, chunk);
    fed_ += bytes.size();
    largest_chunk_ = std::max(largest_chunk_, bytes.size());
    Status s;
    size_t allocated = LargestAllocationOf([&] { s = decoder_.Feed(bytes); });
    JT_FUZZ_CHECK(decoder_.buffered() == fed_ - pos_);
    JT_FUZZ_CHECK(decoder_.buffered() <= limit_ + kFrameHeaderSize + largest_chunk_);
    JT_FUZZ_CHECK(allocated <= 2 * decoder_.buffered() + kMessageSlack);
    if (!s.ok()) {
      CheckRefusal(s);
      return false;
    }
    JT_FUZZ_CHECK(Classify(Unconsumed(), limit_) != Head::kInvalid);
    return Drain();
  }

 private:
  enum class Stage { kHello, kAuth, kAuthed };

  std::string_view Unconsumed() const { return stream_.substr(pos_, fed_ - pos_); }

  bool Drain() {
    for (;;) {
      std::optional<StatusOr<std::optional<Frame>>> next;
      size_t allocated = LargestAllocationOf([&] { next.emplace(decoder_.Next()); });
      if (!next->ok()) {
        CheckRefusal(next->status());
        return false;
      }
      if (!next->value().has_value()) {
        JT_FUZZ_CHECK(Classify(Unconsumed(), limit_) == Head::kIncomplete);
        JT_FUZZ_CHECK(decoder_.buffered() == fed_ - pos_);
        JT_FUZZ_CHECK(allocated == 0);
        return true;
      }
      const Frame& f = *next->value();
      CheckFrame(f, allocated);
      if (!OnFrame(f)) return false;
    }
  }

  // A refusal must name a header that breaks a rule under the limit in force.
  void CheckRefusal(const Status& s) {
    JT_FUZZ_CHECK(s.code() == StatusCode::kDataLoss);
    JT_FUZZ_CHECK(Classify(Unconsumed(), limit_) == Head::kInvalid);
  }

  void CheckFrame(const Frame& f, size_t allocated) {
    std::string_view rest = Unconsumed();
    JT_FUZZ_CHECK(Classify(rest, limit_) == Head::kComplete);
    JT_FUZZ_CHECK(f.body.size() <= limit_);
    JT_FUZZ_CHECK(f.body.size() == GetU32(rest) - 1);
    std::string_view sent = rest.substr(0, kFrameHeaderSize + f.body.size());
    JT_FUZZ_CHECK(EncodeFrame(f.type, f.body).value() == sent);
    JT_FUZZ_CHECK(allocated <= std::max(f.body.size() + 1, kMessageSlack));
    pos_ += sent.size();
    JT_FUZZ_CHECK(decoder_.buffered() == fed_ - pos_);
    CheckBodyDecoders(f.body);
  }

  // The controller's handshake (controller.cc, OnFrame) without the rank bookkeeping: which frames
  // it accepts at each stage and the limit it sets after each. False where it would close the
  // connection.
  bool OnFrame(const Frame& f) {
    switch (stage_) {
      case Stage::kHello: {
        StatusOr<Hello> hello = DecodeHello(f.body, FixedSecret());
        if (!lenient_ && (f.type != MessageType::kHello || !hello.ok())) return false;
        if (hello.ok()) hello_ = *hello;
        stage_ = Stage::kAuth;
        SetLimit(kAuthSize);
        return true;
      }
      case Stage::kAuth: {
        bool proven = f.type == MessageType::kAuth &&
                      MacEquals(WorkerProof(FixedSecret(), hello_, FixedControllerNonce()), f.body);
        if (!lenient_ && !proven) return false;
        stage_ = Stage::kAuthed;
        SetLimit(kMaxAuthedBody);
        StartSession();
        return true;
      }
      case Stage::kAuthed: {
        // The controller opens the body in place; a frame that does not open closes the
        // connection, and only an opened one reaches the message decoders.
        std::string body = f.body;
        StatusOr<std::optional<FrameView>> opened = session_.Open(f.type, body.data(), body.size());
        if (!opened.ok()) {
          JT_FUZZ_CHECK(opened.status().code() == StatusCode::kUnauthenticated);
          return lenient_;
        }
        if (!*opened) return true;  // a kSharedKey frame (controller -> worker only in practice)
        JT_FUZZ_CHECK((*opened)->body.size() + kSealedFrameOverhead == f.body.size());
        const Frame plain{(*opened)->type, std::string((*opened)->body)};
        CheckBodyDecoders(plain.body);
        return lenient_ || AcceptedFromAWorker(plain);
      }
    }
    return false;
  }

  // The controller's session of this connection: its keys from the hello and the challenge it
  // answered (the seed hello when the stream starts after the handshake).
  void StartSession() {
    const Nonce nonce = FixedControllerNonce();
    const Mac proof = ControllerProof(FixedSecret(), hello_, nonce);
    std::string challenge(reinterpret_cast<const char*>(nonce.data()), nonce.size());
    challenge.append(reinterpret_cast<const char*>(proof.data()), proof.size());
    session_ = SealedFrames(ControlSession(FixedSecret(), EncodeHello(hello_, FixedSecret()),
                                           challenge, SessionEnd::kResponder));
  }

  static bool AcceptedFromAWorker(const Frame& f) {
    uint64_t round = 0;
    std::string_view checkpoint, metrics;
    switch (f.type) {
      case MessageType::kRegister:
      case MessageType::kError:
      case MessageType::kDone: return true;
      case MessageType::kReport: return DecodeReportBody(f.body, &round, &metrics).ok();
      case MessageType::kReportCheckpoint:
        return DecodeCheckpointReportBody(f.body, &round, &checkpoint, &metrics).ok();
      default: return false;
    }
  }

  void SetLimit(size_t limit) {
    limit_ = limit;
    decoder_.set_max_body(limit);
  }

  std::string_view stream_;
  bool lenient_;
  Stage stage_;
  size_t limit_;
  FrameDecoder decoder_;
  Hello hello_ = SeedHello();
  SealedFrames session_;
  size_t fed_ = 0;  // bytes of the stream fed to the decoder
  size_t pos_ = 0;  // start of the next frame in the stream
  size_t largest_chunk_ = 0;
};

void Run(const uint8_t* data, size_t size) {
  if (size < kPrefixSize) return;
  uint64_t seed = 0;
  for (size_t i = 1; i < kPrefixSize; ++i) seed = seed << 8 | data[i];
  std::string_view stream(reinterpret_cast<const char*>(data) + kPrefixSize, size - kPrefixSize);
  Connection conn(stream, data[0]);
  ChunkSizes chunks(seed, data[0] & kOneByteChunks);
  while (!conn.all_fed() && conn.Receive(chunks.Next())) {
  }
}

}  // namespace
}  // namespace jaxtrain::wire::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  __sanitizer_install_malloc_and_free_hooks(jaxtrain::wire::fuzz::OnMalloc,
                                            jaxtrain::wire::fuzz::OnFree);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  jaxtrain::wire::fuzz::Run(data, size);
  return 0;
}
