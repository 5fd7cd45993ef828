// Writes the fuzzers' seed corpus: valid conversations of the control protocol (docs/wire.md) and
// the classic hostile openings, each in its own small file.
//
//   make_corpus <dir>   writes <dir>/channel/*, <dir>/frame_decoder/*, <dir>/handshake/* and
//                       <dir>/messages/*
//
// The checked-in corpus (src/wire/fuzz/corpus) is this program's output plus the inputs of crashes
// the fuzzers found; when the wire format changes, rebuild and rerun it after scripts/fuzz.sh:
//   ninja -C build/fuzz make_corpus && build/fuzz/src/wire/fuzz/make_corpus src/wire/fuzz/corpus
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "wire/channel.h"
#include "wire/frame.h"
#include "wire/fuzz/fuzz_support.h"
#include "wire/handshake.h"

namespace jaxtrain::wire::fuzz {
namespace {

// frame_decoder_fuzzer.cc's variant bits.
constexpr uint8_t kStrict = 0;
constexpr uint8_t kStartAuthenticated = 1;
constexpr uint8_t kLenient = 2;
constexpr uint8_t kOneByteChunks = 4;

std::string Header(uint32_t length, uint8_t type) {
  std::string out;
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>(length >> shift));
  out.push_back(static_cast<char>(type));
  return out;
}

// A frame whose body is known to fit.
std::string Frame(MessageType type, std::string_view body) {
  return EncodeFrame(type, body).value();
}

std::string Bytes(const Mac& mac) {
  return std::string(reinterpret_cast<const char*>(mac.data()), mac.size());
}

// frame_decoder_fuzzer.cc's input: the variant, the chunking seed, the stream.
std::string FrameInput(uint8_t variant, uint64_t seed, std::string_view stream) {
  std::string out(1, static_cast<char>(variant));
  for (int shift = 56; shift >= 0; shift -= 8) out.push_back(static_cast<char>(seed >> shift));
  out.append(stream);
  return out;
}

bool Write(const std::filesystem::path& dir, const std::string& name, std::string_view bytes) {
  std::ofstream out(dir / name, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out.good()) {
    std::fprintf(stderr, "make_corpus: cannot write %s\n", (dir / name).c_str());
    return false;
  }
  return true;
}

bool WriteCorpus(const std::filesystem::path& root) {
  const std::string hello_body = EncodeHello(SeedHello(), FixedSecret());
  const std::string proof = Bytes(WorkerProof(FixedSecret(), SeedHello(), FixedControllerNonce()));
  const std::string hello = Frame(MessageType::kHello, hello_body);
  const std::string auth = Frame(MessageType::kAuth, proof);
  const std::string reg = Frame(MessageType::kRegister,
                                R"({"host":"node-1","pid":4242,"coordinator":"10.0.0.1:1234"})");
  const std::string report =
      Frame(MessageType::kReport, EncodeReportBody(7, R"({"loss":0.25,"acc":NaN})"));
  const std::string checkpoint_report =
      Frame(MessageType::kReportCheckpoint,
            EncodeCheckpointReportBody(
                8,
                R"({"staging":"/tmp/s","files":[{"path":"a.bin","size":12,"crc32c":99}],)"
                R"("dir_name":"checkpoint_000008"})",
                R"({"loss":0.2})")
                .value());
  const std::string error = Frame(
      MessageType::kError, R"({"message":"boom","traceback":"Traceback ...","phase":"training"})");
  const std::string done = Frame(MessageType::kDone, "{}");
  const std::string handshake = hello + auth;
  // After the handshake every frame is sealed by the seed connection's session (frame.h), as
  // frame_decoder_fuzzer.cc's controller opens it; Sealed() seals a stream's frames in turn, from
  // the session's first frame.
  const Mac controller_proof = ControllerProof(FixedSecret(), SeedHello(), FixedControllerNonce());
  const std::string challenge =
      std::string(reinterpret_cast<const char*>(FixedControllerNonce().data()), kNonceSize) +
      Bytes(controller_proof);
  auto sealed = [&](const std::vector<std::pair<MessageType, std::string>>& frames) {
    SealedFrames worker(
        ControlSession(FixedSecret(), hello_body, challenge, SessionEnd::kInitiator));
    std::string out;
    for (const auto& [type, body] : frames) (void)worker.Seal(type, body, &out);
    return out;
  };
  const std::string reg_body = R"({"host":"node-1","pid":4242,"coordinator":"10.0.0.1:1234"})";
  const std::string report_body = EncodeReportBody(7, R"({"loss":0.25,"acc":NaN})");
  const std::string checkpoint_report_body =
      EncodeCheckpointReportBody(
          8,
          R"({"staging":"/tmp/s","files":[{"path":"a.bin","size":12,"crc32c":99}],)"
          R"("dir_name":"checkpoint_000008"})",
          R"({"loss":0.2})")
          .value();
  const std::string error_body =
      R"({"message":"boom","traceback":"Traceback ...","phase":"training"})";
  const std::string conversation =
      handshake + sealed({{MessageType::kRegister, reg_body},
                          {MessageType::kReport, report_body},
                          {MessageType::kReportCheckpoint, checkpoint_report_body},
                          {MessageType::kDone, "{}"}});
  std::string controller_frames =
      Frame(MessageType::kChallenge, std::string(kChallengeSize, '\x11')) +
      Frame(MessageType::kStart, R"({"coordinator":"10.0.0.1:1234","world_size":2})") +
      Frame(MessageType::kPayload, std::string(40, '\x80'));
  std::string empty_bodies;
  for (uint8_t type = 1; type <= kMaxMessageType; ++type) {
    empty_bodies += Frame(static_cast<MessageType>(type), "");
  }
  std::vector<std::pair<MessageType, std::string>> every_sealed;
  for (uint8_t type = 1; type <= kMaxMessageType; ++type) {
    every_sealed.emplace_back(static_cast<MessageType>(type), "");
  }
  std::string bad_checkpoint_length = EncodeReportBody(9, "") + "\xff\xff\xff\xf0{}";
  std::string sealed_changed = sealed({{MessageType::kReport, report_body}});
  sealed_changed.back() ^= 1;
  const std::string sealed_done = sealed({{MessageType::kDone, "{}"}});

  const std::filesystem::path frames = root / "frame_decoder";
  const std::filesystem::path hs = root / "handshake";
  std::filesystem::create_directories(frames);
  std::filesystem::create_directories(hs);
  const struct {
    const char* name;
    uint8_t variant;
    uint64_t seed;
    std::string stream;
  } frame_seeds[] = {
      {"hello", kStrict, 0, hello},
      {"hello_one_byte_chunks", kOneByteChunks, 0, hello},
      {"handshake", kStrict, 1, handshake},
      {"handshake_one_byte_chunks", kOneByteChunks, 0, handshake},
      {"conversation", kStrict, 2, conversation},
      {"conversation_other_chunks", kStrict, 0x0123456789abcdef, conversation},
      {"conversation_one_byte_chunks", kOneByteChunks, 0, conversation},
      {"conversation_lenient", kLenient, 3, conversation},
      {"conversation_with_error", kStrict, 4,
       handshake + sealed({{MessageType::kRegister, reg_body},
                           {MessageType::kReport, report_body},
                           {MessageType::kError, error_body}})},
      {"authed_register", kStartAuthenticated, 5, sealed({{MessageType::kRegister, reg_body}})},
      {"authed_report", kStartAuthenticated, 6, sealed({{MessageType::kReport, report_body}})},
      {"authed_checkpoint_report", kStartAuthenticated, 7,
       sealed({{MessageType::kReportCheckpoint, checkpoint_report_body}})},
      {"authed_error", kStartAuthenticated, 8, sealed({{MessageType::kError, error_body}})},
      {"authed_done", kStartAuthenticated, 9, sealed_done},
      {"authed_every_frame", kStartAuthenticated | kLenient, 10,
       reg + report + checkpoint_report + error + done + controller_frames},
      {"authed_empty_bodies", kStartAuthenticated | kLenient, 11, empty_bodies},
      {"authed_every_frame_sealed", kStartAuthenticated | kLenient, 28, sealed(every_sealed)},
      {"authed_sealed_changed", kStartAuthenticated, 29, sealed_changed},
      {"authed_sealed_replayed", kStartAuthenticated, 30, sealed_done + sealed_done},
      {"authed_in_the_clear", kStartAuthenticated, 31, done},
      {"authed_short_report", kStartAuthenticated, 12, sealed({{MessageType::kReport, "1234"}})},
      {"authed_bad_checkpoint_length", kStartAuthenticated, 13,
       sealed({{MessageType::kReportCheckpoint, bad_checkpoint_length}})},
      {"authed_over_limit", kStartAuthenticated, 14,
       Header((16 << 20) + kSealedFrameOverhead + 2, static_cast<uint8_t>(MessageType::kReport))},
      {"hello_then_unproven_auth", kStrict, 15,
       hello + Frame(MessageType::kAuth, std::string(kAuthSize, 'x'))},
      {"hello_then_oversized_auth", kStrict, 16,
       hello + Header(kAuthSize + 2, static_cast<uint8_t>(MessageType::kAuth))},
      {"hello_truncated", kStrict, 17, hello.substr(0, 20)},
      {"hello_over_limit", kStrict, 18,
       Header(kHelloSize + 2, static_cast<uint8_t>(MessageType::kHello))},
      {"length_ffffffff", kStrict, 19,
       Header(0xffffffff, static_cast<uint8_t>(MessageType::kHello))},
      {"length_zero", kStrict, 20, Header(0, static_cast<uint8_t>(MessageType::kHello))},
      {"type_zero", kStrict, 21, Header(kHelloSize + 1, 0)},
      {"type_after_the_last", kStrict, 22, Header(kHelloSize + 1, kMaxMessageType + 1)},
      {"type_200", kStrict, 23, Header(kHelloSize + 1, 200)},
      {"http_get", kStrict, 24, "GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"},
      {"register_before_hello", kStrict, 25, reg},
      {"hellos_repeated", kLenient, 26, hello + hello + hello},
      {"conversation_then_oversized", kStrict, 27,
       conversation + Header(0xfffffff0, static_cast<uint8_t>(MessageType::kReport))},
  };
  for (const auto& s : frame_seeds) {
    if (!Write(frames, s.name, FrameInput(s.variant, s.seed, s.stream))) return false;
  }

  std::string wrong_version = hello_body;
  wrong_version[5] = 1;
  std::string wrong_magic = hello_body;
  wrong_magic[0] = 'X';
  std::string wrong_mac = hello_body;
  wrong_mac[kHelloSize - 1] ^= 1;
  std::string wrong_proof = proof;
  wrong_proof[31] ^= 1;
  const std::string secret_hex = ToHex(FixedSecret());
  const struct {
    const char* name;
    std::string bytes;
  } handshake_seeds[] = {
      {"hello", hello_body},
      {"hello_and_proof", hello_body + proof},
      {"proof", proof},
      {"hello_and_wrong_proof", hello_body + wrong_proof},
      {"hello_and_short_proof", hello_body + proof.substr(0, kMacSize - 1)},
      {"hello_and_long_proof", hello_body + proof + "x"},
      {"hello_wrong_version", wrong_version},
      {"hello_wrong_magic", wrong_magic},
      {"hello_wrong_mac", wrong_mac},
      {"hello_of_another_run", EncodeHello(SeedHello(), std::string(kSecretSize, '\x11'))},
      {"hello_short", hello_body.substr(0, kHelloSize - 1)},
      {"secret_hex", secret_hex},
      {"hex_upper", "00FFa5B7c9"},
      {"hex_odd_length", secret_hex.substr(0, 7)},
      {"hex_bad_digit", "0g"},
      {"empty", ""},
  };
  for (const auto& s : handshake_seeds) {
    if (!Write(hs, s.name, s.bytes)) return false;
  }

  // channel_fuzzer.cc: a first byte choosing the part, then its bytes.
  ChannelInitiator initiator(FixedSecret(), FixedEnds(), FixedChannelNonce());
  const std::string open = initiator.Open().value();
  ChannelResponder responder(FixedSecret(), "jaxtrain-join", "host-0");
  if (!responder.OnOpen(open).ok()) return false;
  const std::string accept = responder.Accept();
  const std::string refusal = responder.Refuse("host rank 1 is taken");
  Session sender(FixedKey(1), FixedKey(2));
  const std::string record = sender.Seal("{\"command\": \"true\"}").value().substr(4);
  std::string wrong_record = record;
  wrong_record[0] ^= 1;
  const std::filesystem::path ch = root / "channel";
  std::filesystem::create_directories(ch);
  const struct {
    const char* name;
    std::string bytes;
  } channel_seeds[] = {
      {"open", std::string(1, '\0') + open},
      {"open_short", std::string(1, '\0') + open.substr(0, 40)},
      {"accept", std::string(1, '\1') + accept},
      {"refusal", std::string(1, '\1') + refusal},
      {"unauthenticated_refusal",
       std::string(1, '\1') + ChannelResponder::UnauthenticatedRefusal()},
      {"record", std::string(1, '\2') + record},
      {"record_changed", std::string(1, '\2') + wrong_record},
  };
  for (const auto& s : channel_seeds) {
    if (!Write(ch, s.name, s.bytes)) return false;
  }

  // messages_fuzzer.cc: the frame's type byte, then its body, as the Python worker sends it.
  const std::string sha256(64, 'c');
  const struct {
    const char* name;
    MessageType type;
    std::string body;
  } message_seeds[] = {
      {"register_rank0", MessageType::kRegister,
       R"({"host": "node-1", "pid": 4242, "coordinator": "10.0.0.1:1234"})"},
      {"register", MessageType::kRegister, R"({"host": "node-2", "pid": 17, "coordinator": ""})"},
      {"report", MessageType::kReport, EncodeReportBody(7, R"({"loss": 0.25, "acc": NaN})")},
      {"checkpoint_staged", MessageType::kReportCheckpoint,
       EncodeCheckpointReportBody(
           8,
           R"({"staging": "/run/.staging/a0-r8-rank1", "dir_name": null, "files": [)"
           R"({"path": "model/a.bin", "size": 12, "crc32c": 99, "mode": 420, "sha256": ")" +
               sha256 +
               R"("}, {"path": "latest", "size": 0, "crc32c": 0, "mode": 511, "link": "model"}],)"
               R"( "copy_id": "0123456789abcdef0123456789abcdef"})",
           R"({"loss": 0.2})")
           .value()},
      {"checkpoint_in_store", MessageType::kReportCheckpoint,
       EncodeCheckpointReportBody(
           9,
           R"({"dir_name": "checkpoint_000009", "files": [{"path": "a.bin", "size": 3,)"
           R"( "crc32c": 7, "mode": 420, "sha256": ")" +
               sha256 + R"("}], "store": true})",
           "{}")
           .value()},
      {"error_training", MessageType::kError,
       R"({"message": "ValueError: boom", "traceback": "Traceback ...", "phase": "training"})"},
      {"error_start_up", MessageType::kError,
       R"({"message": "start-up failed: ImportError: jax", "traceback": "", "phase": "start-up"})"},
      {"error_storage", MessageType::kError,
       R"({"message": "upload failed", "traceback": "", "phase": "storage",)"
       R"( "status_code": "PERMISSION_DENIED"})"},
      {"done", MessageType::kDone, "{}"},
      {"preemption_notice", MessageType::kPreemption,
       R"({"source": "SIGTERM", "deadline_ms": 1764000000000})"},
      {"preemption_answer", MessageType::kPreemption, R"({"calls": 7, "rounds": 41})"},
      {"collective_barrier", MessageType::kCollective, EncodeCollectiveBody(1, 1, "")},
      {"collective_broadcast_rank0", MessageType::kCollective,
       EncodeCollectiveBody(2, 2, std::string("\x80\x05K*.", 5))},
      {"collective_broadcast", MessageType::kCollective, EncodeCollectiveBody(2, 2, "")},
      {"collective_barrier_with_data", MessageType::kCollective, EncodeCollectiveBody(3, 1, "x")},
      {"collective_release", MessageType::kCollectiveRelease, EncodeCollectiveBody(2, 2, "x")},
      // Rank 0's: pickle.dumps({"loss": 0.5}) as cloudpickle writes it, in hex.
      {"done_return_value", MessageType::kDone,
       R"({"return_value": "80059514000000000000007d948c046c6f737394473fe0000000000000732e"})"},
      {"done_wrong_return_value", MessageType::kDone, R"({"return_value": "8005x"})"},
      {"error_wrong_kinds", MessageType::kError, R"({"message": 5, "traceback": [], "phase": {}})"},
      {"unexpected_start", MessageType::kStart, R"({"coordinator": "10.0.0.1:1234"})"},
  };
  const std::filesystem::path messages = root / "messages";
  std::filesystem::create_directories(messages);
  for (const auto& s : message_seeds) {
    std::string bytes(1, static_cast<char>(s.type));
    if (!Write(messages, s.name, bytes + s.body)) return false;
  }
  return true;
}

}  // namespace
}  // namespace jaxtrain::wire::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(
        stderr,
        "usage: make_corpus <dir>  (writes <dir>/channel, <dir>/frame_decoder, <dir>/handshake, "
        "<dir>/messages)\n");
    return 2;
  }
  return jaxtrain::wire::fuzz::WriteCorpus(argv[1]) ? 0 : 1;
}
