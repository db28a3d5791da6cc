#include "attnserve/server/rpc/credentials.h"

#include <fcntl.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <ctime>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnserve/common/bearer_tokens.h"
#include "attnserve/common/files.h"
#include "attnserve/common/log.h"
#include "attnserve/common/pem.h"
#include "attnserve/common/status_macros.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"

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
  int blocks = 0;
  // The header OpenSSL writes, and the old one it still reads.
  for (const char* begin :
       {"-----BEGIN CERTIFICATE-----", "-----BEGIN X509 CERTIFICATE-----"}) {
    for (size_t at = pem.find(begin); at != std::string::npos;
         at = pem.find(begin, at + 1)) {
      ++blocks;
    }
  }
  const pem::Bio bio = pem::ReadOnly(pem);
  int read = 0;
  while (pem::NextCertificate(bio.get()) != nullptr) ++read;
  if (read != blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("certificate ", read + 1, " of the ", blocks,
                     " (-----BEGIN CERTIFICATE----- blocks) is not readable"));
  }
  return read;
}

// The last OpenSSL error, as text ("ee key too small").
std::string OpenSslError() {
  const unsigned long error = ERR_peek_last_error();
  ERR_clear_error();
  const char* reason = ERR_reason_error_string(error);
  return reason != nullptr ? reason : "an unknown error";
}

// Whether OpenSSL would serve `cert` with `key`, as gRPC's TLS builds its
// handshaker: the system's security level (Debian's: RSA keys of 2048 bits
// and more, no SHA-1 signatures) refuses some that parse and match. gRPC
// would fail every handshake with them, unsaid.
absl::Status CheckServable(const ServerTlsOptions& tls, X509* cert,
                           EVP_PKEY* key) {
  const std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> context(
      SSL_CTX_new(TLS_server_method()), &SSL_CTX_free);
  if (context == nullptr) {
    return absl::InternalError(
        absl::StrCat("OpenSSL could not make a TLS context: ", OpenSslError()));
  }
  if (SSL_CTX_use_certificate(context.get(), cert) != 1 ||
      SSL_CTX_use_PrivateKey(context.get(), key) != 1 ||
      SSL_CTX_check_private_key(context.get()) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tls.cert_file: ", tls.cert_file,
        ": OpenSSL will not serve its certificate with tls.key_file ",
        tls.key_file, ": ", OpenSslError(),
        " (the system's TLS security level refuses, e.g., RSA keys under "
        "2048 bits and SHA-1 signatures)"));
  }
  ERR_clear_error();
  return absl::OkStatus();
}

// The checks gRPC would make only when the first client connects (or, for a
// mismatched key, by failing to listen without saying why). `served_until`:
// at a reload, the served certificate's notAfter (InfinitePast at start-up).
absl::Status CheckTlsFiles(const ServerTlsOptions& tls,
                           const std::string& cert_pem,
                           const std::string& key_pem,
                           const std::string* client_ca_pem,
                           absl::Time served_until) {
  const pem::Certificate cert = pem::FirstCertificate(cert_pem);
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
    const std::string from = ValidityTime(X509_get0_notBefore(cert.get()));
    // A certificate still valid is not traded for one no client takes yet
    // (a clock-skewed issuer, one staged early): it waits for its time.
    if (served_until > absl::Now()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tls.cert_file: ", tls.cert_file,
          ": its certificate is valid only from ", from,
          " (this machine's clock says it is earlier); the one served stays "
          "until then"));
    }
    Log(LogLevel::kWarning,
        absl::StrCat("attnserve: warning: --tls_cert ", tls.cert_file,
                     ": its certificate is valid only from ", from,
                     " (this machine's clock says it is earlier): clients "
                     "refuse it until then"));
  }
  const pem::PrivateKey key = pem::UnencryptedKey(key_pem);
  if (key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tls.key_file: ", tls.key_file,
        " holds no unencrypted PEM private key (-----BEGIN PRIVATE KEY-----)"));
  }
  if (!pem::KeyMatches(cert.get(), key.get())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tls.key_file: ", tls.key_file,
        " does not match the certificate in tls.cert_file ", tls.cert_file,
        " (the first certificate of the chain must be the key's)"));
  }
  ATTNSERVE_RETURN_IF_ERROR(CheckServable(tls, cert.get(), key.get()));
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

// How often gRPC's file watcher reads the in-memory copies.
constexpr unsigned int kWatchSeconds = 1;

// "/proc/self/fd/N": a path any open() in this process resolves to `fd`'s
// file as it is at that moment.
std::string FdPath(int fd) { return absl::StrCat("/proc/self/fd/", fd); }

// A new anonymous file in memory holding `text`, or -1 (errno set).
int MemoryFile(const char* name, const std::string& text) {
  const int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) return -1;
  size_t written = 0;
  while (written < text.size()) {
    const ssize_t n = write(fd, text.data() + written, text.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = errno;
      close(fd);
      errno = error;
      return -1;
    }
    written += static_cast<size_t>(n);
  }
  return fd;
}

