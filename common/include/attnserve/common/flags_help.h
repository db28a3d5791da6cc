// --help, --helpshort, --helpfull and --version for attnserve's programs.
//
// Abseil's own --help lists only the flags defined in a file named after the
// program (attnctl.cc defines none, so it listed none, not even --target or
// the TLS flags; attnserve's printed "No flags matched."), prints the build's
// absolute source paths, and exits 1, as does --helpfull. The programs answer
// the help flags themselves: every flag of theirs under its source file's
// path from the repository root, and exit status 0.
//
// clang-format off
//   ConfigureUsage({"attnctl", kUsage, "client/"});
//   if (std::optional<int> status = HandleHelpFlags(argc, argv)) return *status;
//   Run(absl::ParseCommandLine(argc, argv));
// clang-format on
#ifndef ATTNSERVE_COMMON_FLAGS_HELP_H_
#define ATTNSERVE_COMMON_FLAGS_HELP_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attnserve {

struct ProgramUsage {
  const char* program;  // "attnctl": --version prints "attnctl VERSION".
  const char* usage;    // The program usage message.
  // The program's own flags are those defined under this folder of the
  // repository ("client/"), shown from there on.
  const char* source_folder;
  // More lines for --version after the build's (the libraries the program
  // runs with, ...), each ending in "\n"; none when null.
  std::string (*version_details)() = nullptr;
};

// --version's text: "PROGRAM VERSION", then the build ("commit 0123456789ab,
// Release build, GNU 12.2.0"; the commit is "unknown" for a build outside a
// git checkout, and ends in "-dirty" when tracked files differed from it),
// then the program's version_details.
std::string VersionText();

// Sets Abseil's program usage message and its usage configuration from
// `usage`: --version, and flag locations shown from the repository root (for
// the help flags Abseil still answers itself, such as --help=SUBSTRING). Call
// once, first thing in main. The strings must outlive the program's flags.
void ConfigureUsage(const ProgramUsage& usage);

// If the command line (before any "--") holds --help, --helpshort or
// --helpfull (with one dash or two), prints the usage message and the flags to
// stdout and returns the exit status, 0; nullopt otherwise. --help and
// --helpshort list the program's own flags, --helpfull Abseil's too. Likewise
// --version, which prints the version text.
std::optional<int> HandleHelpFlags(int argc, char** argv);

// Checks each flag on the command line (before any "--") names a flag of the
// program and that its value parses as the flag's type, before Abseil's parse,
// which exits 1 with neither the expected value nor a usage error's status.
// Returns the first error: "unknown flag --prot; --help lists the flags",
// "--port is \"abc\", expected a 32-bit integer (-2147483648 to 2147483647)",
// "--port needs a value". Values are set on the flags as they are checked, as
// Abseil's parse then sets them again. The files --flagfile names are checked
// the same way, line by line, and must be regular files of at most 1 MiB,
// nested at most 8 deep (Abseil's parse would read a folder as an empty file,
// /dev/zero without end, and wait on a FIFO for ever). Abseil's other flags
// (--fromenv, --undefok, ...) are left to its parse.
std::optional<std::string> FlagArgumentsError(int argc, char* const* argv);

// One argument of a command line, or a line of a flag file it names, with
// that file's name as --flagfile gave it ("" for the command line).
struct FlagArgument {
  std::string text;
  std::string file;
};

// `args` (a command line without its program name) with each --flagfile flag
// replaced by its files' lines, as Abseil's parse takes them (leading
// whitespace stripped, blank lines and # comments left out), those files'
// own --flagfile flags likewise; a relative path is the working directory's.
// An error naming --flagfile and the file if one is not a regular file of at
// most 1 MiB or has a line that is no flag, or if files nest more than 8
// deep.
absl::StatusOr<std::vector<FlagArgument>> ExpandFlagFiles(
    const std::vector<absl::string_view>& args);

// The help text HandleHelpFlags prints: the usage message and, for each source
// file defining flags, its flags with their help and defaults, wrapped at 80
// columns. With `full`, Abseil's own flags (--flagfile, ...) as well.
std::string HelpText(bool full);

}  // namespace attnserve

#endif  // ATTNSERVE_COMMON_FLAGS_HELP_H_
