#include "base/strings.h"

#include <array>
#include <cctype>
#include <charconv>

namespace jaxtrain {

std::string Trim(std::string_view text) {
  const auto is_space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  while (!text.empty() && is_space(text.front())) text.remove_prefix(1);
  while (!text.empty() && is_space(text.back())) text.remove_suffix(1);
  return std::string(text);
}

std::string Join(const std::vector<std::string>& items, std::string_view separator) {
  std::string joined;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) joined += separator;
    joined += items[i];
  }
  return joined;
}

std::string FormatNumber(double v) {
  // The shortest text that reads back as `v` (Python's repr of a float, without its ".0"):
  // 0.1234567 stays 0.1234567 and 1234567 stays 1234567, which a stream's 6 digits round.
  std::array<char, 32> text;
  const auto end = std::to_chars(text.data(), text.data() + text.size(), v).ptr;
  return std::string(text.data(), end);
}

}  // namespace jaxtrain
