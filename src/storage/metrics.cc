#include "storage/metrics.h"

#include <cmath>
#include <limits>

namespace jaxtrain::storage {

nlohmann::json ParseMetricsJson(std::string_view json) {
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
  return nlohmann::json::parse(out, nullptr, /*allow_exceptions=*/false);
}

std::optional<double> MetricValue(const nlohmann::json& metrics, const std::string& key) {
  // At each level the rest of the key may itself be a key ("acc/top5"); that match wins over
  // descending into "acc".
  const nlohmann::json* node = &metrics;
  size_t start = 0;
  for (;;) {
    if (!node->is_object()) return std::nullopt;
    auto whole = node->find(key.substr(start));
    if (whole != node->end()) {
      node = &*whole;
      break;
    }
    size_t slash = key.find('/', start);
    if (slash == std::string::npos) return std::nullopt;
    auto part = node->find(key.substr(start, slash - start));
    if (part == node->end()) return std::nullopt;
    node = &*part;
    start = slash + 1;
  }
  if (node->is_number()) return node->get<double>();
  if (node->is_string()) {
    const auto& s = node->get_ref<const std::string&>();
    if (s == "NaN") return std::numeric_limits<double>::quiet_NaN();
    if (s == "Infinity") return std::numeric_limits<double>::infinity();
    if (s == "-Infinity") return -std::numeric_limits<double>::infinity();
  }
  return std::nullopt;
}

}  // namespace jaxtrain::storage
