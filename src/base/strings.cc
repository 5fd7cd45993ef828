#include "base/strings.h"

#include <cctype>
#include <sstream>

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
  std::ostringstream out;
  out << v;
  return out.str();
}

}  // namespace jaxtrain
