#include "wire/messages.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace jaxtrain::wire {
namespace {

// A checkpoint report's body: round 8, `description`, then the metrics {"loss":0.5}.
std::string CheckpointBody(std::string_view description) {
  return EncodeCheckpointReportBody(8, description, R"({"loss":0.5})").value();
}

template <typename T>
T Decoded(MessageType type, std::string_view body) {
  StatusOr<WorkerMessage> m = DecodeWorkerMessage({type, body});
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  if (!m.ok()) return T{};
  EXPECT_TRUE(std::holds_alternative<T>(*m));
  return std::holds_alternative<T>(*m) ? std::get<T>(*m) : T{};
}

TEST(DecodeWorkerMessageTest, DecodesARegistration) {
  auto r = Decoded<Registration>(MessageType::kRegister,
                                 R"({"host":"node-1","pid":4242,"coordinator":"10.0.0.1:1234"})");
  EXPECT_EQ(r, (Registration{.host = "node-1", .pid = 4242, .coordinator = "10.0.0.1:1234"}));
}

TEST(DecodeWorkerMessageTest, ARegistrationWithoutPidOrCoordinatorTakesTheirDefaults) {
  auto r = Decoded<Registration>(MessageType::kRegister, R"({"host":"node-2","extra":[1]})");
  EXPECT_EQ(r, (Registration{.host = "node-2"}));
  EXPECT_EQ(Decoded<Registration>(MessageType::kRegister, "{}"), Registration{});
}

TEST(DecodeWorkerMessageTest, DecodesAReportWithoutParsingItsMetrics) {
  std::string body = EncodeReportBody(7, R"({"loss":NaN})");
  auto r = Decoded<Report>(MessageType::kReport, body);
  EXPECT_EQ(r.round, 7u);
  EXPECT_EQ(r.metrics_json, R"({"loss":NaN})");
  EXPECT_EQ(r.metrics_json.data(), body.data() + kReportHeaderSize);  // a view, not a copy
}

TEST(DecodeWorkerMessageTest, DecodesAStagedCheckpointReport) {
  std::string body = CheckpointBody(
      R"({"staging":"/run/.staging/a0-r8-rank1","dir_name":"checkpoint_000008",)"
      R"("copy_id":"0f3a-9b","files":[)"
      R"({"path":"a.bin","size":12,"crc32c":99,"mode":384,"sha256":")" +
      std::string(64, 'e') + R"("},{"path":"b","size":0,"crc32c":0,"link":"a.bin"}]})");
  auto r = Decoded<CheckpointReport>(MessageType::kReportCheckpoint, body);
  EXPECT_EQ(r.round, 8u);
  EXPECT_EQ(r.staging, "/run/.staging/a0-r8-rank1");
  EXPECT_EQ(r.dir_name, "checkpoint_000008");
  EXPECT_EQ(r.copy_id, "0f3a-9b");
  EXPECT_FALSE(r.in_store);
  EXPECT_EQ(r.metrics_json, R"({"loss":0.5})");
  ASSERT_EQ(r.files.size(), 2u);
  EXPECT_EQ(r.files[0], (storage::FileEntry{.path = "a.bin",
                                            .size = 12,
                                            .crc32c = 99,
                                            .mode = 0600,
                                            .sha256 = std::string(64, 'e')}));
  EXPECT_EQ(r.files[1], (storage::FileEntry{.path = "b", .mode = 0644, .link = "a.bin"}));
}

TEST(DecodeWorkerMessageTest, DecodesACheckpointReportOfAPartAlreadyInTheStore) {
  auto r = Decoded<CheckpointReport>(
      MessageType::kReportCheckpoint,
      CheckpointBody(
          R"({"store":true,"dir_name":null,"files":[{"path":"s","size":3,"crc32c":7}]})"));
  EXPECT_TRUE(r.in_store);
  EXPECT_EQ(r.staging, "");
  EXPECT_EQ(r.dir_name, std::nullopt);
  EXPECT_EQ(r.copy_id, "");
  ASSERT_EQ(r.files.size(), 1u);
  EXPECT_EQ(r.files[0].path, "s");
}

