#include "controller/rank_stacks.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace jaxtrain::controller {
namespace {

constexpr std::string_view kFileStart = "  File \"";

// The standard library's own frames (threading's waits, queue.get) say little of where a rank
// is: the frame that called them does.
bool InStandardLibrary(const std::string& file) {
  if (file.starts_with("<frozen ")) return true;
  return file.find("/lib/python3") != std::string::npos &&
         file.find("-packages/") == std::string::npos;
}

bool InJax(const std::string& file) {
  return file.find("/jax/") != std::string::npos || file.find("/jaxlib/") != std::string::npos;
}

std::string Short(const StackFrame& f) {
  const size_t slash = f.file.rfind('/');
  return (slash == std::string::npos ? f.file : f.file.substr(slash + 1)) + ":" +
         std::to_string(f.line) + " in " + f.function;
}

// The index of the innermost frame outside the standard library, or of the innermost frame when
// every frame is in it; frames.size() when there are none.
size_t FirstOwnFrame(const std::vector<StackFrame>& frames) {
  for (size_t i = 0; i < frames.size(); ++i) {
    if (!InStandardLibrary(frames[i].file)) return i;
  }
  return 0;
}

std::vector<StackFrame> Frames(const RankStacks& r) {
  return r.pong.has_stacks ? ThreadFrames(r.pong.stacks, r.pong.thread) : std::vector<StackFrame>();
}

// "0, 1 on host1; 2 on host2", the ranks in the order given.
std::string Named(const std::vector<const RankStacks*>& rs) {
  std::vector<std::pair<std::string, std::string>> by_host;
  for (const RankStacks* r : rs) {
    auto at = std::find_if(by_host.begin(), by_host.end(),
                           [&](const auto& h) { return h.first == r->host; });
    if (at == by_host.end()) at = by_host.insert(by_host.end(), {r->host, ""});
    at->second += (at->second.empty() ? "" : ", ") + std::to_string(r->rank);
  }
  std::string out;
  for (const auto& [host, names] : by_host) {
    out += (out.empty() ? "" : "; ") + names + (host.empty() ? "" : " on " + host);
  }
  return out;
}

std::string EachWhere(const std::vector<const RankStacks*>& rs) {
  std::string out;
  for (const RankStacks* r : rs) {
    out += (out.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r->rank) + " " +
           DescribeWhere(*r);
  }
  return out;
}

Behind Make(const std::vector<const RankStacks*>& behind, std::string why) {
  Behind b{.why = std::move(why)};
  for (const RankStacks* r : behind) b.ranks.push_back(r->rank);
  std::sort(b.ranks.begin(), b.ranks.end());
  return b;
}

}  // namespace

std::vector<StackFrame> ThreadFrames(std::string_view dump, uint64_t thread) {
  std::vector<StackFrame> frames;
  bool in_thread = false;
  size_t at = 0;
  while (at < dump.size()) {
    size_t end = dump.find('\n', at);
    if (end == std::string_view::npos) end = dump.size();
    const std::string_view line = dump.substr(at, end - at);
    at = end + 1;
    size_t hex = std::string_view::npos;
    if (line.starts_with("Thread 0x")) hex = 9;
    if (line.starts_with("Current thread 0x")) hex = 17;
    if (hex != std::string_view::npos) {
      if (in_thread) break;
      const std::string digits(line.substr(hex, line.find(' ', hex) - hex));
      in_thread = std::strtoull(digits.c_str(), nullptr, 16) == thread;
      continue;
    }
    if (!in_thread || !line.starts_with(kFileStart)) continue;
    // `  File "<file>", line <n> in <function>`; a file name may hold '"', so the last one ends it.
    const size_t quote = line.rfind("\", line ");
    if (quote == std::string_view::npos || quote < kFileStart.size()) continue;
    StackFrame f{.file = std::string(line.substr(kFileStart.size(), quote - kFileStart.size()))};
    const std::string_view rest = line.substr(quote + 8);
    f.line = std::atoi(std::string(rest.substr(0, rest.find(' '))).c_str());
    const size_t in = rest.find(" in ");
    if (in != std::string_view::npos) f.function = std::string(rest.substr(in + 4));
    frames.push_back(std::move(f));
  }
  return frames;
}

