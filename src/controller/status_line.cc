#include "controller/status_line.h"

#include <cstdio>
#include <nlohmann/json.hpp>

namespace jaxtrain::controller {
namespace {

std::string Number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.4g", v);
  return buf;
}

std::string Metrics(const std::string& json) {
  auto metrics = nlohmann::ordered_json::parse(json, nullptr, false);  // in reported order
  if (!metrics.is_object()) return "";
  std::string out;
  for (const auto& [key, value] : metrics.items()) {
    std::string text;
    if (value.is_number_float()) {
      text = Number(value.get<double>());
    } else if (value.is_number() || value.is_boolean()) {
      text = value.dump();
    } else if (value.is_string()) {
      text = value.get<std::string>();
    } else {
      continue;  // nested values stay in the run directory
    }
    out += (out.empty() ? "" : " ") + key + "=" + text;
  }
  return out;
}

}  // namespace

std::string FormatStatus(const StatusView& view, size_t width) {
  std::string line = "[jaxtrain] attempt " + std::to_string(view.attempt) + " | " +
                     std::to_string(view.ranks_up) + "/" + std::to_string(view.world_size) +
                     " ranks up";
  if (!view.stragglers.empty()) {
    line += view.stragglers.size() == 1 ? " | straggler: rank " : " | stragglers: ranks ";
    for (size_t i = 0; i < view.stragglers.size(); ++i) {
      line += (i ? "," : "") + std::to_string(view.stragglers[i]);
    }
  }
  if (view.round > 0) {
    line += " | round " + std::to_string(view.round);
    if (std::string m = Metrics(view.metrics_json); !m.empty()) line += " | " + m;
  }
  if (view.rounds_per_s > 0) line += " | " + Number(view.rounds_per_s) + " rounds/s";
  if (line.size() > width) line = width > 3 ? line.substr(0, width - 3) + "..." : "";
  return line;
}

}  // namespace jaxtrain::controller