TEST(DecodeWorkerMessageTest, DecodesAnErrorOfEachPhase) {
  auto training = Decoded<WorkerError>(MessageType::kError,
                                       R"({"message":"boom","traceback":"tb","phase":"training"})");
  EXPECT_EQ(training, (WorkerError{.message = "boom", .traceback = "tb"}));
  auto start_up = Decoded<WorkerError>(MessageType::kError, R"({"phase":"start-up"})");
  EXPECT_EQ(start_up.phase, ErrorPhase::kStartUp);
  EXPECT_EQ(start_up.message, "the training function raised an exception");
  auto storage = Decoded<WorkerError>(
      MessageType::kError,
      R"({"message":"m","phase":"storage","status_code":"PERMISSION_DENIED"})");
  EXPECT_EQ(storage.phase, ErrorPhase::kStorage);
  EXPECT_EQ(storage.status_code, StatusCode::kPermissionDenied);
}

TEST(DecodeWorkerMessageTest, AnErrorWithAStatusCodeOfNoKnownNameCarriesUnknown) {
  auto e = Decoded<WorkerError>(MessageType::kError, R"({"phase":"storage","status_code":"SLOW"})");
  EXPECT_EQ(e.status_code, StatusCode::kUnknown);
  e = Decoded<WorkerError>(MessageType::kError, R"({"phase":"storage","status_code":"OK"})");
  EXPECT_EQ(e.status_code, StatusCode::kUnknown);
}

TEST(DecodeWorkerMessageTest, ADoneWithoutAReturnValueHasNone) {
  EXPECT_EQ(Decoded<Done>(MessageType::kDone, "{}"), Done{});
  EXPECT_EQ(Decoded<Done>(MessageType::kDone, R"({"return_value":null,"extra":1})"), Done{});
}

TEST(DecodeWorkerMessageTest, ADoneCarriesRank0sPickledReturnValueAsHex) {
  auto d = Decoded<Done>(MessageType::kDone, R"({"return_value":"80054e2e"})");
  EXPECT_EQ(d.return_value, std::string("\x80\x05N.", 4));  // pickle.dumps(None)
  d = Decoded<Done>(MessageType::kDone, R"({"return_value":""})");
  EXPECT_EQ(d.return_value, "");
  const std::string largest(2 * kMaxReturnValueSize, 'a');
  d = Decoded<Done>(MessageType::kDone, R"({"return_value":")" + largest + "\"}");
  EXPECT_EQ(d.return_value, std::string(kMaxReturnValueSize, '\xaa'));
}

TEST(DecodeWorkerMessageTest, DecodesANoticeAndAnAnswer) {
  Preemption notice =
      Decoded<Preemption>(MessageType::kPreemption, R"({"source":"SIGTERM","deadline_ms":17})");
  EXPECT_EQ(notice, (Preemption{.source = "SIGTERM", .deadline_ms = 17}));
  Preemption answer = Decoded<Preemption>(MessageType::kPreemption, R"({"calls":3,"rounds":9})");
  EXPECT_EQ(answer, (Preemption{.calls = 3, .rounds = 9}));
}

TEST(DecodeWorkerMessageTest, DecodesACollectiveCallOfEachKind) {
  auto barrier = Decoded<Collective>(MessageType::kCollective, EncodeCollectiveBody(3, 1, ""));
  EXPECT_EQ(barrier, (Collective{.sequence = 3, .kind = CollectiveKind::kBarrier}));
  std::string body = EncodeCollectiveBody(1ull << 40, 2, std::string("\x80\x05K*.", 5));
  auto broadcast = Decoded<Collective>(MessageType::kCollective, body);
  EXPECT_EQ(broadcast.sequence, 1ull << 40);
  EXPECT_EQ(broadcast.kind, CollectiveKind::kBroadcast);
  EXPECT_EQ(broadcast.data, std::string("\x80\x05K*.", 5));
  EXPECT_EQ(broadcast.data.data(), body.data() + kCollectiveHeaderSize);  // a view, not a copy
  // The other ranks' broadcast calls carry no data; the largest allowed does.
  Decoded<Collective>(MessageType::kCollective, EncodeCollectiveBody(2, 2, ""));
  Decoded<Collective>(MessageType::kCollective,
                      EncodeCollectiveBody(2, 2, std::string(kMaxCollectiveData, 'x')));
}

