#include "wire/frame.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace jaxtrain::wire
