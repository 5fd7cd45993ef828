// Small string helpers shared by the engine's parsers and messages.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace jaxtrain {

// `text` without leading and trailing whitespace (spaces, tabs, CR, LF, ...).
std::string Trim(std::string_view text);

// The items joined by `separator`: Join({"a", "b"}, ", ") == "a, b".
std::string Join(const std::vector<std::string>& items, std::string_view separator);

// A number as a user wrote it: 4 -> "4", 0.5 -> "0.5", 1e-06 -> "1e-06".
std::string FormatNumber(double v);

}  // namespace jaxtrain