// Puts a new file holding `text` in descriptor `fd`, in one step (dup3).
bool ReplaceMemoryFile(int fd, const char* name, const std::string& text) {
  const int fresh = MemoryFile(name, text);
  if (fresh < 0) return false;
  const bool replaced = dup3(fresh, fd, O_CLOEXEC) == fd;
  const int error = errno;
  close(fresh);
  errno = error;
  return replaced;
}

// The notAfter of `pem`'s first certificate (CheckTlsFiles read it).
absl::Time NotAfter(const std::string& pem) {
  const pem::Certificate cert = pem::FirstCertificate(pem);
  tm time{};
  if (cert == nullptr ||
      ASN1_TIME_to_tm(X509_get0_notAfter(cert.get()), &time) != 1) {
    ERR_clear_error();
    return absl::InfinitePast();
  }
  return absl::FromTM(time, absl::UTCTimeZone());
}

}  // namespace

TlsCredentials::~TlsCredentials() {
  // The file watcher may read the copies until the credentials go: those
  // held by a gRPC server outlive this only after it has shut down.
  credentials_.reset();
  if (identity_fd_ >= 0) close(identity_fd_);
  if (roots_fd_ >= 0) close(roots_fd_);
}

absl::StatusOr<std::unique_ptr<TlsCredentials>> TlsCredentials::Open(
    const ServerTlsOptions& tls) {
  std::unique_ptr<TlsCredentials> opened(new TlsCredentials(tls));
  if (tls.cert_file.empty()) {
    opened->credentials_ = grpc::InsecureServerCredentials();
    return opened;
  }
  std::string cert, key, roots;
  absl::Time not_after;
  ATTNSERVE_RETURN_IF_ERROR(
      opened->ReadFiles(&cert, &key, &roots, &not_after).status());
  const bool mutual = !tls.client_ca_file.empty();
  opened->identity_fd_ = MemoryFile("tls.key_file", key + cert);
  opened->roots_fd_ = mutual ? MemoryFile("tls.client_ca_file", roots) : -1;
  if (opened->identity_fd_ < 0 || (mutual && opened->roots_fd_ < 0)) {
    return absl::UnavailableError(absl::StrCat(
        "could not keep a copy of the TLS files in memory (memfd_create): ",
        std::strerror(errno)));
  }
  opened->cert_ = std::move(cert);
  opened->key_ = std::move(key);
  opened->roots_ = std::move(roots);
  opened->not_after_ = not_after;
  // The file watcher reads the copies at once, then each second. The key's
  // path and the chain's are the one file: each reader takes its own blocks.
  const std::string identity = FdPath(opened->identity_fd_);
  std::shared_ptr<grpc::experimental::CertificateProviderInterface> provider;
  if (mutual) {
    provider =
        std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
            identity, identity, FdPath(opened->roots_fd_), kWatchSeconds);
  } else {
    provider =
        std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
            identity, identity, kWatchSeconds);
  }
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (mutual) {
    options.watch_root_certs();
    options.set_cert_request_type(
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  opened->credentials_ = grpc::experimental::TlsServerCredentials(options);
  return opened;
}

absl::StatusOr<bool> TlsCredentials::ReadFiles(std::string* cert,
                                               std::string* key,
                                               std::string* roots,
                                               absl::Time* not_after) {
  const ServerTlsOptions& tls = options_;
  ATTNSERVE_ASSIGN_OR_RETURN(
      *cert, ReadCredentialFile("tls.cert_file", tls.cert_file));
  ATTNSERVE_ASSIGN_OR_RETURN(*key,
                             ReadCredentialFile("tls.key_file", tls.key_file));
  const bool mutual = !tls.client_ca_file.empty();
  if (mutual) {
    ATTNSERVE_ASSIGN_OR_RETURN(
        *roots, ReadCredentialFile("tls.client_ca_file", tls.client_ca_file));
  }
  if (*cert == cert_ && *key == key_ && *roots == roots_) return false;
  ATTNSERVE_RETURN_IF_ERROR(
      CheckTlsFiles(tls, *cert, *key, mutual ? roots : nullptr, not_after_));
  *not_after = NotAfter(*cert);
  return true;
}

absl::StatusOr<bool> TlsCredentials::Reload() {
  if (!tls()) return false;
  std::string cert, key, roots;
  absl::Time not_after;
  ATTNSERVE_ASSIGN_OR_RETURN(const bool changed,
                             ReadFiles(&cert, &key, &roots, &not_after));
  if (!changed) return false;
  // Each copy replaced in one step, a new file put in the old one's
  // descriptor, so that the watcher reads either whole.
  if (!ReplaceMemoryFile(identity_fd_, "tls.key_file", key + cert) ||
      (roots_fd_ >= 0 &&
       !ReplaceMemoryFile(roots_fd_, "tls.client_ca_file", roots))) {
    return absl::UnavailableError(
        absl::StrCat("could not copy the renewed TLS files into memory: ",
                     std::strerror(errno)));
  }
  cert_ = std::move(cert);
  key_ = std::move(key);
  roots_ = std::move(roots);
  not_after_ = not_after;
  return true;
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
