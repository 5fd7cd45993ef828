#include "wire/frame.h"

#include <gtest/gtest.h>

namespace jaxtrain::wire {
namespace {

TEST(FrameDecoderTest, DecodesFramesSplitAtEveryByte) {
  std::string stream = EncodeFrame(MessageType::kRegister, "{\"a\":1}") +
                       EncodeFrame(MessageType::kDone, "") +
                       EncodeFrame(MessageType::kReport, EncodeReportBody(7, "{}"));
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
  std::string header = EncodeFrame(MessageType::kRegister, std::string(17, 'x')).substr(0, 5);
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
  std::string stream = EncodeFrame(MessageType::kDone, "") +
                       EncodeFrame(MessageType::kRegister, std::string(9, 'x')).substr(0, 5);
  ASSERT_TRUE(d.Feed(stream).ok());
  auto first = d.Next();
  ASSERT_TRUE(first.ok() && first->has_value());
  EXPECT_EQ(d.Next().status().code(), StatusCode::kDataLoss);
}

TEST(FrameDecoderTest, ALimitRaisedAfterAFrameAppliesToTheFramesQueuedBehindIt) {
  FrameDecoder d(4);
  std::string stream =
      EncodeFrame(MessageType::kAuth, "abcd") + EncodeFrame(MessageType::kRegister, "{\"x\":1}");
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
  std::string f = EncodeFrame(MessageType::kRegister, "hello");
  ASSERT_TRUE(d.Feed(f.substr(0, f.size() - 1)).ok());
  auto next = d.Next();
  ASSERT_TRUE(next.ok());
  EXPECT_FALSE(next->has_value());
}

TEST(ReportBodyTest, CheckpointReportRoundTrips) {
  std::string body = EncodeCheckpointReportBody(42, R"({"files":[]})", R"({"loss":1})");
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

TEST(ReportBodyTest, ShortBodyIsDataLoss) {
  uint64_t round;
  std::string_view m;
  EXPECT_EQ(DecodeReportBody("1234", &round, &m).code(), StatusCode::kDataLoss);
}

}  // namespace
}  // namespace jaxtrain::wire
