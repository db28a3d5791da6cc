// attnctl's --help, --helpshort, --helpfull and --version.
//
// Abseil's own --help lists only the flags defined in a file named after the
// program (attnctl.cc defines none, so it listed none, not even --target or
// the TLS flags), prints the build's absolute source paths, and exits 1, as
// does --helpfull. attnctl answers the help flags itself: every attnctl flag
// under its source file's path from client/, and exit status 0.
//
//   ConfigureUsage(kUsage);
//   if (std::optional<int> status = HandleHelpFlags(argc, argv)) return
//   *status; Run(absl::ParseCommandLine(argc, argv));
#ifndef ATTNSERVE_CLIENT_ATTNCTL_HELP_H_
#define ATTNSERVE_CLIENT_ATTNCTL_HELP_H_

#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace attnserve {

// Sets Abseil's program usage message to `usage` and its usage configuration:
// --version prints "attnctl VERSION", and flag locations are shown from
// "client/" on (for the help flags Abseil still answers itself, such as
// --help=SUBSTRING). Call once, first thing in main.
void ConfigureUsage(absl::string_view usage);

// If the command line (before any "--") holds --help, --helpshort or
// --helpfull (with one dash or two), prints the usage message and the flags to
// stdout and returns the exit status, 0; nullopt otherwise. --help and
// --helpshort list attnctl's own flags, --helpfull Abseil's too.
std::optional<int> HandleHelpFlags(int argc, char** argv);

// The help text HandleHelpFlags prints: the usage message and, for each source
// file defining flags, its flags with their help and defaults, wrapped at 80
// columns. With `full`, Abseil's own flags (--flagfile, ...) as well.
std::string HelpText(bool full);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_ATTNCTL_HELP_H_
