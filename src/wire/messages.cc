#include "wire/messages.h"

#include <algorithm>
#include <cctype>
#include <limits>
#include <nlohmann/json.hpp>
#include <type_traits>

#include "wire/handshake.h"

namespace jaxtrain::wire {
namespace {

using nlohmann::json;

constexpr size_t kMaxCopyIdSize = 64;
constexpr size_t kShownValueSize = 80;  // how much of a wrong value an error message quotes

std::string_view TypeName(MessageType type) {
  switch (type) {
    case MessageType::kRegister: return "register";
    case MessageType::kReport: return "report";
    case MessageType::kError: return "error";
    case MessageType::kReportCheckpoint: return "report with checkpoint";
    case MessageType::kPreemption: return "preemption";
    case MessageType::kCollective: return "collective";
    case MessageType::kCollectiveRelease: return "collective release";
    case MessageType::kDone: return "done";
    case MessageType::kPong: return "pong";
    default: return "unexpected";
  }
}

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// `value` as JSON, cut short when long.
std::string Shown(const json& value) {
  std::string text = Dump(value);
  if (text.size() > kShownValueSize) text = text.substr(0, kShownValueSize) + "...";
  return text;
}

Status Wrong(const std::string& field, const json& value, std::string_view allowed) {
  return InvalidArgumentError(field + " is " + Shown(value) + ", not " + std::string(allowed));
}

// The object `body` holds. Errors: kInvalidArgument when it is not JSON or not an object.
StatusOr<json> ParseObject(std::string_view body) {
  json j = json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgumentError("the body is not JSON");
  if (!j.is_object()) return Wrong("the body", j, "a JSON object");
  return j;
}

// The field `key` of `object`, or nullptr when it is absent; `required` makes absence an error.
StatusOr<const json*> Find(const json& object, const std::string& where, const char* key,
                           bool required) {
  auto it = object.find(key);
  if (it != object.end()) return &*it;
  if (required) return InvalidArgumentError(where + key + " is missing");
  return static_cast<const json*>(nullptr);
}

// Reads the string at `key` into `out`; an absent optional field leaves `out` as it is.
Status ReadString(const json& object, const std::string& where, const char* key, bool required,
                  std::string* out) {
  JT_ASSIGN_OR_RETURN(const json* value, Find(object, where, key, required));
  if (value == nullptr) return OkStatus();
  if (!value->is_string()) return Wrong(where + key, *value, "a string");
  *out = value->get<std::string>();
  return OkStatus();
}

// Reads the integer from 0 to the largest T at `key` into `out`, as ReadString().
template <typename T>
Status ReadUnsigned(const json& object, const std::string& where, const char* key, bool required,
                    T* out) {
  static_assert(std::is_unsigned_v<T>);
  JT_ASSIGN_OR_RETURN(const json* value, Find(object, where, key, required));
  if (value == nullptr) return OkStatus();
  // JSON's non-negative integers parse as unsigned; negative ones and fractions do not.
  if (!value->is_number_unsigned() ||
      value->get<uint64_t>() > uint64_t{std::numeric_limits<T>::max()}) {
    return Wrong(where + key, *value,
                 "an integer from 0 to " + std::to_string(std::numeric_limits<T>::max()));
  }
  *out = static_cast<T>(value->get<uint64_t>());
  return OkStatus();
}

StatusOr<Registration> DecodeRegistration(std::string_view body) {
  JT_ASSIGN_OR_RETURN(json j, ParseObject(body));
  Registration r;
  JT_RETURN_IF_ERROR(ReadString(j, "", "host", /*required=*/false, &r.host));
  JT_RETURN_IF_ERROR(ReadUnsigned(j, "", "pid", /*required=*/false, &r.pid));
  JT_RETURN_IF_ERROR(ReadString(j, "", "coordinator", /*required=*/false, &r.coordinator));
  return r;
}

StatusOr<Report> DecodeReport(std::string_view body) {
  Report r;
  Status s = DecodeReportBody(body, &r.round, &r.metrics_json);
  if (!s.ok()) return InvalidArgumentError(s.message());
  return r;
}

StatusOr<storage::FileEntry> DecodeFileEntry(const json& file, const std::string& where) {
  if (!file.is_object()) return Wrong(where, file, "a JSON object");
  const std::string prefix = where + ".";
  storage::FileEntry e;
  JT_RETURN_IF_ERROR(ReadString(file, prefix, "path", /*required=*/true, &e.path));
  JT_RETURN_IF_ERROR(ReadUnsigned(file, prefix, "size", /*required=*/true, &e.size));
  JT_RETURN_IF_ERROR(ReadUnsigned(file, prefix, "crc32c", /*required=*/true, &e.crc32c));
  JT_RETURN_IF_ERROR(ReadUnsigned(file, prefix, "mode", /*required=*/false, &e.mode));
  JT_RETURN_IF_ERROR(ReadString(file, prefix, "link", /*required=*/false, &e.link));
  JT_RETURN_IF_ERROR(ReadString(file, prefix, "sha256", /*required=*/false, &e.sha256));
  return e;
}

StatusOr<CheckpointReport> DecodeCheckpointReport(std::string_view body) {
  CheckpointReport r;
  std::string_view description;
  Status framed = DecodeCheckpointReportBody(body, &r.round, &description, &r.metrics_json);
  if (!framed.ok()) return InvalidArgumentError(framed.message());
  JT_ASSIGN_OR_RETURN(json j, ParseObject(description));

  JT_ASSIGN_OR_RETURN(const json* files, Find(j, "", "files", /*required=*/true));
  if (!files->is_array()) return Wrong("files", *files, "an array");
  r.files.reserve(files->size());
  for (size_t i = 0; i < files->size(); ++i) {
    JT_ASSIGN_OR_RETURN(storage::FileEntry e,
                        DecodeFileEntry((*files)[i], "files[" + std::to_string(i) + "]"));
    r.files.push_back(std::move(e));
  }
  JT_RETURN_IF_ERROR(ReadString(j, "", "staging", /*required=*/false, &r.staging));

  JT_ASSIGN_OR_RETURN(const json* dir_name, Find(j, "", "dir_name", /*required=*/false));
  if (dir_name != nullptr && !dir_name->is_null()) {
    if (!dir_name->is_string()) return Wrong("dir_name", *dir_name, "a string or null");
    r.dir_name = dir_name->get<std::string>();
  }

  JT_ASSIGN_OR_RETURN(const json* copy_id, Find(j, "", "copy_id", /*required=*/false));
  if (copy_id != nullptr) {
    if (!copy_id->is_string() || !IsCopyId(copy_id->get_ref<const std::string&>())) {
      return Wrong("copy_id", *copy_id, "1 to 64 letters, digits and '-'");
    }
    r.copy_id = copy_id->get<std::string>();
  }

  JT_ASSIGN_OR_RETURN(const json* store, Find(j, "", "store", /*required=*/false));
  if (store != nullptr) {
    if (!store->is_boolean()) return Wrong("store", *store, "true or false");
    r.in_store = store->get<bool>();
  }
  return r;
}

StatusOr<WorkerError> DecodeWorkerError(std::string_view body) {
  JT_ASSIGN_OR_RETURN(json j, ParseObject(body));
  WorkerError e;
  JT_RETURN_IF_ERROR(ReadString(j, "", "message", /*required=*/false, &e.message));
  JT_RETURN_IF_ERROR(ReadString(j, "", "traceback", /*required=*/false, &e.traceback));
  JT_ASSIGN_OR_RETURN(const json* phase, Find(j, "", "phase", /*required=*/false));
  if (phase != nullptr) {
    bool known = false;
    for (ErrorPhase p : {ErrorPhase::kTraining, ErrorPhase::kStartUp, ErrorPhase::kStorage}) {
      if (phase->is_string() && phase->get_ref<const std::string&>() == ErrorPhaseName(p)) {
        e.phase = p;
        known = true;
      }
    }
    if (!known) return Wrong("phase", *phase, "\"training\", \"start-up\" or \"storage\"");
  }
  std::string status_code;
  JT_RETURN_IF_ERROR(ReadString(j, "", "status_code", /*required=*/false, &status_code));
  e.status_code = StatusCodeByName(status_code);
  return e;
}

StatusOr<Preemption> DecodePreemption(std::string_view body) {
  JT_ASSIGN_OR_RETURN(json j, ParseObject(body));
  Preemption p;
  JT_RETURN_IF_ERROR(ReadString(j, "", "source", /*required=*/false, &p.source));
  JT_RETURN_IF_ERROR(ReadUnsigned(j, "", "deadline_ms", /*required=*/false, &p.deadline_ms));
  JT_RETURN_IF_ERROR(ReadUnsigned(j, "", "calls", /*required=*/false, &p.calls));
  JT_RETURN_IF_ERROR(ReadUnsigned(j, "", "rounds", /*required=*/false, &p.rounds));
  return p;
}

StatusOr<Collective> DecodeCollective(std::string_view body) {
  Collective c;
  uint8_t kind = 0;
  Status framed = DecodeCollectiveBody(body, &c.sequence, &kind, &c.data);
  if (!framed.ok()) return InvalidArgumentError(framed.message());
  if (c.sequence == 0) return Wrong("sequence", c.sequence, "an integer from 1");
  if (kind != static_cast<uint8_t>(CollectiveKind::kBarrier) &&
      kind != static_cast<uint8_t>(CollectiveKind::kBroadcast)) {
    return Wrong("kind", kind, "1 (barrier) or 2 (broadcast_from_rank_zero)");
  }
  c.kind = static_cast<CollectiveKind>(kind);
  if (c.kind == CollectiveKind::kBarrier && !c.data.empty()) {
    return InvalidArgumentError("a barrier carries no data, but " + std::to_string(c.data.size()) +
                                " bytes came");
  }
  if (c.data.size() > kMaxCollectiveData) {
    return InvalidArgumentError("data is " + std::to_string(c.data.size()) +
                                " bytes, more than the limit of " +
                                std::to_string(kMaxCollectiveData));
  }
  return c;
}

StatusOr<Pong> DecodePong(std::string_view body) {
  Pong p;
  if (body.empty()) return p;
  JT_ASSIGN_OR_RETURN(json j, ParseObject(body));
  p.has_stacks = true;
  JT_RETURN_IF_ERROR(ReadString(j, "", "stacks", /*required=*/false, &p.stacks));
  JT_RETURN_IF_ERROR(ReadUnsigned(j, "", "thread", /*required=*/false, &p.thread));
  JT_RETURN_IF_ERROR(ReadString(j, "", "collective", /*required=*/false, &p.collective));
  JT_RETURN_IF_ERROR(ReadString(j, "", "error", /*required=*/false, &p.error));
  JT_ASSIGN_OR_RETURN(const json* settling, Find(j, "", "settling", /*required=*/false));
  if (settling != nullptr) {
    if (!settling->is_boolean()) return Wrong("settling", *settling, "true or false");
    p.settling = settling->get<bool>();
  }
  return p;
}

StatusOr<Done> DecodeDone(std::string_view body) {
  JT_ASSIGN_OR_RETURN(json j, ParseObject(body));
  Done d;
  JT_ASSIGN_OR_RETURN(const json* value, Find(j, "", "return_value", /*required=*/false));
  if (value == nullptr || value->is_null()) return d;
  const std::string allowed = "the hex digits of a pickled value of at most " +
                              std::to_string(kMaxReturnValueSize) + " bytes, or null";
  if (!value->is_string() ||
      value->get_ref<const std::string&>().size() > 2 * kMaxReturnValueSize) {
    return Wrong("return_value", *value, allowed);
  }
  StatusOr<std::string> bytes = FromHex(value->get_ref<const std::string&>());
  if (!bytes.ok()) return Wrong("return_value", *value, allowed);
  d.return_value = *std::move(bytes);
  return d;
}

// Wraps a decoder's error in what the message was.
template <typename Message = WorkerMessage, typename T>
StatusOr<Message> Typed(MessageType type, StatusOr<T> decoded) {
  if (!decoded.ok()) {
    return InvalidArgumentError("malformed message of type " +
                                std::to_string(static_cast<int>(type)) + " (" +
                                std::string(TypeName(type)) + "): " + decoded.status().message());
  }
  return Message(std::move(decoded).value());
}

Status UnexpectedType(MessageType type) {
  return InvalidArgumentError("unexpected message type " + std::to_string(static_cast<int>(type)));
}

json EncodeFileEntry(const storage::FileEntry& e) {
  json file = {{"path", e.path}, {"size", e.size}, {"crc32c", e.crc32c}, {"mode", e.mode}};
  if (!e.link.empty()) file["link"] = e.link;
  if (!e.sha256.empty()) file["sha256"] = e.sha256;
  return file;
}

struct Encoder {
  StatusOr<std::string> operator()(const Registration& r) const {
    json j = {{"host", r.host}, {"coordinator", r.coordinator}};
    if (r.pid != 0) j["pid"] = r.pid;
    return Dump(j);
  }
  StatusOr<std::string> operator()(const Report& r) const {
    return EncodeReportBody(r.round, r.metrics_json);
  }
  StatusOr<std::string> operator()(const CheckpointReport& r) const {
    json j = {{"files", json::array()}, {"dir_name", nullptr}};
    for (const storage::FileEntry& e : r.files) j["files"].push_back(EncodeFileEntry(e));
    if (r.dir_name) j["dir_name"] = *r.dir_name;
    if (!r.staging.empty()) j["staging"] = r.staging;
    if (!r.copy_id.empty()) j["copy_id"] = r.copy_id;
    if (r.in_store) j["store"] = true;
    return EncodeCheckpointReportBody(r.round, Dump(j), r.metrics_json);
  }
  StatusOr<std::string> operator()(const WorkerError& e) const {
    json j = {
        {"message", e.message}, {"traceback", e.traceback}, {"phase", ErrorPhaseName(e.phase)}};
    if (e.status_code != StatusCode::kUnknown) j["status_code"] = StatusCodeName(e.status_code);
    return Dump(j);
  }
  StatusOr<std::string> operator()(const Done& d) const {
    json j = json::object();
    if (d.return_value) j["return_value"] = ToHex(*d.return_value);
    return Dump(j);
  }
  // Every field that is set, so that what was decoded is encoded whole (a deadline without a
  // source included: the decoder takes it, and so it must survive a second pass).
  StatusOr<std::string> operator()(const Preemption& p) const {
    json j = json::object();
    if (!p.source.empty()) j["source"] = p.source;
    if (p.deadline_ms != 0) j["deadline_ms"] = p.deadline_ms;
    if (p.source.empty() || p.calls != 0 || p.rounds != 0) {
      j["calls"] = p.calls;
      j["rounds"] = p.rounds;
    }
    return Dump(j);
  }
  StatusOr<std::string> operator()(const Pong& p) const {
    if (!p.has_stacks) return std::string();
    json j = {{"stacks", p.stacks},
              {"thread", p.thread},
              {"collective", p.collective},
              {"settling", p.settling}};
    if (!p.error.empty()) j["error"] = p.error;
    return Dump(j);
  }
  StatusOr<std::string> operator()(const Collective& c) const {
    return EncodeCollectiveBody(c.sequence, static_cast<uint8_t>(c.kind), c.data);
  }
};

struct TypeOf {
  MessageType operator()(const Registration&) const { return MessageType::kRegister; }
  MessageType operator()(const Report&) const { return MessageType::kReport; }
  MessageType operator()(const CheckpointReport&) const { return MessageType::kReportCheckpoint; }
  MessageType operator()(const WorkerError&) const { return MessageType::kError; }
  MessageType operator()(const Done&) const { return MessageType::kDone; }
  MessageType operator()(const Preemption&) const { return MessageType::kPreemption; }
  MessageType operator()(const Collective&) const { return MessageType::kCollective; }
  MessageType operator()(const Pong&) const { return MessageType::kPong; }
};

}  // namespace

StatusOr<WorkerMessage> DecodeWorkerMessage(const FrameView& frame) {
  switch (frame.type) {
    case MessageType::kRegister: return Typed(frame.type, DecodeRegistration(frame.body));
    case MessageType::kReport: return Typed(frame.type, DecodeReport(frame.body));
    case MessageType::kReportCheckpoint:
      return Typed(frame.type, DecodeCheckpointReport(frame.body));
    case MessageType::kError: return Typed(frame.type, DecodeWorkerError(frame.body));
    case MessageType::kDone: return Typed(frame.type, DecodeDone(frame.body));
    case MessageType::kPreemption: return Typed(frame.type, DecodePreemption(frame.body));
    case MessageType::kCollective: return Typed(frame.type, DecodeCollective(frame.body));
    case MessageType::kPong: return Typed(frame.type, DecodePong(frame.body));
    default: return UnexpectedType(frame.type);
  }
}

StatusOr<Collective> DecodeCollectiveRelease(const FrameView& frame) {
  if (frame.type != MessageType::kCollectiveRelease) return UnexpectedType(frame.type);
  return Typed<Collective>(frame.type, DecodeCollective(frame.body));
}

std::string EncodeCollectiveRelease(const Collective& release) {
  return EncodeCollectiveBody(release.sequence, static_cast<uint8_t>(release.kind), release.data);
}

std::string_view CollectiveKindName(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kBarrier: return "barrier()";
    case CollectiveKind::kBroadcast: return "broadcast_from_rank_zero()";
  }
  return "barrier()";
}

MessageType WorkerMessageType(const WorkerMessage& message) {
  return std::visit(TypeOf{}, message);
}

StatusOr<std::string> EncodeWorkerMessage(const WorkerMessage& message) {
  return std::visit(Encoder{}, message);
}

bool IsCopyId(std::string_view id) {
  return !id.empty() && id.size() <= kMaxCopyIdSize &&
         std::all_of(id.begin(), id.end(), [](char c) {
           return std::isalnum(static_cast<unsigned char>(c)) || c == '-';
         });
}

StatusCode StatusCodeByName(std::string_view name) {
  for (int c = 1; c <= static_cast<int>(StatusCode::kUnauthenticated); ++c) {
    if (StatusCodeName(static_cast<StatusCode>(c)) == name) return static_cast<StatusCode>(c);
  }
  return StatusCode::kUnknown;
}

std::string_view ErrorPhaseName(ErrorPhase phase) {
  switch (phase) {
    case ErrorPhase::kTraining: return "training";
    case ErrorPhase::kStartUp: return "start-up";
    case ErrorPhase::kStorage: return "storage";
  }
  return "training";
}

}  // namespace jaxtrain::wire
