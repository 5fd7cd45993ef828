#include "controller/collective.h"

#include "base/strings.h"

namespace jaxtrain::controller {
namespace {

constexpr size_t kRanksNamed = 8;  // how many ranks a message names before it counts them

constexpr std::string_view kSameCalls =
    "every rank must make the same jaxtrain.collective calls in the same order";

}  // namespace

std::string RankList(const std::vector<int>& ranks) {
  std::vector<std::string> names;
  for (size_t i = 0; i < ranks.size() && i < kRanksNamed; ++i) {
    names.push_back(std::to_string(ranks[i]));
  }
  std::string out = (ranks.size() == 1 ? "rank " : "ranks ") + Join(names, ", ");
  if (ranks.size() > kRanksNamed) out += ", ... (" + std::to_string(ranks.size()) + " ranks)";
  return out;
}

Collectives::Collectives(int world_size)
    : world_size_(world_size), arrived_(static_cast<size_t>(world_size)) {}

std::string Collectives::CallName(wire::CollectiveKind kind) const {
  return std::string(wire::CollectiveKindName(kind)) + " (collective call " +
         std::to_string(next_) + ")";
}

std::vector<int> Collectives::Ranks(bool arrived) const {
  std::vector<int> out;
  for (int r = 0; r < world_size_; ++r) {
    if (arrived_[static_cast<size_t>(r)] == arrived) out.push_back(r);
  }
  return out;
}

StatusOr<std::optional<Collectives::Release>> Collectives::Arrive(int rank,
                                                                  const wire::Collective& call,
                                                                  TimePoint now) {
  if (call.sequence != next_ || arrived_[static_cast<size_t>(rank)]) {
    return InvalidArgumentError("rank " + std::to_string(rank) + " made collective call " +
                                std::to_string(call.sequence) + " while call " +
                                std::to_string(next_) + " was pending" +
                                (call.sequence == next_ ? ", which it had made already" : ""));
  }
  if (returned_ >= 0) {
    return FailedPreconditionError(
        "rank " + std::to_string(rank) + " called " + CallName(call.kind) + " after rank " +
        std::to_string(returned_) + "'s training function had returned without making it; " +
        std::string(kSameCalls));
  }
  if (arrivals_ > 0 && call.kind != kind_) {
    return FailedPreconditionError(
        "the ranks made different collective calls as their call " + std::to_string(next_) + ": " +
        RankList(Ranks(true)) + " called " + std::string(wire::CollectiveKindName(kind_)) +
        ", rank " + std::to_string(rank) + " called " +
        std::string(wire::CollectiveKindName(call.kind)) + "; " + std::string(kSameCalls));
  }
  if (arrivals_ == 0) {
    kind_ = call.kind;
    first_arrival_ = now;
  }
  arrived_[static_cast<size_t>(rank)] = true;
  ++arrivals_;
  if (rank == 0 && call.kind == wire::CollectiveKind::kBroadcast) data_ = call.data;
  if (arrivals_ < world_size_) return std::optional<Release>();

  Release release{.sequence = next_, .kind = kind_, .data = std::move(data_)};
  ++next_;
  arrived_.assign(arrived_.size(), false);
  arrivals_ = 0;
  data_.clear();
  warnings_ = 0;
  return std::optional<Release>(std::move(release));
}

Status Collectives::Done(int rank) {
  if (returned_ < 0) returned_ = rank;
  if (arrivals_ == 0) return OkStatus();
  return FailedPreconditionError("rank " + std::to_string(rank) +
                                 "'s training function returned without calling " +
                                 CallName(kind_) + "; waiting in it: " + RankList(Ranks(true)) +
                                 "; " + std::string(kSameCalls));
}

std::optional<TimePoint> Collectives::NextWarning() const {
  if (arrivals_ == 0) return std::nullopt;
  return first_arrival_ + kWarnInterval * (warnings_ + 1);
}

std::string Collectives::TakeWarning(TimePoint now) {
  std::optional<TimePoint> due = NextWarning();
  if (!due || now < *due) return "";
  ++warnings_;
  const auto waited = std::chrono::duration_cast<std::chrono::seconds>(now - first_arrival_);
  const std::vector<int> waiting = Ranks(true);
  return RankList(waiting) + (waiting.size() == 1 ? " has" : " have") + " waited " +
         std::to_string(waited.count()) + " s in " + CallName(kind_) + " for " +
         RankList(Ranks(false)) + " to make it; " + std::string(kSameCalls) + " (said every " +
         std::to_string(std::chrono::duration_cast<std::chrono::seconds>(kWarnInterval).count()) +
         " s while they wait)";
}

}  // namespace jaxtrain::controller
