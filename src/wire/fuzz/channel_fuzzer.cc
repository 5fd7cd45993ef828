// Fuzzes what the secure channel (channel.h) parses from a peer that has proven nothing, and from
// one that has: an open as the responder reads it, an answer as the initiator reads it, and a
// record as either end opens it. Each answer is checked against a reference written here.
//
// Input: a first byte choosing the part (0: open, 1: answer, 2: record), then the bytes that part
// reads. corpus/channel (from make_corpus.cc) holds a valid open, accept and record made with the
// fixed secret and nonce of fuzz_support.h, so the accepting branches are reached too.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "wire/channel.h"
#include "wire/fuzz/fuzz_support.h"

namespace jaxtrain::wire::fuzz {
namespace {

std::string_view View(const Mac& mac) {
  return {reinterpret_cast<const char*>(mac.data()), mac.size()};
}

// The reference for an open: answered (accepted or refused with a checkable reason) exactly when
// its last 32 bytes are the MAC the secret gives the rest and the rest is framed as an open.
void CheckOpen(std::string_view open) {
  ChannelResponder responder(FixedSecret(), "jaxtrain-join", "host-0");
  Status checked = responder.OnOpen(open);
  bool mac_ok =
      open.size() >= kMacSize &&
      View(Hmac(FixedSecret(),
                "jaxtrain-channel-open" + std::string(open.substr(0, open.size() - kMacSize)))) ==
          open.substr(open.size() - kMacSize);
  if (checked.ok() || checked.code() == StatusCode::kPermissionDenied) {
    JT_FUZZ_CHECK(mac_ok);
    JT_FUZZ_CHECK(open.substr(0, 4) == "JXCH");
    std::string refusal = responder.Refuse(checked.message());
    JT_FUZZ_CHECK(refusal[0] == 'R');
  } else {
    JT_FUZZ_CHECK(checked.code() == StatusCode::kUnauthenticated);
  }
  if (checked.ok()) {
    JT_FUZZ_CHECK(!responder.initiator().empty());
    std::string accept = responder.Accept();
    Session session;
    // A confirm is accepted only when made with the secret for this open and accept.
    JT_FUZZ_CHECK(
        !responder.OnConfirm(open.substr(0, kMacSize), &session).ok() ||
        open.substr(0, kMacSize) ==
            View(Hmac(FixedSecret(), "jaxtrain-channel-confirm" + std::string(open) + accept)));
  }
}

// An answer to the fixed open: a session only from an accept made with the secret.
void CheckAnswer(std::string_view answer) {
  ChannelInitiator initiator(FixedSecret(), FixedEnds(), FixedChannelNonce());
  std::string open = initiator.Open().value();
  Session session;
  StatusOr<std::string> confirm = initiator.OnAnswer(answer, &session);
  if (confirm.ok()) {
    JT_FUZZ_CHECK(answer.size() == 1 + kNonceSize + kMacSize && answer[0] == 'A');
    std::string signed_part(answer.substr(0, 1 + kNonceSize));
    JT_FUZZ_CHECK(View(Hmac(FixedSecret(), "jaxtrain-channel-accept" + open + signed_part)) ==
                  answer.substr(1 + kNonceSize));
  } else {
    StatusCode code = confirm.status().code();
    JT_FUZZ_CHECK(code == StatusCode::kPermissionDenied || code == StatusCode::kUnauthenticated ||
                  code == StatusCode::kDataLoss);
  }
}

// A record under the fixed keys: opened only when it is exactly what the other end seals as its
// first record.
void CheckRecord(std::string_view sealed) {
  Session receiver(FixedKey(2), FixedKey(1));
  StatusOr<std::string> plaintext = receiver.Open(sealed);
  if (plaintext.ok()) {
    Session sender(FixedKey(1), FixedKey(2));
    JT_FUZZ_CHECK(sender.Seal(*plaintext).value().substr(4) == sealed);
  } else {
    JT_FUZZ_CHECK(plaintext.status().code() == StatusCode::kUnauthenticated);
    JT_FUZZ_CHECK(!receiver.Open(sealed).ok());  // a failed session stays failed
  }
}

void Run(std::string_view input) {
  if (input.empty()) return;
  std::string_view data = input.substr(1);
  switch (static_cast<uint8_t>(input[0]) % 3) {
    case 0: CheckOpen(data); break;
    case 1: CheckAnswer(data); break;
    default: CheckRecord(data); break;
  }
}

}  // namespace
}  // namespace jaxtrain::wire::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  jaxtrain::wire::fuzz::Run(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
