#include "controller/run_record.h"

#include <unistd.h>

#include <cerrno>

#include "storage/files.h"

namespace jaxtrain::controller {
namespace {

// Rank 0's pickled return value in the run directory (Result.return_value reads it).
constexpr char kReturnValueFile[] = "return_value.pkl";

}  // namespace

std::string HostName() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return host;
}

RankFailure StorageFailure(const Status& why, std::string message) {
  return {.rank = -1,
          .host = HostName(),
          .cause = FailureCause::kStorage,
          .status_code = why.code(),
          .message = std::move(message)};
}

nlohmann::json FailureJson(const RankFailure& f) {
  nlohmann::json j = {{"rank", f.rank},
                      {"host", f.host},
                      {"cause", FailureCauseName(f.cause)},
                      {"message", f.message},
                      {"exit_code", f.exit_code >= 0 ? nlohmann::json(f.exit_code) : nullptr},
                      {"signal", f.signal != 0 ? nlohmann::json(f.signal) : nullptr}};
  if (f.status_code != StatusCode::kOk) j["status_code"] = StatusCodeName(f.status_code);
  if (!f.preemption.is_null()) j["preemption"] = f.preemption;
  if (!f.stacks_dir.empty()) j["stacks"] = f.stacks_dir;
  if (!f.decision.empty()) {
    j["decision"] = {{"action", f.retried ? "retry" : "raise"}, {"reason", f.decision}};
  }
  return j;
}

RunRecord::RunRecord(storage::RunStore& store, const ControllerOptions& opts, const Clock& clock)
    : store_(store), opts_(opts), clock_(clock), start_time_(clock.UnixSeconds()) {}

int RunRecord::Resume() {
  nlohmann::json previous = store_.PreviousRunState();
  if (!previous.is_object() || !previous.contains("attempts") || !previous["attempts"].is_array()) {
    return 0;
  }
  attempts_ = previous["attempts"];
  for (auto& a : attempts_) {
    if (!a.is_object() || a.value("status", "") != "RUNNING") continue;
    const std::string& who = store_.previous_holder();
    a["status"] = "CRASHED";
    a["failure"] = {{"rank", -1},
                    {"host", ""},
                    {"cause", FailureCauseName(FailureCause::kDriver)},
                    {"message", "its driver (" + (who.empty() ? "unknown" : who) +
                                    ") ended without recording how the attempt ended"}};
  }
  return static_cast<int>(attempts_.size());
}

Status RunRecord::Write(std::string_view status, uint64_t rounds, const nlohmann::json& running) {
  written_ = clock_.Now();
  nlohmann::json attempts = attempts_;
  if (!running.is_null()) attempts.push_back(running);
  nlohmann::json state = {{"name", opts_.experiment_name},
                          {"status", status},
                          {"world_size", opts_.plan.workers.size()},
                          {"platform", opts_.plan.platform},
                          {"simulated", opts_.plan.simulated},
                          {"start_time", start_time_},
                          {"queue_wait_s", opts_.queue_wait_s},
                          {"rounds", rounds},
                          {"attempts", attempts},
                          {"config", opts_.run_config}};
  if (status != "RUNNING") state["end_time"] = clock_.UnixSeconds();
  if (resizes_) state["resizes"] = *resizes_;
  JT_RETURN_IF_ERROR(store_.WriteRunState(state));
  state_ = std::move(state);
  return OkStatus();
}

Status RunRecord::WriteReturnValue(const std::optional<std::string>& value) {
  const std::string path = storage::JoinPath(store_.dir(), kReturnValueFile);
  if (value) {
    JT_RETURN_IF_ERROR(storage::WriteFileAtomically(path, *value));
  } else if (unlink(path.c_str()) != 0 && errno != ENOENT) {
    return storage::PathError("cannot remove", path, errno);
  }
  return_value_ = value;
  return OkStatus();
}

Status RunRecord::WriteError(const std::vector<RankFailure>& failures) {
  std::string text;
  for (const auto& f : failures) {
    text += "attempt " + std::to_string(f.attempt) + ": rank " + std::to_string(f.rank) +
            " (host " + f.host + "), " + std::string(FailureCauseName(f.cause)) + ": " + f.message +
            "\n";
  }
  if (failures.empty()) return store_.WriteError(text);
  const RankFailure& first = failures.front();
  if (!first.traceback.empty()) text += "\n" + first.traceback;
  if (!first.log_path.empty()) {
    text += "\n--- last lines of " + first.log_path + " ---\n" + first.log_tail;
  }
  return store_.WriteError(text);
}

}  // namespace jaxtrain::controller
