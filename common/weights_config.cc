#include "attnserve/common/weights_config.h"

#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "attnserve/common/files.h"

namespace attnserve {
namespace {

// A config.txt holds two short lines; anything much larger is not one.
constexpr int64_t kMaxConfigBytes = 64 << 10;

}  // namespace

absl::StatusOr<WeightsConfig> ReadWeightsConfig(const std::string& path) {
  absl::StatusOr<std::string> text = ReadRegularFile(path, kMaxConfigBytes);
  if (absl::IsNotFound(text.status())) {
    return absl::NotFoundError(
        absl::StrCat(path, " is missing, expected num_heads=H"));
  }
  if (!text.ok()) return text.status();
  // Messages name the line, never its text: the file may not be what the
  // operator meant to point at.
  WeightsConfig config;
  const std::vector<absl::string_view> lines = absl::StrSplit(*text, '\n');
  for (size_t number = 1; number <= lines.size(); ++number) {
    const absl::string_view line =
        absl::StripAsciiWhitespace(lines[number - 1]);
    if (line.empty() || line[0] == '#') continue;
    const std::pair<absl::string_view, absl::string_view> entry =
        absl::StrSplit(line, absl::MaxSplits('=', 1));
    int64_t value = 0;
    if (!absl::SimpleAtoi(entry.second, &value)) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": line ", number,
          " is not key=integer, expected num_heads=H, num_kv_heads=Hkv, "
          "version=N, rope_theta=T, rotary_dim=R or rope_interleaved=0|1"));
    }
    if (entry.first == "num_heads") {
      config.num_heads = value;
    } else if (entry.first == "num_kv_heads") {
      config.num_kv_heads = value;
    } else if (entry.first == "rope_theta") {
      if (value < 2) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": line ", number, " sets rope_theta to ", value,
                         ", expected an integer > 1"));
      }
      config.rope_theta = value;
    } else if (entry.first == "rotary_dim") {
      config.rotary_dim = value;
    } else if (entry.first == "rope_interleaved") {
      config.rope_interleaved = value != 0;
    } else if (entry.first == "version") {
      if (value < 1 || value > kMaxWeightsVersion) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": line ", number, " sets version to ", value,
                         ", expected 1 to ", kMaxWeightsVersion));
      }
      config.version = value;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": line ", number,
                       " has an unknown key, expected num_heads, "
                       "num_kv_heads, version, rope_theta, rotary_dim or "
                       "rope_interleaved"));
    }
  }
  // RoPE's other keys mean nothing without its base: said, not dropped.
  if (config.rope_theta == 0 &&
      (config.rotary_dim != 0 || config.rope_interleaved)) {
    return absl::InvalidArgumentError(absl::StrCat(
        path,
        " sets rotary_dim or rope_interleaved without rope_theta, expected "
        "rope_theta=T (an integer > 1, e.g. 10000) with them, or neither"));
  }
  return config;
}

}  // namespace attnserve
