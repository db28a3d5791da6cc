#include "cli.h"

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "attnserve/common/bearer_tokens.h"
#include "attnserve/common/files.h"

ABSL_FLAG(std::string, target, "localhost:50051",
          "gRPC target of the attnserve server.");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(30), "Deadline of each call.");
ABSL_FLAG(int64_t, max_message_bytes, 64 << 20,
          "Largest message the client sends or receives; match the server's "
          "--max_message_bytes.");

ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA bundle to verify the server with; setting any --tls_* flag "
          "turns TLS on.");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate, for mutual TLS.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(
    std::string, tls_server_name, "",
    "The name the server certificate must carry, when --target is an address.");
ABSL_FLAG(bool, wait_for_ready, false,
          "Calls wait, up to --timeout, for a connection to the server instead "
          "of failing UNAVAILABLE at once while it cannot be reached.");
ABSL_FLAG(std::string, compression, "none",
          "Compress every request: none, gzip or deflate (the server must run "
          "with --accept_compressed_requests).");
ABSL_FLAG(std::string, auth_token_file, "",
          "File holding the bearer token to send as \"authorization: Bearer "
          "<token>\": its one line that is not blank or a # comment.");

namespace attnserve {
namespace {

// The most a certificate, key or token file may hold.
constexpr int64_t kMaxFlagFileBytes = int64_t{1} << 20;

// The contents of a small file named by a flag: a regular file (a folder,
// FIFO or device is refused) that is not empty; empty for an empty path.
absl::StatusOr<std::string> ReadFlagFile(const char* flag,
                                         const std::string& path) {
  if (path.empty()) return std::string();
  absl::StatusOr<std::string> text = ReadRegularFile(path, kMaxFlagFileBytes);
  if (!text.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, " file ", path,
                     " cannot be read: ", text.status().message()));
  }
  if (text->empty()) {
    // An empty CA would mean gRPC's default roots, not the file named.
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, " file ", path, " is empty"));
  }
  return text;
}

// ReadFlagFile of a PEM file: certificates, or (`key`) a private key. gRPC
// takes any bytes and fails only when it connects, as UNAVAILABLE naming
// neither the flag nor the file.
absl::StatusOr<std::string> ReadPemFlagFile(const char* flag,
                                            const std::string& path, bool key) {
  absl::StatusOr<std::string> text = ReadFlagFile(flag, path);
  if (!text.ok() || text->empty()) return text;
  const bool pem =
      key ? absl::StrContains(*text, "-----BEGIN ") &&
                absl::StrContains(*text, "PRIVATE KEY-----")
          : absl::StrContains(*text, "-----BEGIN CERTIFICATE-----");
  if (!pem) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, " file ", path, " holds no PEM ",
                     key ? "private key (-----BEGIN ... PRIVATE KEY-----)"
                         : "certificate (-----BEGIN CERTIFICATE-----)"));
  }
  return text;
}

}  // namespace

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "attnctl: %s\n", status.ToString().c_str());
  return kExitCallFailed;
}

int UsageError(const absl::Status& status) {
  std::fprintf(stderr, "attnctl: %s\n", std::string(status.message()).c_str());
  return kExitUsage;
}

absl::Duration CallTimeout() { return absl::GetFlag(FLAGS_timeout); }

namespace {

// The token of --auth_token_file, read as the server reads token files
// (attnserve/common/bearer_tokens.h); empty without the flag. A file of no
// token, or of several (a server's: which one is the caller's is not for
// attnctl to guess), is refused.
absl::StatusOr<std::string> BearerTokenFromFlag() {
  const std::string path = absl::GetFlag(FLAGS_auth_token_file);
  if (path.empty()) return std::string();
  absl::StatusOr<std::string> text = ReadFlagFile("auth_token_file", path);
  if (!text.ok()) return text.status();
  absl::StatusOr<std::vector<std::string>> tokens =
      ParseBearerTokens("--auth_token_file", path, *text);
  if (!tokens.ok()) return tokens.status();
  if (tokens->size() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth_token_file ", path, " holds ", tokens->size(),
                     " tokens, expected one: the token to send"));
  }
  return std::move(tokens->front());
}

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> ConnectFromFlags() {
  const absl::Duration timeout = absl::GetFlag(FLAGS_timeout);
  // -inf would mean no deadline at all, inf a call that may wait forever.
  if (timeout <= absl::ZeroDuration() || timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--timeout is ", absl::FormatDuration(timeout),
                     ", expected a positive, finite duration (30s, 2m)"));
  }
  const int64_t max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (max_message_bytes <= 0 || max_message_bytes > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_message_bytes is ", max_message_bytes,
                     ", expected 1 to ", INT32_MAX));
  }
  ClientOptions options;
  options.max_message_bytes = static_cast<int>(max_message_bytes);
  options.wait_for_ready = absl::GetFlag(FLAGS_wait_for_ready);
  const std::string compression = absl::GetFlag(FLAGS_compression);
  const std::optional<Compression> parsed = ParseCompression(compression);
  if (!parsed) {
    return absl::InvalidArgumentError(
        absl::StrCat("--compression is \"", compression,
                     "\", expected none, gzip or deflate"));
  }
  options.compression = *parsed;
  const std::string ca = absl::GetFlag(FLAGS_tls_ca),
                    cert = absl::GetFlag(FLAGS_tls_cert),
                    key = absl::GetFlag(FLAGS_tls_key),
                    server_name = absl::GetFlag(FLAGS_tls_server_name);
  if (!ca.empty() || !cert.empty() || !key.empty() || !server_name.empty()) {
    if (cert.empty() != key.empty()) {
      return absl::InvalidArgumentError(
          "--tls_cert and --tls_key go together (mutual TLS), or neither");
    }
    TlsOptions tls;
    absl::StatusOr<std::string> text = ReadPemFlagFile("tls_ca", ca, false);
    if (!text.ok()) return text.status();
    tls.root_certificates = *text;
    if (!(text = ReadPemFlagFile("tls_cert", cert, false)).ok()) {
      return text.status();
    }
    tls.client_certificate = *text;
    if (!(text = ReadPemFlagFile("tls_key", key, true)).ok()) {
      return text.status();
    }
    tls.client_private_key = *text;
    tls.server_name_override = server_name;
    options.tls = tls;
  }
  absl::StatusOr<std::string> token = BearerTokenFromFlag();
  if (!token.ok()) return token.status();
  options.bearer_token = *std::move(token);
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect(absl::GetFlag(FLAGS_target), options);
  if (client.ok()) return client;
  // The library names its options; attnctl's user gave flags and files.
  return absl::Status(
      client.status().code(),
      absl::StrReplaceAll(
          client.status().message(),
          {{"tls.client_private_key", absl::StrCat("--tls_key file ", key)},
           {"tls.client_certificate",
            absl::StrCat("--tls_cert file ", cert)}}));
}

int64_t MaxMessageBytes() { return absl::GetFlag(FLAGS_max_message_bytes); }

int64_t MaxInputFileBytes() { return 2 * MaxMessageBytes(); }

}  // namespace attnserve