TEST(DecodeCollectiveReleaseTest, DecodesWhatTheControllerEncodes) {
  const std::string data = "rank 0's object";
  const std::string body =
      EncodeCollectiveRelease({.sequence = 9, .kind = CollectiveKind::kBroadcast, .data = data});
  StatusOr<Collective> release = DecodeCollectiveRelease({MessageType::kCollectiveRelease, body});
  ASSERT_TRUE(release.ok()) << release.status().ToString();
  EXPECT_EQ(*release,
            (Collective{.sequence = 9, .kind = CollectiveKind::kBroadcast, .data = data}));
}

TEST(DecodeCollectiveReleaseTest, RefusesAnotherTypeAndAMalformedBody) {
  StatusOr<Collective> other =
      DecodeCollectiveRelease({MessageType::kCollective, EncodeCollectiveBody(1, 1, "")});
  EXPECT_EQ(other.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(other.status().message(), "unexpected message type 13");
  StatusOr<Collective> bad =
      DecodeCollectiveRelease({MessageType::kCollectiveRelease, EncodeCollectiveBody(1, 3, "")});
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(),
            "malformed message of type 14 (collective release): kind is 3, not 1 (barrier) or 2 "
            "(broadcast_from_rank_zero)");
}

TEST(CollectiveKindNameTest, NamesTheCallAsAUserWritesIt) {
  EXPECT_EQ(CollectiveKindName(CollectiveKind::kBarrier), "barrier()");
  EXPECT_EQ(CollectiveKindName(CollectiveKind::kBroadcast), "broadcast_from_rank_zero()");
}

struct Malformed {
  MessageType type;
  std::string body;
  std::string error;  // the whole message of the error
};

