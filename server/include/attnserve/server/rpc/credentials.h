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
#include "grpcpp/security/server_credentials.h"

namespace attnserve {

// TLS: PEM files of the server's certificate chain and key; with a client CA,
// clients must present a certificate it signed (mutual TLS). No certificate:
// plaintext.
struct ServerTlsOptions {
  std::string cert_file;
  std::string key_file;
  std::string client_ca_file;
};

// Insecure credentials without a certificate file; else TLS from the PEM
// certificate chain and key (and client CA bundle for mTLS). INVALID_ARGUMENT
// naming the file and the cause: not a regular file, no PEM certificate or no
// unencrypted key in it (an encrypted key is refused, never prompted for), a
// key that does not match the chain's first certificate, a block of the
// client CA bundle that is not a readable certificate.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const ServerTlsOptions& tls);

// No tokens for no `token_file` (the value of the server option `option`);
// else its tokens (attnserve/common/bearer_tokens.h: INVALID_ARGUMENT for a
// token no client could send). Each token is an identity of its own
// (CallGate). INVALID_ARGUMENT naming the option and the file if it holds no
// token.
absl::StatusOr<std::vector<std::string>> BearerTokensFor(
    const char* option, const std::string& token_file);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_RPC_CREDENTIALS_H_
