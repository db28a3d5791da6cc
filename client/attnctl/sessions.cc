#include "sessions.h"

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "attnserve/client/session.h"
#include "attnserve/common/files.h"
#include "cli.h"
#include "request_flags.h"
#include "tensor_io.h"

// Defined with attend, which writes the same files.
ABSL_DECLARE_FLAG(std::string, output);
ABSL_DECLARE_FLAG(std::string, lse_out);

namespace attnserve {
namespace {

constexpr char kSessionUsage[] =
    "session takes create, step ID, fork ID [LENGTH], truncate ID LENGTH, "
    "get ID, delete ID, or list (the default)";

std::string Describe(const v1::Tensor& tensor) {
  return absl::StrCat("[", absl::StrJoin(tensor.shape(), ", "), "] ",
                      v1::DType_Name(tensor.dtype()));
}

// A LENGTH argument: an integer >= 0.
std::optional<int64_t> ParseLength(const std::string& text) {
  int64_t length = 0;
  if (!absl::SimpleAtoi(text, &length) || length < 0) return std::nullopt;
  return length;
}

// The session on one line; with `replica`, the process holding it last
// (" replica=NAME/INCARNATION").
int PrintInfo(const absl::StatusOr<v1::SessionInfo>& info,
              const char* prefix = "",
              const v1::ReplicaIdentity* replica = nullptr) {
  if (!info.ok()) return Fail(info.status());
  const std::string holder = replica == nullptr
                                 ? ""
                                 : absl::StrCat(" replica=", replica->name(),
                                                "/", replica->incarnation());
  std::printf("%s%s%s\n", prefix, FormatSessionInfo(*info).c_str(),
              holder.c_str());
  return kExitOk;
}

int RunCreate(Client& client) {
  absl::StatusOr<v1::CreateSessionRequest> request =
      CreateSessionRequestFromFlags();
  if (!request.ok()) return UsageError(request.status());
  absl::StatusOr<v1::CreateSessionResponse> response =
      client.CreateSession(*request, CallTimeout());
  if (!response.ok()) return Fail(response.status());
  return PrintInfo(response->session(), "", &response->replica());
}

// Prints the step's length, and its output's shape and checksum as attend
// does; writes --output and --lse_out.
int RunStep(Client& client, const std::string& id) {
  absl::StatusOr<Session> session = Session::Attach(&client, id, CallTimeout());
  if (!session.ok()) return Fail(session.status());
  absl::StatusOr<StepInputs> inputs = StepInputsFromFlags(session->info());
  if (!inputs.ok()) return UsageError(inputs.status());
  if (!absl::GetFlag(FLAGS_lse_out).empty()) {
    inputs->options.set_return_lse(true);
  }
  const int64_t layer = inputs->layer;
  if (layer < 0 || layer >= session->num_layers()) {
    return UsageError(absl::InvalidArgumentError(
        absl::StrCat("--layer is ", layer, ", the session has layers 0 to ",
                     session->num_layers() - 1)));
  }
  // Before the call: a step that appends and then cannot write its files
  // would have appended for nothing (and again when run again).
  const std::pair<const char*, std::string> outputs[] = {
      {"--output", absl::GetFlag(FLAGS_output)},
      {"--lse_out", absl::GetFlag(FLAGS_lse_out)}};
  for (const auto& [flag, path] : outputs) {
    if (path.empty()) continue;
    if (!inputs->query) {
      return UsageError(absl::InvalidArgumentError(
          absl::StrCat(flag, " is ", path,
                       ", but the step has no query (--query, or --demo with "
                       "--query_tokens > 0) to answer it")));
    }
    // Its append stands whether or not its outputs are written: a path that
    // cannot take them is refused first.
    if (const absl::Status writable = CheckOutputPath(flag, path);
        !writable.ok()) {
      return UsageError(writable);
    }
  }
  const int64_t before = session->length(layer);
  const absl::Time start = absl::Now();
  absl::StatusOr<StepOutput> out =
      session->Step(*std::move(inputs), CallTimeout());
  const absl::Duration round_trip = absl::Now() - start;
  if (!out.ok()) return Fail(out.status());
  std::printf("layer %lld length %lld -> %lld, round trip %s\n",
              static_cast<long long>(layer), static_cast<long long>(before),
              static_cast<long long>(out->length),
              absl::FormatDuration(round_trip).c_str());
  if (out->output) {
    absl::StatusOr<std::vector<float>> values = FloatValues(*out->output);
    if (!values.ok()) return Fail(values.status());
    double sum = 0.0, sum_abs = 0.0;
    for (float value : *values) {
      sum += value;
      sum_abs += std::abs(value);
    }
    std::printf("output shape %s\n", Describe(*out->output).c_str());
    std::printf("checksum sum=%.6f sum_abs=%.6f\n", sum, sum_abs);
  }
  const std::pair<std::string, const std::optional<v1::Tensor>*> files[] = {
      {absl::GetFlag(FLAGS_output), &out->output},
      {absl::GetFlag(FLAGS_lse_out), &out->lse}};
  for (const auto& [path, tensor] : files) {
    if (path.empty()) continue;
    if (!tensor->has_value()) {
      // The query was checked above: the server left the tensor out.
      return Fail(absl::InternalError(
          absl::StrCat("no tensor for ", path,
                       ": the server answered the step's query without it")));
    }
    const absl::Status written = WriteTensorFile(path, **tensor);
    if (!written.ok()) return Fail(written);
    std::printf("wrote %s %s\n", path.c_str(), Describe(**tensor).c_str());
  }
  return kExitOk;
}

int RunFork(Client& client, const std::vector<std::string>& args) {
  v1::ForkSessionRequest request;
  request.set_session_id(args[1]);
  if (args.size() == 3) {
    const std::optional<int64_t> length = ParseLength(args[2]);
    if (!length) {
      return UsageError(absl::InvalidArgumentError(
          absl::StrCat("fork's LENGTH is '", args[2], "', expected >= 0")));
    }
    request.set_length(*length);
  }
  absl::StatusOr<int64_t> ttl = TtlSecondsFromFlags();
  if (!ttl.ok()) return UsageError(ttl.status());
  request.set_ttl_seconds(*ttl);
  absl::StatusOr<v1::ForkSessionResponse> response =
      client.ForkSession(request, CallTimeout());
  if (!response.ok()) return Fail(response.status());
  return PrintInfo(response->session(), "", &response->replica());
}

int RunTruncate(Client& client, const std::vector<std::string>& args) {
  const std::optional<int64_t> length = ParseLength(args[2]);
  if (!length) {
    return UsageError(absl::InvalidArgumentError(
        absl::StrCat("truncate's LENGTH is '", args[2], "', expected >= 0")));
  }
  v1::TruncateSessionRequest request;
  request.set_session_id(args[1]);
  request.set_length(*length);
  absl::StatusOr<v1::TruncateSessionResponse> response =
      client.TruncateSession(request, CallTimeout());
  if (!response.ok()) return Fail(response.status());
  return PrintInfo(response->session());
}

int RunList(Client& client) {
  absl::StatusOr<v1::ListSessionsResponse> response =
      client.ListSessions(CallTimeout());
  if (!response.ok()) return Fail(response.status());
  for (const v1::SessionInfo& info : response->sessions()) {
    std::printf("%s\n", FormatSessionInfo(info).c_str());
  }
  std::printf(
      "sessions=%d total_bytes=%lld budget_bytes=%lld "
      "identity_held_bytes=%lld identity_budget_bytes=%lld "
      "identity_max_sessions=%lld\n",
      response->sessions_size(),
      static_cast<long long>(response->total_bytes()),
      static_cast<long long>(response->budget_bytes()),
      static_cast<long long>(response->identity_held_bytes()),
      static_cast<long long>(response->identity_budget_bytes()),
      static_cast<long long>(response->identity_max_sessions()));
  return kExitOk;
}

}  // namespace

std::string FormatSessionInfo(const v1::SessionInfo& info) {
  std::string line = absl::StrCat(
      info.session_id(), " layers=", info.num_layers(), " H=", info.num_heads(),
      " Hkv=", info.num_kv_heads(), " Dk=", info.key_dim(),
      " Dv=", info.value_dim(), " dtype=", v1::DType_Name(info.dtype()),
      " lengths=", absl::StrJoin(info.lengths(), ","),
      " max_tokens=", info.max_tokens(), " ttl=", info.ttl_seconds(), "s",
      " bytes=", info.bytes(), " shared_bytes=", info.shared_bytes());
  if (!info.forked_from().empty()) {
    absl::StrAppend(&line, " forked_from=", info.forked_from());
  }
  return line;
}

int RunSession(Client& client, const std::vector<std::string>& args) {
  const std::string sub = args.empty() ? "list" : args[0];
  const size_t n = args.size();
  if ((sub == "list" && n <= 1)) return RunList(client);
  if (sub == "create" && n == 1) return RunCreate(client);
  if (sub == "step" && n == 2) return RunStep(client, args[1]);
  if (sub == "fork" && (n == 2 || n == 3)) return RunFork(client, args);
  if (sub == "truncate" && n == 3) return RunTruncate(client, args);
  if (sub == "get" && n == 2) {
    absl::StatusOr<v1::GetSessionResponse> response =
        client.GetSession(args[1], CallTimeout());
    if (!response.ok()) return Fail(response.status());
    return PrintInfo(response->session(), "", &response->replica());
  }
  if (sub == "delete" && n == 2) {
    absl::StatusOr<v1::DeleteSessionResponse> response =
        client.DeleteSession(args[1], CallTimeout());
    if (!response.ok()) return Fail(response.status());
    return PrintInfo(response->deleted(), "deleted ");
  }
  return UsageError(absl::InvalidArgumentError(kSessionUsage));
}

}  // namespace attnserve
