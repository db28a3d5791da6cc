#include "attnserve/server/rpc/credentials.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "attnserve/common/bearer_tokens.h"
#include "attnserve/common/files.h"
#include "attnserve/common/log.h"
#include "attnserve/common/status_macros.h"
#include "grpcpp/security/server_credentials.h"

namespace attnserve {
namespace {

// PEM bundles and tokens are kilobytes; a larger file is not one.
constexpr int64_t kMaxCredentialFileBytes = 1 << 20;

absl::StatusOr<std::string> ReadCredentialFile(const char* option,
                                               const std::string& path) {
  absl::StatusOr<std::string> text =
      ReadRegularFile(path, kMaxCredentialFileBytes);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat(option, ": ", text.status().message()));
  }
  return text;
}

struct BioFree {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
struct X509Free {
  void operator()(X509* cert) const { X509_free(cert); }
};
struct KeyFree {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};

std::unique_ptr<BIO, BioFree> ReadOnlyBio(const std::string& pem) {
  return std::unique_ptr<BIO, BioFree>(
      BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// OpenSSL's passphrase callback, refusing: without one it asks the terminal
// (or stdin) for an encrypted key's passphrase and start-up waits there.
int NoPassphrase(char* /*buffer*/, int /*size*/, int /*rwflag*/,
                 void* /*user*/) {
  return 0;
}

std::unique_ptr<X509, X509Free> FirstCertificate(const std::string& pem) {
  auto bio = ReadOnlyBio(pem);
  std::unique_ptr<X509, X509Free> cert(
      PEM_read_bio_X509(bio.get(), nullptr, NoPassphrase, nullptr));
  ERR_clear_error();
  return cert;
}

// An ASN.1 time as OpenSSL prints it ("Dec  7 16:33:42 2026 GMT").
std::string ValidityTime(const ASN1_TIME* time) {
  std::unique_ptr<BIO, decltype(&BIO_free)> out(BIO_new(BIO_s_mem()),
                                                &BIO_free);
  if (out == nullptr || ASN1_TIME_print(out.get(), time) != 1) {
    ERR_clear_error();
    return "an unreadable time";
  }
  char* text = nullptr;
  const long length = BIO_get_mem_data(out.get(), &text);
  return std::string(text, static_cast<size_t>(std::max(length, 0L)));
}

// How many certificates a PEM bundle holds, or an error naming the first
// certificate block OpenSSL could not read (other blocks are skipped, as gRPC
// skips them): gRPC would drop every certificate from a broken
// block on, silently, and refuse those CAs' clients at their handshake.
absl::StatusOr<int> CountCertificates(const std::string& pem) {
  const std::string begin = "-----BEGIN CERTIFICATE-----";
  int blocks = 0;
  for (size_t at = pem.find(begin); at != std::string::npos;
       at = pem.find(begin, at + 1)) {
    ++blocks;
  }
  auto bio = ReadOnlyBio(pem);
  int read = 0;
  while (true) {
    std::unique_ptr<X509, X509Free> cert(
        PEM_read_bio_X509(bio.get(), nullptr, NoPassphrase, nullptr));
    if (cert == nullptr) break;
    ++read;
  }
  ERR_clear_error();
  if (read != blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("certificate ", read + 1, " of the ", blocks,
                     " (-----BEGIN CERTIFICATE----- blocks) is not readable"));
  }
  return read;
}

// The checks gRPC would make only when the first client connects (or, for a
// mismatched key, by failing to listen without saying why).
absl::Status CheckTlsFiles(const ServerTlsOptions& tls,
                           const std::string& cert_pem,
                           const std::string& key_pem,
                           const std::string* client_ca_pem) {
  const std::unique_ptr<X509, X509Free> cert = FirstCertificate(cert_pem);
  if (cert == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tls.cert_file: ", tls.cert_file,
        " holds no PEM certificate (-----BEGIN CERTIFICATE-----)"));
  }
  // gRPC sends the chain up to its first unreadable block, silently: a
  // client that needs the intermediates past it fails its handshake.
  if (const absl::StatusOr<int> chain = CountCertificates(cert_pem);
      !chain.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tls.cert_file: ", tls.cert_file, ": ", chain.status().message()));
  }
  // A server whose certificate has expired is one no client can call.
  if (X509_cmp_current_time(X509_get0_notAfter(cert.get())) <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tls.cert_file: ", tls.cert_file, ": its certificate expired at ",
        ValidityTime(X509_get0_notAfter(cert.get())),
        "; put a current one in its place"));
  }
  if (X509_cmp_current_time(X509_get0_notBefore(cert.get())) > 0) {
    Log(LogLevel::kWarning,
        absl::StrCat("tls.cert_file: ", tls.cert_file,
                     ": its certificate is valid only from ",
                     ValidityTime(X509_get0_notBefore(cert.get())),
                     " (this machine's clock says it is earlier): clients "
                     "refuse it until then"));
  }
  auto bio = ReadOnlyBio(key_pem);
  const std::unique_ptr<EVP_PKEY, KeyFree> key(
      PEM_read_bio_PrivateKey(bio.get(), nullptr, NoPassphrase, nullptr));
  ERR_clear_error();
  if (key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tls.key_file: ", tls.key_file,
        " holds no unencrypted PEM private key (-----BEGIN PRIVATE KEY-----)"));
  }
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat(
        "tls.key_file: ", tls.key_file,
        " does not match the certificate in tls.cert_file ", tls.cert_file,
        " (the first certificate of the chain must be the key's)"));
  }
  if (client_ca_pem != nullptr) {
    const absl::StatusOr<int> authorities = CountCertificates(*client_ca_pem);
    if (!authorities.ok() || *authorities == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tls.client_ca_file: ", tls.client_ca_file,
          authorities.ok()
              ? " holds no PEM certificate (-----BEGIN CERTIFICATE-----)"
              : absl::StrCat(": ", authorities.status().message())));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const ServerTlsOptions& tls) {
  if (tls.cert_file.empty()) return grpc::InsecureServerCredentials();
  ATTNSERVE_ASSIGN_OR_RETURN(
      std::string cert, ReadCredentialFile("tls.cert_file", tls.cert_file));
  ATTNSERVE_ASSIGN_OR_RETURN(std::string key,
                             ReadCredentialFile("tls.key_file", tls.key_file));
  const bool mutual = !tls.client_ca_file.empty();
  grpc::SslServerCredentialsOptions ssl(
      mutual ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
             : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  if (mutual) {
    ATTNSERVE_ASSIGN_OR_RETURN(
        ssl.pem_root_certs,
        ReadCredentialFile("tls.client_ca_file", tls.client_ca_file));
  }
  ATTNSERVE_RETURN_IF_ERROR(
      CheckTlsFiles(tls, cert, key, mutual ? &ssl.pem_root_certs : nullptr));
  ssl.pem_key_cert_pairs.push_back({key, cert});
  return grpc::SslServerCredentials(ssl);
}

absl::StatusOr<std::vector<std::string>> BearerTokensFor(
    const char* option, const std::string& token_file) {
  if (token_file.empty()) return std::vector<std::string>();
  ATTNSERVE_ASSIGN_OR_RETURN(std::string text,
                             ReadCredentialFile(option, token_file));
  ATTNSERVE_ASSIGN_OR_RETURN(std::vector<std::string> tokens,
                             ParseBearerTokens(option, token_file, text));
  if (tokens.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(option, ": ", token_file, " holds no token"));
  }
  return tokens;
}

}  // namespace attnserve
