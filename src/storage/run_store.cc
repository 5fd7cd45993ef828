#include "storage/run_store.h"

#include <unistd.h>

#include <sstream>

#include "storage/files.h"

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

// Python's json writes NaN, Infinity and -Infinity for non-finite floats; strict JSON has no such
// tokens. Outside string literals they become the strings "NaN", "Infinity", "-Infinity".
std::string QuoteNonFinite(std::string_view json) {
  std::string out;
  out.reserve(json.size());
  bool in_string = false;
  for (size_t i = 0; i < json.size(); ++i) {
    char c = json[i];
    if (in_string) {
      out.push_back(c);
      if (c == '\\' && i + 1 < json.size()) {
        out.push_back(json[++i]);
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    bool replaced = false;
    for (std::string_view token : {"-Infinity", "Infinity", "NaN"}) {
      if (json.substr(i, token.size()) == token) {
        out += "\"" + std::string(token) + "\"";
        i += token.size() - 1;
        replaced = true;
        break;
      }
    }
    if (replaced) continue;
    if (c == '"') in_string = true;
    out.push_back(c);
  }
  return out;
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

std::string RunStore::LogPath(int rank) const {
  return JoinPath(dir_, "logs/rank-" + std::to_string(rank) + ".log");
}

Status RunStore::WriteRunState(const nlohmann::json& state) {
  return WriteFileAtomically(JoinPath(dir_, "run.json"), state.dump(2) + "\n");
}

Status RunStore::AppendRound(uint64_t round, double unix_time, std::string_view metrics_json) {
  nlohmann::json metrics =
      nlohmann::json::parse(QuoteNonFinite(metrics_json), nullptr, /*allow_exceptions=*/false);
  if (!metrics.is_object()) {
    return InvalidArgumentError("report() metrics must be a dict; got: " +
                                std::string(metrics_json.substr(0, 200)));
  }
  std::ostringstream line;
  line.precision(17);
  line << "{\"round\":" << round << ",\"time\":" << unix_time << ",\"metrics\":" << metrics_json
       << "}\n";
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
