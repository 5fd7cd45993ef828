#include "storage/run_store.h"

#include <unistd.h>

#include <sstream>

#include "storage/files.h"
#include "storage/metrics.h"

namespace jaxtrain::storage {
namespace {

void Flatten(const nlohmann::json& j, const std::string& prefix,
             std::vector<std::pair<std::string, std::string>>* out) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    std::string key = prefix.empty() ? it.key() : prefix + "/" + it.key();
    if (it->is_object()) {
      Flatten(*it, key, out);
    } else if (it->is_string()) {
      out->emplace_back(key, it->get<std::string>());
    } else {
      out->emplace_back(key, it->dump());
    }
  }
}

std::string CsvField(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

}  // namespace

StatusOr<RunStore> RunStore::Open(std::string run_dir) {
  JT_RETURN_IF_ERROR(MakeDirs(JoinPath(run_dir, "logs")));
  if (access(run_dir.c_str(), W_OK) != 0) {
    return PermissionDeniedError("cannot write to the run directory '" + run_dir +
                                 "'; choose a RunConfig.storage_path you can write to");
  }
  RunStore store(std::move(run_dir));
  // A resumed run keeps the columns progress.csv already has.
  auto csv = ReadFile(JoinPath(store.dir_, "progress.csv"));
  if (csv.ok() && !csv->empty()) {
    std::istringstream header(csv->substr(0, csv->find('\n')));
    for (std::string col; std::getline(header, col, ',');) store.csv_columns_.push_back(col);
  }
  return store;
}

uint64_t RunStore::LastRound() const {
  std::string tail = TailOfFile(JoinPath(dir_, "result.jsonl"), 1 << 16);
  // The last whole line; a torn one (a crash mid-append) is not a round.
  while (!tail.empty()) {
    size_t end = tail.find_last_not_of('\n');
    if (end == std::string::npos) break;
    tail.resize(end + 1);
    size_t start = tail.rfind('\n');
    auto line = nlohmann::json::parse(tail.substr(start == std::string::npos ? 0 : start + 1),
                                      nullptr, false);
    if (line.is_object() && line.contains("round")) return line["round"].get<uint64_t>();
    tail.resize(start == std::string::npos ? 0 : start);
  }
  return 0;
}

nlohmann::json RunStore::PreviousRunState() const {
  auto text = ReadFile(JoinPath(dir_, "run.json"));
  if (!text.ok()) return nullptr;
  auto state = nlohmann::json::parse(*text, nullptr, false);
  return state.is_object() ? state : nullptr;
}

Status RunStore::AppendToLogs(int world_size, std::string_view line) const {
  for (int r = 0; r < world_size; ++r) JT_RETURN_IF_ERROR(AppendToFile(LogPath(r), line));
  return OkStatus();
}

std::string RunStore::LogPath(int rank) const {
  return JoinPath(dir_, "logs/rank-" + std::to_string(rank) + ".log");
}

Status RunStore::WriteRunState(const nlohmann::json& state) {
  return WriteFileAtomically(JoinPath(dir_, "run.json"), state.dump(2) + "\n");
}

Status RunStore::AppendRound(uint64_t round, double unix_time, std::string_view metrics_json,
                             std::string_view checkpoint_dir_name) {
  nlohmann::json metrics = ParseMetricsJson(metrics_json);
  if (!metrics.is_object()) {
    return InvalidArgumentError("report() metrics must be a dict; got: " +
                                std::string(metrics_json.substr(0, 200)));
  }
  std::ostringstream line;
  line.precision(17);
  line << "{\"round\":" << round << ",\"time\":" << unix_time << ",\"metrics\":" << metrics_json;
  if (!checkpoint_dir_name.empty()) {
    line << ",\"checkpoint\":" << nlohmann::json(std::string(checkpoint_dir_name)).dump();
  }
  line << "}\n";
  JT_RETURN_IF_ERROR(AppendToFile(JoinPath(dir_, "result.jsonl"), line.str()));

  std::vector<std::pair<std::string, std::string>> flat;
  Flatten(metrics, "", &flat);
  std::string csv;
  if (csv_columns_.empty()) {
    csv_columns_ = {"round", "time"};
    for (const auto& [k, v] : flat) csv_columns_.push_back(k);
    for (size_t i = 0; i < csv_columns_.size(); ++i) {
      csv += (i ? "," : "") + CsvField(csv_columns_[i]);
    }
    csv += "\n";
  }
  std::ostringstream time_text;
  time_text.precision(17);
  time_text << unix_time;
  for (size_t i = 0; i < csv_columns_.size(); ++i) {
    std::string value;
    if (csv_columns_[i] == "round") {
      value = std::to_string(round);
    } else if (csv_columns_[i] == "time") {
      value = time_text.str();
    } else {
      for (const auto& [k, v] : flat) {
        if (k == csv_columns_[i]) value = v;
      }
    }
    csv += (i ? "," : "") + CsvField(value);
  }
  csv += "\n";
  return AppendToFile(JoinPath(dir_, "progress.csv"), csv);
}

Status RunStore::WriteError(std::string_view text) {
  return WriteFileAtomically(JoinPath(dir_, "error.txt"), text);
}

}  // namespace jaxtrain::storage