// Each field a worker sends, wrong in each way it can be.
std::vector<Malformed> MalformedMessages() {
  const std::string reg = "malformed message of type 4 (register): ";
  const std::string rep = "malformed message of type 7 (report): ";
  const std::string ckpt = "malformed message of type 10 (report with checkpoint): ";
  const std::string err = "malformed message of type 8 (error): ";
  const std::string pre = "malformed message of type 16 (preemption): ";
  const std::string coll = "malformed message of type 13 (collective): ";
  const std::string done = "malformed message of type 9 (done): ";
  const std::string value = "the hex digits of a pickled value of at most " +
                            std::to_string(kMaxReturnValueSize) + " bytes, or null";
  const std::string u64 = "an integer from 0 to 18446744073709551615";
  const std::string u32 = "an integer from 0 to 4294967295";
  auto file = [](std::string_view fields) {
    return CheckpointBody(R"({"files":[{"path":"ok","size":1,"crc32c":1},{)" + std::string(fields) +
                          "}]}");
  };
  return {
      {MessageType::kRegister, "host=node-1", reg + "the body is not JSON"},
      {MessageType::kRegister, "[]", reg + "the body is [], not a JSON object"},
      {MessageType::kRegister, R"({"host":7})", reg + "host is 7, not a string"},
      {MessageType::kRegister, R"({"host":"h","pid":-1})", reg + "pid is -1, not " + u32},
      {MessageType::kRegister, R"({"host":"h","pid":"1"})", reg + "pid is \"1\", not " + u32},
      {MessageType::kRegister, R"({"host":"h","pid":4294967296})",
       reg + "pid is 4294967296, not " + u32},
      {MessageType::kRegister, R"({"host":[")" + std::string(100, 'a') + "\"]}",
       reg + "host is [\"" + std::string(78, 'a') + "..., not a string"},  // cut short
      {MessageType::kRegister, R"({"host":"h","coordinator":null})",
       reg + "coordinator is null, not a string"},
      {MessageType::kReport, "1234567",
       rep + "report frame of 7 bytes is shorter than its 8-byte round number"},
      {MessageType::kReportCheckpoint, EncodeReportBody(8, "{}"),
       ckpt + "checkpoint report frame too short for its checkpoint description"},
      {MessageType::kReportCheckpoint, CheckpointBody("{\"files\":"),
       ckpt + "the body is not JSON"},
      {MessageType::kReportCheckpoint, CheckpointBody("\"files\""),
       ckpt + "the body is \"files\", not a JSON object"},
      {MessageType::kReportCheckpoint, CheckpointBody(R"({"staging":"/s"})"),
       ckpt + "files is missing"},
      {MessageType::kReportCheckpoint, CheckpointBody(R"({"files":{}})"),
       ckpt + "files is {}, not an array"},
      {MessageType::kReportCheckpoint, CheckpointBody(R"({"files":["a.bin"]})"),
       ckpt + "files[0] is \"a.bin\", not a JSON object"},
      {MessageType::kReportCheckpoint, file(R"("size":1,"crc32c":1)"),
       ckpt + "files[1].path is missing"},
      {MessageType::kReportCheckpoint, file(R"("path":["a"],"size":1,"crc32c":1)"),
       ckpt + "files[1].path is [\"a\"], not a string"},
      {MessageType::kReportCheckpoint, file(R"("path":"a","crc32c":1)"),
       ckpt + "files[1].size is missing"},
      {MessageType::kReportCheckpoint, file(R"("path":"a","size":-3,"crc32c":1)"),
       ckpt + "files[1].size is -3, not " + u64},
      {MessageType::kReportCheckpoint, file(R"("path":"a","size":1.5,"crc32c":1)"),
       ckpt + "files[1].size is 1.5, not " + u64},
      {MessageType::kReportCheckpoint, file(R"("path":"a","size":1)"),
       ckpt + "files[1].crc32c is missing"},
      {MessageType::kReportCheckpoint, file(R"("path":"a","size":1,"crc32c":4294967296)"),
       ckpt + "files[1].crc32c is 4294967296, not " + u32},
      {MessageType::kReportCheckpoint, file(R"("path":"a","size":1,"crc32c":1,"mode":"0644")"),
       ckpt + "files[1].mode is \"0644\", not " + u32},
      {MessageType::kReportCheckpoint, file(R"("path":"a","size":1,"crc32c":1,"link":false)"),
       ckpt + "files[1].link is false, not a string"},
      {MessageType::kReportCheckpoint, file(R"("path":"a","size":1,"crc32c":1,"sha256":1)"),
       ckpt + "files[1].sha256 is 1, not a string"},
      {MessageType::kReportCheckpoint, CheckpointBody(R"({"files":[],"staging":7})"),
       ckpt + "staging is 7, not a string"},
      {MessageType::kReportCheckpoint, CheckpointBody(R"({"files":[],"dir_name":["x"]})"),
       ckpt + "dir_name is [\"x\"], not a string or null"},
      {MessageType::kReportCheckpoint, CheckpointBody(R"({"files":[],"copy_id":"../elsewhere"})"),
       ckpt + "copy_id is \"../elsewhere\", not 1 to 64 letters, digits and '-'"},
      {MessageType::kReportCheckpoint, CheckpointBody(R"({"files":[],"copy_id":""})"),
       ckpt + "copy_id is \"\", not 1 to 64 letters, digits and '-'"},
      {MessageType::kReportCheckpoint,
       CheckpointBody(R"({"files":[],"copy_id":")" + std::string(65, 'a') + "\"}"),
       ckpt + "copy_id is \"" + std::string(65, 'a') + "\", not 1 to 64 letters, digits and '-'"},
      {MessageType::kReportCheckpoint, CheckpointBody(R"({"files":[],"copy_id":5})"),
       ckpt + "copy_id is 5, not 1 to 64 letters, digits and '-'"},
      {MessageType::kReportCheckpoint, CheckpointBody(R"({"files":[],"store":"yes"})"),
       ckpt + "store is \"yes\", not true or false"},
      {MessageType::kError, "Traceback (most recent call last)", err + "the body is not JSON"},
      {MessageType::kError, R"("boom")", err + "the body is \"boom\", not a JSON object"},
      {MessageType::kError, R"({"message":5})", err + "message is 5, not a string"},
      {MessageType::kError, R"({"traceback":[]})", err + "traceback is [], not a string"},
      {MessageType::kError, R"({"phase":{}})",
       err + "phase is {}, not \"training\", \"start-up\" or \"storage\""},
      {MessageType::kError, R"({"phase":"cleanup"})",
       err + "phase is \"cleanup\", not \"training\", \"start-up\" or \"storage\""},
      {MessageType::kError, R"({"phase":"storage","status_code":13})",
       err + "status_code is 13, not a string"},
      {MessageType::kPreemption, "SIGTERM", pre + "the body is not JSON"},
      {MessageType::kPreemption, R"({"source":15})", pre + "source is 15, not a string"},
      {MessageType::kPreemption, R"({"source":"s","deadline_ms":-1})",
       pre + "deadline_ms is -1, not " + u64},
      {MessageType::kPreemption, R"({"calls":"2"})", pre + "calls is \"2\", not " + u64},
      {MessageType::kPreemption, R"({"calls":2,"rounds":0.5})", pre + "rounds is 0.5, not " + u64},
      {MessageType::kPreemptionReply, "{}", "unexpected message type 17"},
      {MessageType::kPing, "", "unexpected message type 18"},
      {MessageType::kPong, "x", "malformed message of type 19 (pong): the body is not JSON"},
      {MessageType::kPong, R"({"stacks":1})",
       "malformed message of type 19 (pong): stacks is 1, not a string"},
      {MessageType::kPong, R"({"thread":-1})",
       "malformed message of type 19 (pong): thread is -1, not " + u64},
      {MessageType::kPong, R"({"settling":"no"})",
       "malformed message of type 19 (pong): settling is \"no\", not true or false"},
      {MessageType::kCollective, "12345678",
       coll + "collective frame of 8 bytes is shorter than its 9-byte sequence number and kind"},
      {MessageType::kCollective, EncodeCollectiveBody(0, 1, ""),
       coll + "sequence is 0, not an integer from 1"},
      {MessageType::kCollective, EncodeCollectiveBody(1, 0, ""),
       coll + "kind is 0, not 1 (barrier) or 2 (broadcast_from_rank_zero)"},
      {MessageType::kCollective, EncodeCollectiveBody(1, 1, "x"),
       coll + "a barrier carries no data, but 1 bytes came"},
      {MessageType::kCollective,
       EncodeCollectiveBody(1, 2, std::string(kMaxCollectiveData + 1, 'x')),
       coll + "data is 1048577 bytes, more than the limit of 1048576"},
      {MessageType::kCollectiveRelease, EncodeCollectiveBody(1, 1, ""),
       "unexpected message type 14"},
      {MessageType::kDone, "", done + "the body is not JSON"},
      {MessageType::kDone, "[]", done + "the body is [], not a JSON object"},
      {MessageType::kDone, R"({"return_value":5})", done + "return_value is 5, not " + value},
      {MessageType::kDone, R"({"return_value":"abc"})",
       done + "return_value is \"abc\", not " + value},
      {MessageType::kDone, R"({"return_value":"zz"})",
       done + "return_value is \"zz\", not " + value},
      {MessageType::kDone,
       R"({"return_value":")" + std::string(2 * kMaxReturnValueSize + 2, '0') + "\"}",
       done + "return_value is \"" + std::string(79, '0') + "..., not " + value},
      {MessageType::kHello, "", "unexpected message type 1"},
      {MessageType::kStart, "{}", "unexpected message type 5"},
      {MessageType::kCheckpointSettled, "release", "unexpected message type 12"},
  };
}