bool Waits(const RankStacks& r) {
  if (!r.pong.collective.empty() || r.pong.settling) return true;
  const std::vector<StackFrame> frames = Frames(r);
  return !frames.empty() && InJax(frames[FirstOwnFrame(frames)].file);
}

std::string DescribeWhere(const RankStacks& r) {
  if (!r.pong.has_stacks || r.pong.stacks.empty()) {
    return "(no stacks: " + (r.pong.error.empty() ? "its worker cannot take them" : r.pong.error) +
           ")";
  }
  if (!r.pong.collective.empty()) return "in " + r.pong.collective + " (a jaxtrain collective)";
  if (r.pong.settling) return "in report(), waiting for the commit of its last checkpoint";
  const std::vector<StackFrame> frames = Frames(r);
  if (frames.empty()) return "(its training thread is not in its stacks)";
  const size_t first = FirstOwnFrame(frames);
  if (InJax(frames[first].file)) {
    // The outermost frame of JAX's, and the caller's own frame that called it.
    size_t api = first;
    while (api + 1 < frames.size() &&
           (InJax(frames[api + 1].file) || InStandardLibrary(frames[api + 1].file))) {
      ++api;
    }
    while (api > first && !InJax(frames[api].file)) --api;
    std::string out = "in JAX at " + Short(frames[api]);
    if (api + 1 < frames.size()) out += ", called from " + Short(frames[api + 1]);
    return out;
  }
  std::string out = "at " + Short(frames[first]);
  if (first > 0) out += " (" + Short(frames[0]) + ")";
  return out;
}

std::optional<Behind> FindBehind(const std::vector<RankStacks>& ranks) {
  if (ranks.size() < 2) return std::nullopt;
  // A rank that made fewer report() calls than the others has not reached where they are.
  uint64_t fewest = UINT64_MAX, most = 0;
  for (const RankStacks& r : ranks) {
    fewest = std::min(fewest, r.reports);
    most = std::max(most, r.reports);
  }
  if (fewest < most) {
    std::vector<const RankStacks*> behind;
    for (const RankStacks& r : ranks) {
      if (r.reports == fewest) behind.push_back(&r);
    }
    return Make(behind, "rank(s) " + Named(behind) + " made " + std::to_string(fewest) +
                            " report() call(s) in this attempt, the others up to " +
                            std::to_string(most) + " (" + EachWhere(behind) + ")");
  }
  std::vector<const RankStacks*> waiting, elsewhere;
  for (const RankStacks& r : ranks) {
    if (!r.pong.has_stacks) continue;
    (Waits(r) ? waiting : elsewhere).push_back(&r);
  }
  if (waiting.empty() || elsewhere.empty()) return std::nullopt;
  return Make(elsewhere, "rank(s) " + Named(elsewhere) + " are not in a collective (" +
                             EachWhere(elsewhere) + ") while rank(s) " + Named(waiting) +
                             " wait in one (" + EachWhere(waiting) + ")");
}

std::string StacksFileText(const RankStacks& r, int attempt) {
  std::string out = "# rank " + std::to_string(r.rank) + (r.host.empty() ? "" : " on " + r.host) +
                    ", attempt " + std::to_string(attempt) + "\n";
  out += "# report() calls in this attempt: " + std::to_string(r.reports) + "\n";
  out +=
      "# jaxtrain collective: " + (r.pong.collective.empty() ? "none" : r.pong.collective) + "\n";
  out += std::string("# waiting for a checkpoint's commit: ") + (r.pong.settling ? "yes" : "no") +
         "\n";
  if (r.pong.has_stacks) {
    char thread[32];
    std::snprintf(thread, sizeof(thread), "0x%016llx",
                  static_cast<unsigned long long>(r.pong.thread));
    out += std::string("# training thread: Thread ") + thread + "\n";
  }
  out += "# where: " + DescribeWhere(r) + "\n\n";
  out += r.pong.stacks;
  return out;
}

}  // namespace jaxtrain::controller
