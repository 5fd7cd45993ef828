// Metrics as workers send them: the JSON text of Python's json.dumps, which may contain NaN,
// Infinity and -Infinity. Thread-safe (pure functions).
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace jaxtrain::storage {

// Parses metrics; the non-finite tokens become the strings "NaN", "Infinity", "-Infinity".
// Returns a discarded value (is_discarded()) when the text is not JSON.
nlohmann::json ParseMetricsJson(std::string_view text);

// The number at `key` in `metrics` (nested keys joined with '/'), if there is one.
std::optional<double> MetricValue(const nlohmann::json& metrics, const std::string& key);

}  // namespace jaxtrain::storage