TEST(DecodeWorkerMessageTest, EachMalformedFieldIsAnInvalidArgumentNamingIt) {
  for (const Malformed& m : MalformedMessages()) {
    StatusOr<WorkerMessage> decoded = DecodeWorkerMessage({m.type, m.body});
    ASSERT_FALSE(decoded.ok()) << m.error;
    EXPECT_EQ(decoded.status().code(), StatusCode::kInvalidArgument) << m.error;
    EXPECT_EQ(decoded.status().message(), m.error);
  }
}

TEST(DecodeWorkerMessageTest, EveryDecodedMessageSurvivesEncodingAndDecodingAgain) {
  std::vector<std::pair<MessageType, std::string>> frames = {
      {MessageType::kRegister, R"({"host":"node-1","pid":4242,"coordinator":"c:1"})"},
      {MessageType::kRegister, R"({"host":""})"},
      {MessageType::kReport, EncodeReportBody(1ull << 40, R"({"a":Infinity})")},
      {MessageType::kReportCheckpoint,
       CheckpointBody(R"({"staging":"/s","dir_name":"d","copy_id":"x-1","files":[)"
                      R"({"path":"a","size":1,"crc32c":2,"mode":420,"link":"b"}]})")},
      {MessageType::kReportCheckpoint, CheckpointBody(R"({"store":true,"files":[]})")},
      {MessageType::kReportCheckpoint,
       CheckpointBody(R"({"store":false,"dir_name":"","files":[]})")},
      {MessageType::kError, R"({"message":"m","phase":"storage","status_code":"UNAVAILABLE"})"},
      {MessageType::kError, "{}"},
      {MessageType::kDone, "{}"},
      {MessageType::kDone, R"({"return_value":"80054B2A2E"})"},
      {MessageType::kDone, R"({"return_value":""})"},
      {MessageType::kPreemption, R"({"source":"SIGTERM"})"},
      {MessageType::kPreemption, R"({"source":"metadata","deadline_ms":1764000000000})"},
      {MessageType::kPreemption, R"({"calls":0,"rounds":12})"},
      {MessageType::kPreemption, R"({"deadline_ms":17})"},
      {MessageType::kPreemption, R"({"source":"SIGTERM","calls":2})"},
      {MessageType::kCollective, EncodeCollectiveBody(1, 1, "")},
      {MessageType::kCollective, EncodeCollectiveBody(7, 2, std::string("\0pickled\xff", 9))},
      {MessageType::kPong, ""},
      {MessageType::kPong, "{}"},
      {MessageType::kPong,
       R"({"stacks":"Thread 0x01 (most recent call first):\n","thread":1,"collective":"barrier() call 2","settling":true})"},
      {MessageType::kPong, R"({"error":"faulthandler is not registered"})"},
  };
  for (const auto& [type, body] : frames) {
    StatusOr<WorkerMessage> decoded = DecodeWorkerMessage({type, body});
    ASSERT_TRUE(decoded.ok()) << body << ": " << decoded.status().ToString();
    EXPECT_EQ(WorkerMessageType(*decoded), type);
    StatusOr<std::string> encoded = EncodeWorkerMessage(*decoded);
    ASSERT_TRUE(encoded.ok()) << encoded.status().ToString();
    StatusOr<WorkerMessage> again = DecodeWorkerMessage({type, *encoded});
    ASSERT_TRUE(again.ok()) << *encoded << ": " << again.status().ToString();
    EXPECT_EQ(*again, *decoded) << body << " became " << *encoded;
  }
}

