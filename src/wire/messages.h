// The messages a worker sends the controller once it has authenticated (docs/wire.md, types 4, 7,
// 8, 9, 10, 13 and 16), decoded into typed structs at the edge: the controller's loop switches over
// a WorkerMessage and parses no JSON itself; and the one the worker decodes during training
// (type 14, the release of a collective call). The Python worker writes the same JSON
// (python/jaxtrain/worker/entry.py, session.py); the encoder here is the C++ side's (tests, the
// fuzzer), and DecodeWorkerMessage(EncodeWorkerMessage(m)) == m for every m it decoded.
//
// Decoding is strict about kinds and lenient about presence: a field of the wrong kind (a number
// where a string belongs, a negative size, a copy_id with a '/') is an error, a field left out
// takes its default (but a checkpoint report needs its files, and each file its path, size and
// crc32c), and keys not named here are ignored. What a decoded field means for the run
// (the staging directory being the rank's own, a file path staying inside the checkpoint) is
// checked by its user, the controller and storage::CheckStagedPart.
//
// Functions are pure and thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "base/status.h"
#include "storage/checkpoint.h"
#include "wire/frame.h"

namespace jaxtrain::wire {

// kRegister: who the rank's process is. JSON {"host", "pid", "coordinator"}.
struct Registration {
  std::string host;
  uint32_t pid = 0;         // 0 = not given
  std::string coordinator;  // the JAX coordinator address rank 0 reserved; "" for the others
  bool operator==(const Registration&) const = default;
};

// kReport: one report()'s metrics. The metrics are not parsed here but where they are
// written (storage/metrics.h); the view points into the frame's body.
struct Report {
  uint64_t round = 0;  // the rank's report index in this attempt (1, 2, ...), not the run's round
  std::string_view metrics_json;
  bool operator==(const Report&) const = default;
};

// kReportCheckpoint: a report() with the rank's part of its checkpoint. JSON {"staging",
// "files": [{"path", "size", "crc32c", "mode", "link", "sha256"}], "dir_name", "copy_id",
// "store"}, then the metrics (a view into the frame's body, as Report's).
struct CheckpointReport {
  uint64_t round = 0;  // as Report's
  std::vector<storage::FileEntry> files;
  std::optional<std::string> dir_name;  // the name the rank asked for; JSON null or absent = none
  std::string copy_id;                  // its copy in host memory (IsCopyId); "" = none
  std::string staging;                  // where it staged the files; "" for a part in_store
  // The files are already in the run directory on object storage, uploaded by the rank's host
  // ("store": true; storage::RankCheckpoint::in_store).
  bool in_store = false;
  std::string_view metrics_json;
  bool operator==(const CheckpointReport&) const = default;
};

// Where a worker's error arose: its "phase".
enum class ErrorPhase {
  kTraining,  // "training" (or none given): the training function raised
  kStartUp,   // "start-up": before the training function ran
  kStorage,   // "storage": its host's upload to object storage failed
};

// kError: the worker's last word before it exits. JSON {"message", "traceback", "phase",
// "status_code"}; "status_code" (a StatusCodeName) goes with phase "storage", and the failure
// policy decides by it.
struct WorkerError {
  std::string message = "the training function raised an exception";
  std::string traceback;
  ErrorPhase phase = ErrorPhase::kTraining;
  StatusCode status_code = StatusCode::kUnknown;  // StatusCodeByName of the name sent
  bool operator==(const WorkerError&) const = default;
};

// The largest pickled return value a rank 0 may send with its kDone (the frame carries it as hex,
// twice as long, within kMaxWorkerFrameBody). The Python worker refuses a larger one first, naming
// this limit (python/jaxtrain/worker/entry.py).
constexpr size_t kMaxReturnValueSize = size_t{4} << 20;

// kDone: the training function returned. JSON {"return_value"}: what it returned, pickled
// (cloudpickle) and written as lowercase hex digits; rank 0 sends it, the other ranks leave it out
// (absent or null: none). The controller writes it into the run directory as is; it never
// unpickles it.
struct Done {
  std::optional<std::string> return_value;  // the pickled bytes
  bool operator==(const Done&) const = default;
};

// kPreemption: a notice that the rank's host is to be reclaimed, JSON {"source", "deadline_ms"}
// ("source" names what said so, e.g. "SIGTERM"; "deadline_ms" is UNIX time in ms, absent when
// the notice gave none); or, without "source", the rank's answer to the controller's query:
// {"calls", "rounds"}, the get_preemption_info() calls and report rounds it has made so far.
struct Preemption {
  std::string source;        // "" = an answer, not a notice
  uint64_t deadline_ms = 0;  // 0 = none given
  uint64_t calls = 0;
  uint64_t rounds = 0;
  bool operator==(const Preemption&) const = default;
};

// The two calls of jaxtrain.collective.
enum class CollectiveKind : uint8_t {
  kBarrier = 1,    // barrier(): no data
  kBroadcast = 2,  // broadcast_from_rank_zero(data): rank 0's pickled data, none from the others
};

// kCollective (worker -> controller): the rank's sequence-th collective call (1, 2, ... in each
// worker process); kCollectiveRelease (controller -> worker): every rank has made that call.
// Binary: u64 sequence, u8 kind, the data (a view into the frame's body): rank 0's pickled object
// of a broadcast (in its call and in every rank's release), at most kMaxCollectiveData bytes;
// empty for a barrier and in the other ranks' broadcast calls.
struct Collective {
  uint64_t sequence = 0;  // from 1; 0 is refused
  CollectiveKind kind = CollectiveKind::kBarrier;
  std::string_view data;
  bool operator==(const Collective&) const = default;
};

// kPong: the answer to the controller's kPing. Empty; or, to a ping "stacks", JSON {"stacks",
// "thread", "collective", "settling", "error"}: every thread's Python stack as faulthandler
// writes them, the training thread's id as the dump names it ("Thread 0x..."), the jaxtrain
// collective call the rank waits in ("" for none), whether it waits for the commit of its last
// checkpoint, and why no stacks could be taken ("" when they were). An empty body answers a
// "stacks" ping from a worker that cannot take stacks (its process did not enable them).
struct Pong {
  bool has_stacks = false;  // false: the empty body
  std::string stacks;
  uint64_t thread = 0;
  std::string collective;
  bool settling = false;
  std::string error;
  bool operator==(const Pong&) const = default;
};

using WorkerMessage = std::variant<Registration, Report, CheckpointReport, WorkerError, Done,
                                   Collective, Preemption, Pong>;

// Decodes an authenticated worker's frame; string views in the result point into `frame.body`.
// Errors: kInvalidArgument, its message "malformed message of type N (name): " and which field is
// wrong, its value and what is allowed; or "unexpected message type N" for a type a worker does
// not send after its handshake.
StatusOr<WorkerMessage> DecodeWorkerMessage(const FrameView& frame);

// The frame type of `message` and its body. Errors: kInvalidArgument when a checkpoint report's
// description is too large for its length field.
MessageType WorkerMessageType(const WorkerMessage& message);
StatusOr<std::string> EncodeWorkerMessage(const WorkerMessage& message);

// A kCollectiveRelease frame, as the worker decodes it; the data is a view into `frame.body`.
// Errors: kInvalidArgument, as DecodeWorkerMessage()'s, for a body of the wrong shape or a frame
// of another type.
StatusOr<Collective> DecodeCollectiveRelease(const FrameView& frame);
// The kCollectiveRelease body of `release`.
std::string EncodeCollectiveRelease(const Collective& release);

// What a user calls: "barrier()", "broadcast_from_rank_zero()".
std::string_view CollectiveKindName(CollectiveKind kind);

// Whether `id` is a copy_id as a worker may send it: 1 to 64 letters, digits and '-' (it names
// files of the host-memory store, so it must not hold a '/' or be "..").
bool IsCopyId(std::string_view id);

// The code whose StatusCodeName is `name`; kUnknown for any other name, and for "OK" (a worker's
// error is never OK).
StatusCode StatusCodeByName(std::string_view name);

// The "phase" name of `phase`.
std::string_view ErrorPhaseName(ErrorPhase phase);

}  // namespace jaxtrain::wire
