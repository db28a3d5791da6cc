// The files behind TLS and the bearer token, read and checked at start-up so
// that each mistake fails with its own cause (a key that does not match its
// certificate, a token no client could send) instead of a generic listen error
// or a server nobody can call.
#ifndef ATTNSERVE_SERVER_RPC_CREDENTIALS_H_
#define ATTNSERVE_SERVER_RPC_CREDENTIALS_H_

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/security/server_credentials.h"

namespace attnserve {

// TLS: PEM files of the server's certificate chain and key; with a client CA,
// clients must present a certificate it signed (mutual TLS). No certificate:
// plaintext.
struct ServerTlsOptions {
  std::string cert_file;
  std::string key_file;
  std::string client_ca_file;
  // How often the server reads the three files again (cert-manager and SPIFFE
  // agents renew them in place); zero: only at start-up.
  absl::Duration reload_interval = absl::Minutes(1);
};

// The credentials the server listens with. With TLS, what it serves comes
// from private copies of the files in memory (memfd, reached as
// /proc/self/fd/N, never on disk), which gRPC's file watcher reads each
// second: Reload reads the operator's files again and, when they changed and
// pass every start-up check, swaps the copies whole (the key and chain in one
// file, replaced in one step, so gRPC never reads a key with another's
// chain). New connections then get the new certificate and, under mutual
// TLS, are verified against the new CA bundle; connections already open keep
// theirs. Files that fail a check (half written, garbled, removed, a key that
// does not match, an expired certificate) leave the last good set served.
class TlsCredentials {
 public:
  // Insecure credentials without a certificate file; else TLS from the PEM
  // certificate chain and key (and client CA bundle for mTLS).
  // INVALID_ARGUMENT naming the file and the cause: not a regular file, no
  // PEM certificate or no unencrypted key in it (an encrypted key is refused,
  // never prompted for), a key that does not match the chain's first
  // certificate, a chain or client CA bundle with a block that is not a
  // readable certificate, an expired certificate.
  static absl::StatusOr<std::unique_ptr<TlsCredentials>> Open(
      const ServerTlsOptions& tls);
  ~TlsCredentials();
  TlsCredentials(const TlsCredentials&) = delete;
  TlsCredentials& operator=(const TlsCredentials&) = delete;

  std::shared_ptr<grpc::ServerCredentials> credentials() const {
    return credentials_;
  }
  bool tls() const { return identity_fd_ >= 0; }

  // Reads the files again: true if they changed and now serve, false if they
  // are as served; else the check they failed, as Open names it (the served
  // set stays). Not thread-safe: one caller.
  absl::StatusOr<bool> Reload();

  // The served certificate's notAfter; InfinitePast without TLS.
  absl::Time not_after() const { return not_after_; }

 private:
  explicit TlsCredentials(const ServerTlsOptions& tls) : options_(tls) {}

  // Reads and checks the files; true if they differ from the served ones.
  absl::StatusOr<bool> ReadFiles(std::string* cert, std::string* key,
                                 std::string* roots, absl::Time* not_after);

  const ServerTlsOptions options_;
  std::shared_ptr<grpc::ServerCredentials> credentials_;
  // The key, then the chain, in one file; the client CA bundle in another.
  int identity_fd_ = -1;
  int roots_fd_ = -1;
  std::string cert_, key_, roots_;  // As served.
  absl::Time not_after_ = absl::InfinitePast();
};

// No tokens for no `token_file` (the value of the server option `option`);
// else its tokens (attnserve/common/bearer_tokens.h: INVALID_ARGUMENT for a
// token no client could send). Each token is an identity of its own
// (CallGate). INVALID_ARGUMENT naming the option and the file if it holds no
// token.
absl::StatusOr<std::vector<std::string>> BearerTokensFor(
    const char* option, const std::string& token_file);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_RPC_CREDENTIALS_H_
