#include "attnserve/common/flags_help.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "attnserve/common/echo.h"
#include "attnserve/common/files.h"
#include "attnserve_build_info.h"

namespace attnserve {
namespace {

constexpr size_t kWidth = 80;

// The program's, as ConfigureUsage was given it.
ProgramUsage program_usage{"", "", "/"};

// A flag's source file as the build named it, from the program's source folder
// on for its own (CMake compiles them by absolute path), else without a
// leading "/" or "./" (Abseil's own).
std::string NormalizeFilename(absl::string_view path) {
  const absl::string_view folder = program_usage.source_folder;
  const size_t own = path.rfind(absl::StrCat("/", folder));
  if (own != absl::string_view::npos) {
    return std::string(path.substr(own + 1));
  }
  while (absl::ConsumePrefix(&path, "/") || absl::ConsumePrefix(&path, "./")) {
  }
  return std::string(path);
}

// Flags Abseil itself defines (--flagfile, --fromenv, ...), which --help leaves
// to --helpfull.
bool IsAbseilFlag(const absl::CommandLineFlag& flag) {
  return absl::StartsWith(flag.Filename(), "absl/");
}

// Appends `text` word by word to `out`, lines starting with `indent` spaces
// (the first after `first`) and ending before kWidth columns where words allow.
void AppendWrapped(absl::string_view first, absl::string_view text,
                   size_t indent, std::string* out) {
  std::string line(first);
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (line.size() > indent && line.size() + 1 + word.size() > kWidth) {
      absl::StrAppend(out, line, "\n");
      line.assign(indent, ' ');
    } else if (line.size() > indent) {
      line += ' ';
    }
    absl::StrAppend(&line, word);
  }
  absl::StrAppend(out, line, "\n");
}

}  // namespace

std::string VersionText() {
  return absl::StrCat(program_usage.program, " " ATTNSERVE_VERSION "\n",
                      "commit " ATTNSERVE_GIT_COMMIT ", " ATTNSERVE_BUILD_TYPE
                      " build, " ATTNSERVE_COMPILER "\n",
                      program_usage.version_details == nullptr
                          ? ""
                          : program_usage.version_details());
}

void ConfigureUsage(const ProgramUsage& usage) {
  program_usage = usage;
  absl::SetProgramUsageMessage(usage.usage);
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [](absl::string_view file) {
    return absl::StartsWith(file, program_usage.source_folder);
  };
  config.contains_helpshort_flags = config.contains_help_flags;
  config.version_string = VersionText;
  config.normalize_filename = NormalizeFilename;
  absl::SetFlagsUsageConfig(config);
}

std::string HelpText(bool full) {
  // File, then flag name: both sorted.
  std::map<std::string,
           std::map<absl::string_view, const absl::CommandLineFlag*>>
      files;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (flag->IsRetired() || (!full && IsAbseilFlag(*flag))) continue;
    files[flag->Filename()][name] = flag;
  }
  std::string text = absl::StrCat(absl::ProgramUsageMessage(), "\n");
  for (const auto& [file, flags] : files) {
    absl::StrAppend(&text, "\n  Flags from ", file, ":\n");
    for (const auto& [name, flag] : flags) {
      const std::string default_value =
          flag->IsOfType<std::string>()
              ? absl::StrCat("\"", flag->DefaultValue(), "\"")
              : flag->DefaultValue();
      AppendWrapped(
          absl::StrCat("    --", name),
          absl::StrCat("(", flag->Help(), "); default: ", default_value, ";"),
          6, &text);
    }
  }
  if (!full) {
    absl::StrAppend(&text,
                    "\n--helpfull adds Abseil's own flags (--flagfile, "
                    "--fromenv, ...).\n");
  }
  return text;
}

namespace {

// The most a --flagfile may hold, and how deep flag files may name others.
constexpr int64_t kMaxFlagFileBytes = 1 << 20;
constexpr int kMaxFlagFileDepth = 8;

// The flag lines of the flag file `file`, as Abseil's parse takes them:
// leading whitespace stripped, blank lines and # comments left out. An error
// naming --flagfile and the file if it is not a regular file of at most
// kMaxFlagFileBytes, or has a line that is no flag.
absl::StatusOr<std::vector<std::string>> ReadFlagFile(absl::string_view file) {
  absl::StatusOr<std::string> text =
      ReadRegularFile(std::string(file), kMaxFlagFileBytes);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat("--flagfile: ", text.status().message()));
  }
  std::vector<std::string> lines;
  int number = 0;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    ++number;
    const absl::string_view stripped = absl::StripLeadingAsciiWhitespace(line);
    if (stripped.empty() || stripped[0] == '#') continue;
    if (stripped[0] != '-' || stripped == "--") {
      return absl::InvalidArgumentError(absl::StrCat(
          "line ", number, " of --flagfile ", EchoText(file), " is ",
          EchoText(line),
          ", expected a flag (--name=value), a # comment or nothing"));
    }
    // Abseil keeps what ends a line in the flag's value: "--access_log=
    // stdout\r", from a file saved with CRLF line ends, logged to a file
    // named "stdout\r".
    if (absl::ascii_isspace(static_cast<unsigned char>(stripped.back()))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "line ", number, " of --flagfile ", EchoText(file), " is ",
          EchoText(line), ", which ends in white space",
          stripped.back() == '\r' ? " (a carriage return: CRLF line ends)" : "",
          "; expected the line to end with the flag's value"));
    }
    lines.emplace_back(stripped);
  }
  return lines;
}

