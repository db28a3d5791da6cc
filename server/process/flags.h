// The attnserve binary's flags and what it does with them: the ServerOptions
// they set, ATTNSERVE_<FLAG> environment variables, and start-up errors shown
// with flag names instead of the library's option names. Private to the
// binary (main.cc).
#ifndef ATTNSERVE_SERVER_PROCESS_FLAGS_H_
#define ATTNSERVE_SERVER_PROCESS_FLAGS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attnserve/server/server_options.h"

namespace attnserve {

// The program usage message --help prints first.
extern const char kUsage[];

// argv with "--flag=value" for each ATTNSERVE_<FLAG> in the environment
// inserted before the command line's own arguments; a variable whose flag the
// command line sets (itself, or in a file its --flagfile names) is ignored.
// `storage` keeps the inserted strings.
std::vector<char*> ArgumentsWithEnvironment(int argc, char** argv,
                                            std::vector<std::string>* storage);

// `error`, a refusal naming flags ("--port is ..."), with the environment
// variable that gave the first of them when `environment`
// (ArgumentsWithEnvironment's storage) holds it.
std::string WithEnvironmentNames(absl::string_view error,
                                 const std::vector<std::string>& environment);

// The options the parsed flags set; INVALID_ARGUMENT for a flag value no
// option can take (--attention_kernel, --io_spin_us out of range).
absl::StatusOr<ServerOptions> OptionsFromFlags();

// `message` with each option it names ("scheduling.max_batch", or a field's
// own name where that has an underscore, "max_weights_bytes") shown as its
// flag ("--max_batch"). Names inside paths are left alone.
std::string WithFlagNames(absl::string_view message);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_PROCESS_FLAGS_H_
