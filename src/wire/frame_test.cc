#include "wire/frame.h"

#include <gtest/gtest.h>

#include <vector>

namespace jaxtrain::wire {
namespace {

// A frame whose body is known to fit.
std::string F(MessageType type, std::string_view body) { return EncodeFrame(type, body).value(); }

TEST(FrameDecoderTest, DecodesFramesSplitAtEveryByte) {
  std::string stream = F(MessageType::kRegister, "{\"a\":1}") + F(MessageType::kDone, "") +
                       F(MessageType::kReport, EncodeReportBody(7, "{}"));
  FrameDecoder d(1024);
  std::vector<Frame> frames;
  for (char c : stream) {
    ASSERT_TRUE(d.Feed(std::string_view(&c, 1)).ok());
    for (;;) {
      auto f = d.Next();
      ASSERT_TRUE(f.ok());
      if (!f->has_value()) break;
      frames.push_back(**f);
    }
  }
  ASSERT_EQ(frames.size(), 3u);
  EXPECT_EQ(frames[0].type, MessageType::kRegister);
  EXPECT_EQ(frames[0].body, "{\"a\":1}");
  EXPECT_EQ(frames[1].type, MessageType::kDone);
  EXPECT_EQ(frames[1].body, "");
  uint64_t round = 0;
  std::string_view metrics;
  ASSERT_TRUE(DecodeReportBody(frames[2].body, &round, &metrics).ok());
  EXPECT_EQ(round, 7u);
  EXPECT_EQ(metrics, "{}");
  EXPECT_EQ(d.buffered(), 0u);
}

TEST(FrameDecoderTest, RefusesAnOversizedLengthBeforeBufferingTheBody) {
  FrameDecoder d(16);
  std::string header = F(MessageType::kRegister, std::string(17, 'x')).substr(0, 5);
  Status s = d.Feed(header);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("exceeds the limit of 16"), std::string::npos);
}

TEST(FrameDecoderTest, RefusesAHugeLengthAnnouncement) {
  FrameDecoder d(1 << 20);
  std::string header("\xff\xff\xff\xff\x04", 5);
  EXPECT_EQ(d.Feed(header).code(), StatusCode::kDataLoss);
}

TEST(FrameDecoderTest, RefusesZeroLengthAndUnknownTypes) {
  FrameDecoder a(16);
  EXPECT_EQ(a.Feed(std::string("\0\0\0\0\x01", 5)).code(), StatusCode::kDataLoss);
  FrameDecoder b(16);
  EXPECT_EQ(b.Feed(std::string("\0\0\0\x01\x63", 5)).code(), StatusCode::kDataLoss);
  FrameDecoder c(16);
  EXPECT_EQ(c.Feed(std::string("\0\0\0\x01\x00", 5)).code(), StatusCode::kDataLoss);
}

TEST(FrameDecoderTest, ChecksTheSecondHeaderInTheSameChunkWhenItComesNext) {
  FrameDecoder d(8);
  std::string stream =
      F(MessageType::kDone, "") + F(MessageType::kRegister, std::string(9, 'x')).substr(0, 5);
  ASSERT_TRUE(d.Feed(stream).ok());
  auto first = d.Next();
  ASSERT_TRUE(first.ok() && first->has_value());
  EXPECT_EQ(d.Next().status().code(), StatusCode::kDataLoss);
}

TEST(FrameDecoderTest, ALimitRaisedAfterAFrameAppliesToTheFramesQueuedBehindIt) {
  FrameDecoder d(4);
  std::string stream = F(MessageType::kAuth, "abcd") + F(MessageType::kRegister, "{\"x\":1}");
  ASSERT_TRUE(d.Feed(stream).ok());
  auto auth = d.Next();
  ASSERT_TRUE(auth.ok() && auth->has_value());
  d.set_max_body(1024);
  auto reg = d.Next();
  ASSERT_TRUE(reg.ok() && reg->has_value());
  EXPECT_EQ((*reg)->body, "{\"x\":1}");
}

TEST(FrameDecoderTest, TruncatedFrameYieldsNothing) {
  FrameDecoder d(64);
  std::string f = F(MessageType::kRegister, "hello");
  ASSERT_TRUE(d.Feed(f.substr(0, f.size() - 1)).ok());
  auto next = d.Next();
  ASSERT_TRUE(next.ok());
  EXPECT_FALSE(next->has_value());
}

TEST(ReportBodyTest, CheckpointReportRoundTrips) {
  std::string body = EncodeCheckpointReportBody(42, R"({"files":[]})", R"({"loss":1})").value();
  uint64_t round = 0;
  std::string_view checkpoint, metrics;
  ASSERT_TRUE(DecodeCheckpointReportBody(body, &round, &checkpoint, &metrics).ok());
  EXPECT_EQ(round, 42u);
  EXPECT_EQ(checkpoint, R"({"files":[]})");
  EXPECT_EQ(metrics, R"({"loss":1})");
  body.resize(14);
  EXPECT_EQ(DecodeCheckpointReportBody(body, &round, &checkpoint, &metrics).code(),
            StatusCode::kDataLoss);
}

// The length field is a u32: a larger body must be refused, never sent with a truncated length
// (which would make the peer read the rest of the body as frames). The views below are never read.
TEST(FrameEncodeTest, RefusesABodyTooLargeForTheLengthField) {
  const char byte = 'x';
  std::string_view huge(&byte, kMaxFrameBody + 1);
  auto frame = EncodeFrame(MessageType::kPayload, huge);
  EXPECT_EQ(frame.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(frame.status().message().find(std::to_string(kMaxFrameBody + 1)), std::string::npos)
      << frame.status().message();
  EXPECT_EQ(EncodeFrameHeader(MessageType::kPayload, kMaxFrameBody + 1).status().code(),
            StatusCode::kInvalidArgument);
  auto header = EncodeFrameHeader(MessageType::kPayload, kMaxFrameBody);
  ASSERT_TRUE(header.ok());
  EXPECT_EQ(*header, std::string("\xff\xff\xff\xff\x06", 5));
  std::string_view huge_checkpoint(&byte, size_t{0xffffffffu} + 1);
  EXPECT_EQ(EncodeCheckpointReportBody(1, huge_checkpoint, "{}").status().code(),
            StatusCode::kInvalidArgument);
}

TEST(FrameEncodeTest, AHeaderAndASeparateBodyMakeTheSameFrame) {
  std::string body(1000, 'p');
  EXPECT_EQ(EncodeFrameHeader(MessageType::kPayload, body.size()).value() + body,
            F(MessageType::kPayload, body));
}

TEST(FrameDecoderTest, BuffersAtMostOneFrameWhateverThePeerSends) {
  // A peer that sends frames as fast as it can: the buffer never holds more than the frame being
  // assembled and the chunk just fed.
  FrameDecoder d(100);
  const std::string frame = F(MessageType::kRegister, std::string(100, 'x'));
  std::string chunk;
  for (int i = 0; i < 50; ++i) chunk += frame;
  for (size_t at = 0; at < chunk.size(); at += 37) {
    ASSERT_TRUE(d.Feed(std::string_view(chunk).substr(at, 37)).ok());
    EXPECT_LE(d.buffered(), kFrameHeaderSize + 100 + 37);
    for (;;) {
      auto f = d.Next();
      ASSERT_TRUE(f.ok());
      if (!f->has_value()) break;
    }
    EXPECT_LT(d.buffered(), kFrameHeaderSize + 100);
  }
}

TEST(FrameDecoderTest, KeepsNoLargeBufferBetweenFrames) {
  FrameDecoder d(1 << 20);
  ASSERT_TRUE(d.Feed(F(MessageType::kReport, std::string(100000, 'x'))).ok());
  auto f = d.Next();
  ASSERT_TRUE(f.ok() && f->has_value());
  EXPECT_EQ(d.buffered(), 0u);
  EXPECT_LE(d.capacity(), 4096u);
}

TEST(FrameDecoderTest, KeepsNoBufferOnceEveryFrameIsTaken) {
  FrameDecoder d(1 << 20);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(d.Feed(F(MessageType::kReport, std::string(200, 'x'))).ok());
    auto f = d.NextView();
    ASSERT_TRUE(f.ok() && f->has_value());
    auto none = d.NextView();
    ASSERT_TRUE(none.ok() && !none->has_value());
    EXPECT_LE(d.capacity(), std::string().capacity());  // its inline bytes only
  }
}

TEST(FrameDecoderTest, NextViewGivesTheFramesWithoutCopyingThem) {
  FrameDecoder d(1 << 20);
  ASSERT_TRUE(d.Feed(F(MessageType::kReport, "first") + F(MessageType::kDone, "{}") +
                     F(MessageType::kReport, std::string(100000, 'y')))
                  .ok());
  auto a = d.NextView();
  ASSERT_TRUE(a.ok() && a->has_value());
  EXPECT_EQ((*a)->type, MessageType::kReport);
  EXPECT_EQ((*a)->body, "first");
  auto b = d.NextView();
  ASSERT_TRUE(b.ok() && b->has_value());
  EXPECT_EQ((*b)->type, MessageType::kDone);
  EXPECT_EQ((*b)->body, "{}");
  auto c = d.NextView();
  ASSERT_TRUE(c.ok() && c->has_value());
  EXPECT_EQ((*c)->body, std::string(100000, 'y'));
  auto none = d.NextView();
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  // Asking again after the last frame frees the large buffer.
  EXPECT_EQ(d.buffered(), 0u);
  EXPECT_LE(d.capacity(), 4096u);
}

TEST(FrameDecoderTest, NextViewRefusesAnOversizedFrame) {
  FrameDecoder d(10);
  EXPECT_EQ(d.Feed(F(MessageType::kReport, std::string(11, 'x'))).code(), StatusCode::kDataLoss);
  EXPECT_EQ(d.NextView().status().code(), StatusCode::kDataLoss);
}

TEST(ReportBodyTest, ShortBodyIsDataLoss) {
  uint64_t round;
  std::string_view m;
  EXPECT_EQ(DecodeReportBody("1234", &round, &m).code(), StatusCode::kDataLoss);
}

TEST(CollectiveBodyTest, RoundTripsAndAShortBodyIsDataLoss) {
  const std::string body = EncodeCollectiveBody(0x0102030405060708, 2, std::string("a\0b", 3));
  EXPECT_EQ(body.substr(0, kCollectiveHeaderSize), std::string("\1\2\3\4\5\6\7\x08\2", 9));
  uint64_t sequence = 0;
  uint8_t kind = 0;
  std::string_view data;
  ASSERT_TRUE(DecodeCollectiveBody(body, &sequence, &kind, &data).ok());
  EXPECT_EQ(sequence, 0x0102030405060708u);
  EXPECT_EQ(kind, 2);
  EXPECT_EQ(data, std::string("a\0b", 3));
  EXPECT_EQ(DecodeCollectiveBody("12345678", &sequence, &kind, &data).code(),
            StatusCode::kDataLoss);
}

// Both ends of a control connection after the same handshake.
struct SealedPair {
  SealedFrames worker, controller;
};
SealedPair Sessions(const std::string& secret) {
  const std::string hello = "hello bytes", challenge = "challenge bytes";
  return {SealedFrames(ControlSession(secret, hello, challenge, SessionEnd::kInitiator)),
          SealedFrames(ControlSession(secret, hello, challenge, SessionEnd::kResponder))};
}

// Opens every frame of `bytes` at `to`; the bodies opened, or the first error.
StatusOr<std::vector<Frame>> OpenAll(SealedFrames& to, std::string_view bytes) {
  FrameDecoder decoder(size_t{1} << 20);
  JT_RETURN_IF_ERROR(decoder.Feed(bytes));
  std::vector<Frame> out;
  for (;;) {
    JT_ASSIGN_OR_RETURN(std::optional<Frame> f, decoder.Next());
    if (!f) return out;
    JT_ASSIGN_OR_RETURN(std::optional<FrameView> opened,
                        to.Open(f->type, f->body.data(), f->body.size()));
    if (opened) out.push_back({opened->type, std::string(opened->body)});
  }
}

TEST(SealedFramesTest, FramesRoundTripBothWaysAndHideTheirBodies) {
  SealedPair p = Sessions(GenerateSecret());
  std::string up, down;
  ASSERT_TRUE(p.worker.Seal(MessageType::kRegister, "{\"host\":\"h\"}", &up).ok());
  ASSERT_TRUE(p.worker.Seal(MessageType::kDone, "", &up).ok());
  ASSERT_TRUE(p.controller.Seal(MessageType::kPayload, "pickled function", &down).ok());
  EXPECT_EQ(up.find("host"), std::string::npos);
  EXPECT_EQ(down.find("pickled"), std::string::npos);
  auto at_controller = OpenAll(p.controller, up);
  ASSERT_TRUE(at_controller.ok()) << at_controller.status().ToString();
  ASSERT_EQ(at_controller->size(), 2u);
  EXPECT_EQ((*at_controller)[0].type, MessageType::kRegister);
  EXPECT_EQ((*at_controller)[0].body, "{\"host\":\"h\"}");
  EXPECT_EQ((*at_controller)[1].body, "");
  auto at_worker = OpenAll(p.worker, down);
  ASSERT_TRUE(at_worker.ok()) << at_worker.status().ToString();
  EXPECT_EQ((*at_worker)[0].body, "pickled function");
  // A frame is sealed for one direction: the sender cannot open its own.
  std::string own;
  ASSERT_TRUE(p.worker.Seal(MessageType::kDone, "", &own).ok());
  EXPECT_EQ(OpenAll(p.worker, own).status().code(), StatusCode::kUnauthenticated);
}

TEST(SealedFramesTest, ASharedFrameOpensOnceAfterItsKey) {
  SealedPair p = Sessions(GenerateSecret());
  SharedFrame shared = *SealShared(MessageType::kPayload, "pickled function");
  EXPECT_EQ(shared.frame->find("pickled"), std::string::npos);
  EXPECT_EQ(OpenShared(shared)->body, "pickled function");
  std::string down;
  ASSERT_TRUE(p.controller.SealKeyOf(shared, &down).ok());
  down += *shared.frame;
  ASSERT_TRUE(p.controller.Seal(MessageType::kPing, "", &down).ok());
  auto opened = OpenAll(p.worker, down);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  ASSERT_EQ(opened->size(), 2u);  // the key frame itself is not a message
  EXPECT_EQ((*opened)[0].type, MessageType::kPayload);
  EXPECT_EQ((*opened)[0].body, "pickled function");
  EXPECT_EQ((*opened)[1].type, MessageType::kPing);
  // Without its key (a replay), a shared frame does not open.
  EXPECT_EQ(OpenAll(p.worker, *shared.frame).status().code(), StatusCode::kUnauthenticated);
}

TEST(SealedFramesTest, AFrameChangedReplayedReorderedOrFromAnotherSessionFailsForGood) {
  const std::string secret = GenerateSecret();
  auto sealed = [](SealedFrames& s, MessageType type, std::string_view body) {
    std::string out;
    EXPECT_TRUE(s.Seal(type, body, &out).ok());
    return out;
  };
  {
    SealedPair p = Sessions(secret);
    std::string f = sealed(p.worker, MessageType::kReport, "12345678{}");
    f[4] = static_cast<char>(MessageType::kError);  // the header is authenticated too
    EXPECT_EQ(OpenAll(p.controller, f).status().code(), StatusCode::kUnauthenticated);
    // Once one frame failed, the connection stays failed.
    EXPECT_EQ(OpenAll(p.controller, sealed(p.worker, MessageType::kDone, "")).status().code(),
              StatusCode::kUnauthenticated);
  }
  {
    SealedPair p = Sessions(secret);
    std::string f = sealed(p.worker, MessageType::kDone, "");
    EXPECT_EQ(OpenAll(p.controller, f + f).status().code(), StatusCode::kUnauthenticated);
  }
  {
    SealedPair p = Sessions(secret);
    std::string one = sealed(p.worker, MessageType::kDone, "");
    std::string two = sealed(p.worker, MessageType::kDone, "");
    EXPECT_EQ(OpenAll(p.controller, two + one).status().code(), StatusCode::kUnauthenticated);
  }
  {
    SealedPair p = Sessions(secret);
    SealedFrames other(
        ControlSession(secret, "another hello", "challenge bytes", SessionEnd::kInitiator));
    EXPECT_EQ(OpenAll(p.controller, sealed(other, MessageType::kDone, "")).status().code(),
              StatusCode::kUnauthenticated);
  }
}

}  // namespace
}  // namespace jaxtrain::wire