TEST(IsCopyIdTest, AcceptsOneTo64LettersDigitsAndDashesOnly) {
  EXPECT_TRUE(IsCopyId("a"));
  EXPECT_TRUE(IsCopyId("0123456789abcdefABCDEF-"));
  EXPECT_TRUE(IsCopyId(std::string(64, 'f')));
  EXPECT_FALSE(IsCopyId(""));
  EXPECT_FALSE(IsCopyId(std::string(65, 'f')));
  EXPECT_FALSE(IsCopyId(".."));
  EXPECT_FALSE(IsCopyId("a/b"));
  EXPECT_FALSE(IsCopyId("a_b"));
  EXPECT_FALSE(IsCopyId(std::string("a\0b", 3)));
}

TEST(StatusCodeByNameTest, NamesEveryCodeButOk) {
  for (int c = 1; c <= static_cast<int>(StatusCode::kUnauthenticated); ++c) {
    auto code = static_cast<StatusCode>(c);
    EXPECT_EQ(StatusCodeByName(StatusCodeName(code)), code);
  }
  EXPECT_EQ(StatusCodeByName("OK"), StatusCode::kUnknown);
  EXPECT_EQ(StatusCodeByName("unavailable"), StatusCode::kUnknown);
  EXPECT_EQ(StatusCodeByName(""), StatusCode::kUnknown);
}

}  // namespace
}  // namespace jaxtrain::wire