// Appends `args` to `out`, each --flagfile replaced by its files' lines, from
// `file` ("" for the command line) at `depth` files deep.
absl::Status Expand(const std::vector<absl::string_view>& args,
                    const std::string& file, int depth,
                    std::vector<FlagArgument>* out) {
  for (size_t i = 0; i < args.size(); ++i) {
    absl::string_view arg = args[i];
    if (arg == "--") {  // Arguments, not flags, from here on.
      for (; i < args.size(); ++i) out->push_back({std::string(args[i]), file});
      break;
    }
    const bool flag =
        absl::ConsumePrefix(&arg, "--") || absl::ConsumePrefix(&arg, "-");
    const size_t equals = arg.find('=');
    if (!flag || arg.substr(0, equals) != "flagfile" ||
        (equals == absl::string_view::npos && i + 1 == args.size())) {
      out->push_back({std::string(args[i]), file});
      continue;
    }
    const absl::string_view files =
        equals != absl::string_view::npos ? arg.substr(equals + 1) : args[++i];
    if (depth >= kMaxFlagFileDepth) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--flagfile ", EchoText(files), " nests flag files more than ",
          kMaxFlagFileDepth, " deep, expected at most ", kMaxFlagFileDepth,
          " (does a file name itself?)"));
    }
    for (absl::string_view name :
         absl::StrSplit(files, ',', absl::SkipEmpty())) {
      absl::StatusOr<std::vector<std::string>> lines = ReadFlagFile(name);
      if (!lines.ok()) {
        if (file.empty()) return lines.status();
        return absl::Status(
            lines.status().code(),
            absl::StrCat(lines.status().message(), " (in --flagfile ",
                         EchoText(file), ")"));
      }
      const absl::Status expanded =
          Expand(std::vector<absl::string_view>(lines->begin(), lines->end()),
                 std::string(name), depth + 1, out);
      if (!expanded.ok()) return expanded;
    }
  }
  return absl::OkStatus();
}

