#include "attnserve/common/weights_config.h"

#include <fstream>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace attnserve {

absl::StatusOr<WeightsConfig> ReadWeightsConfig(const std::string& path) {
  std::ifstream file(path);
  if (!file) {
    return absl::NotFoundError(
        absl::StrCat(path, " is missing, expected num_heads=H"));
  }
  WeightsConfig config;
  std::string line;
  while (std::getline(file, line)) {
    const absl::string_view text = absl::StripAsciiWhitespace(line);
    if (text.empty() || text[0] == '#') continue;
    const std::pair<std::string, std::string> entry =
        absl::StrSplit(text, absl::MaxSplits('=', 1));
    int64_t value = 0;
    if (!absl::SimpleAtoi(entry.second, &value)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": '", text, "' is not key=integer"));
    }
    if (entry.first == "num_heads") {
      config.num_heads = value;
    } else if (entry.first == "num_kv_heads") {
      config.num_kv_heads = value;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": unknown key '", entry.first,
                       "', expected num_heads or num_kv_heads"));
    }
  }
  return config;
}

}  // namespace attnserve
