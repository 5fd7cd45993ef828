// Fuzzes DecodeWorkerMessage (messages.h), the controller's decode of every frame an authenticated
// worker sends: any type byte, any body. An answer is either a message of the frame's type or
// kInvalidArgument saying which of the two kinds of refusal it is; a message decoded survives
// EncodeWorkerMessage and a second decode unchanged, its encoding is canonical (encoding the
// second decode gives the same bytes), its views point into the body, and a copy_id it carries
// is one IsCopyId accepts.
//
// Input: byte 0 is the frame's type, the rest its body. corpus/messages (from make_corpus.cc)
// holds each message as the Python worker sends it, so every field's decode is reached.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <variant>

#include "wire/fuzz/fuzz_support.h"
#include "wire/messages.h"

namespace jaxtrain::wire::fuzz {
namespace {

bool StartsWith(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

// Whether `view` lies within `body` (or is empty).
bool Within(std::string_view view, std::string_view body) {
  return view.empty() ||
         (view.data() >= body.data() && view.data() + view.size() <= body.data() + body.size());
}

void CheckViews(const WorkerMessage& m, std::string_view body) {
  if (const auto* r = std::get_if<Report>(&m)) JT_FUZZ_CHECK(Within(r->metrics_json, body));
  if (const auto* c = std::get_if<CheckpointReport>(&m)) {
    JT_FUZZ_CHECK(Within(c->metrics_json, body));
    JT_FUZZ_CHECK(c->copy_id.empty() || IsCopyId(c->copy_id));
  }
  if (const auto* c = std::get_if<Collective>(&m)) {
    JT_FUZZ_CHECK(Within(c->data, body));
    JT_FUZZ_CHECK(c->sequence > 0 && c->data.size() <= kMaxCollectiveData);
  }
}

void Run(MessageType type, std::string_view body) {
  StatusOr<WorkerMessage> decoded = DecodeWorkerMessage({type, body});
  if (!decoded.ok()) {
    JT_FUZZ_CHECK(decoded.status().code() == StatusCode::kInvalidArgument);
    const std::string& what = decoded.status().message();
    JT_FUZZ_CHECK(StartsWith(what, "malformed message of type ") ||
                  StartsWith(what, "unexpected message type "));
    return;
  }
  JT_FUZZ_CHECK(WorkerMessageType(*decoded) == type);
  CheckViews(*decoded, body);

  StatusOr<std::string> encoded = EncodeWorkerMessage(*decoded);
  JT_FUZZ_CHECK(encoded.ok());
  StatusOr<WorkerMessage> again = DecodeWorkerMessage({type, *encoded});
  JT_FUZZ_CHECK(again.ok());
  JT_FUZZ_CHECK(*again == *decoded);
  CheckViews(*again, *encoded);
  StatusOr<std::string> reencoded = EncodeWorkerMessage(*again);
  JT_FUZZ_CHECK(reencoded.ok() && *reencoded == *encoded);
}

}  // namespace
}  // namespace jaxtrain::wire::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  // An exact-size heap copy of the body, so AddressSanitizer sees any read past it.
  std::unique_ptr<char[]> body(new char[size - 1]);
  if (size > 1) std::memcpy(body.get(), data + 1, size - 1);
  jaxtrain::wire::fuzz::Run(static_cast<jaxtrain::wire::MessageType>(data[0]),
                            std::string_view(body.get(), size - 1));
  return 0;
}