// The first error in `args`, ExpandFlagFiles' (the file an error is in said
// after it).
std::optional<std::string> ArgumentsError(
    const std::vector<FlagArgument>& args,
    const absl::flat_hash_set<std::string>& undefined_ok) {
  const auto in_file = [&args](size_t i, std::string error) {
    if (args[i].file.empty()) return error;
    return absl::StrCat(error, " (in --flagfile ", EchoText(args[i].file), ")");
  };
  const size_t argc = args.size();
  for (size_t i = 0; i < argc; ++i) {
    absl::string_view arg = args[i].text;
    if (arg == "--") break;
    if (!absl::ConsumePrefix(&arg, "--") && !absl::ConsumePrefix(&arg, "-")) {
      continue;  // A command or its argument.
    }
    if (arg.empty()) continue;  // A lone "-": an argument, as Abseil takes it.
    const size_t equals = arg.find('=');
    const absl::string_view name = arg.substr(0, equals);
    if (name.empty()) break;  // "--=x": Abseil ends the flags there.
    // Abseil's usage flags, which its parse answers without registering them.
    if (name == "help" || name == "helpfull" || name == "helpshort" ||
        name == "helppackage" || name == "helpon" || name == "helpmatch" ||
        name == "version" || name == "only_check_args") {
      continue;
    }
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && absl::StartsWith(name, "no")) {
      // --nodemo_weights: a boolean flag's false.
      absl::CommandLineFlag* negated =
          absl::FindCommandLineFlag(name.substr(2));
      if (negated != nullptr && negated->IsOfType<bool>()) {
        if (equals == absl::string_view::npos) continue;
        return in_file(i, absl::StrCat("--", name, " takes no value"));
      }
    }
    if (flag == nullptr && (undefined_ok.contains(name) ||
                            (absl::StartsWith(name, "no") &&
                             undefined_ok.contains(name.substr(2))))) {
      continue;
    }
    if (flag == nullptr) {
      // "-5": a negative number where an argument was meant; no argument of
      // attnctl's (lengths) or attnserve's (none) takes one.
      if (args[i].text.substr(0, 2) != "--" &&
          (absl::ascii_isdigit(static_cast<unsigned char>(name[0])) ||
           name[0] == '.')) {
        return in_file(
            i, absl::StrCat(EchoText(args[i].text),
                            " is no flag, and no argument takes a negative "
                            "number; --help lists the flags and arguments"));
      }
      return in_file(
          i, absl::StrCat("unknown flag ", EchoText(absl::StrCat("--", name)),
                          "; --help lists the flags"));
    }
    absl::string_view value;
    if (equals != absl::string_view::npos) {
      value = arg.substr(equals + 1);
    } else if (flag->IsOfType<bool>()) {
      continue;
    } else if (i + 1 < argc && args[i + 1].file == args[i].file) {
      value = args[++i].text;  // Within a file, as Abseil reads each alone.
    } else {
      return in_file(i, absl::StrCat("--", name, " needs a value"));
    }
    if (IsAbseilFlag(*flag)) continue;  // --fromenv, --undefok, ...
    std::string error;
    if (flag->ParseFrom(value, &error)) continue;
    if (flag->IsOfType<bool>()) {
      return in_file(i, absl::StrCat("--", name, " is ", EchoText(value),
                                     ", expected true or false"));
    }
    std::string expected = "a value of its type";
    if (flag->IsOfType<int>()) {
      expected = "a 32-bit integer (-2147483648 to 2147483647)";
    } else if (flag->IsOfType<int64_t>()) {
      expected =
          "a 64-bit integer (-9223372036854775808 to 9223372036854775807)";
    } else if (flag->IsOfType<double>()) {
      expected = "a number";
    } else if (flag->IsOfType<absl::Duration>()) {
      expected = "a duration (500ms, 30s, 2m, 1h30m)";
    }
    return in_file(
        i, absl::StrCat("--", name, " is ", EchoText(value), ", expected ",
                        expected, "; --help gives its range"));
  }
  return std::nullopt;
}

}  // namespace

absl::StatusOr<std::vector<FlagArgument>> ExpandFlagFiles(
    const std::vector<absl::string_view>& args) {
  std::vector<FlagArgument> expanded;
  const absl::Status status = Expand(args, "", 0, &expanded);
  if (!status.ok()) return status;
  return expanded;
}

std::optional<std::string> FlagArgumentsError(int argc, char* const* argv) {
  const absl::StatusOr<std::vector<FlagArgument>> args = ExpandFlagFiles(
      std::vector<absl::string_view>(argv + std::min(argc, 1), argv + argc));
  if (!args.ok()) return std::string(args.status().message());
  // Names --undefok lets through unknown (Abseil's parse ignores them),
  // wherever it is: Abseil reads it after the whole parse.
  absl::flat_hash_set<std::string> undefined_ok;
  for (size_t i = 0; i < args->size(); ++i) {
    absl::string_view arg = (*args)[i].text;
    if (arg == "--") break;
    if (!absl::ConsumePrefix(&arg, "--") && !absl::ConsumePrefix(&arg, "-")) {
      continue;
    }
    absl::string_view names;
    if (absl::ConsumePrefix(&arg, "undefok=")) {
      names = arg;
    } else if (arg == "undefok" && i + 1 < args->size()) {
      names = (*args)[i + 1].text;
    } else {
      continue;
    }
    for (absl::string_view name : absl::StrSplit(names, ',')) {
      undefined_ok.insert(std::string(name));
    }
  }
  return ArgumentsError(*args, undefined_ok);
}

std::optional<int> HandleHelpFlags(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (!absl::ConsumePrefix(&arg, "--") && !absl::ConsumePrefix(&arg, "-")) {
      continue;  // A command or its argument, such as `attnctl help`.
    }
    if (arg == "help" || arg == "helpshort" || arg == "helpfull") {
      const std::string text = HelpText(arg == "helpfull");
      std::fwrite(text.data(), 1, text.size(), stdout);
      return 0;
    }
    // Before the environment's flags are read: a variable no flag takes
    // (Kubernetes' ATTNSERVE_PORT=tcp://...) must not stop --version.
    if (arg == "version") {
      const std::string text = VersionText();
      std::fwrite(text.data(), 1, text.size(), stdout);
      return 0;
    }
  }
  return std::nullopt;
}

}  // namespace attnserve
