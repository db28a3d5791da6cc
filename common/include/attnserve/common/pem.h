#ifndef ATTNSERVE_COMMON_PEM_H_
#define ATTNSERVE_COMMON_PEM_H_

// PEM certificates and private keys read from memory with OpenSSL, for the
// TLS checks of the server (server/rpc: its files at start-up and reload, a
// client certificate's identity) and of the client library (its key pair).
// Header-only: attnserve_common depends on Abseil alone, and a target that
// includes this links OpenSSL::Crypto itself.
//
// Every function leaves OpenSSL's error queue of this thread empty, so a
// failed read does not show up in a later, unrelated error report.

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <climits>
#include <memory>

#include "absl/strings/string_view.h"

namespace attnserve {
namespace pem {

struct CertificateFree {
  void operator()(X509* cert) const { X509_free(cert); }
};
struct KeyFree {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};
struct BioFree {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
using Certificate = std::unique_ptr<X509, CertificateFree>;
using PrivateKey = std::unique_ptr<EVP_PKEY, KeyFree>;
using Bio = std::unique_ptr<BIO, BioFree>;

// OpenSSL's passphrase callback, refusing: without one it asks the terminal
// (or stdin) for an encrypted key's passphrase, and its caller waits there.
inline int NoPassphrase(char* /*buffer*/, int /*size*/, int /*rwflag*/,
                        void* /*user*/) {
  return 0;
}

// A read-only memory BIO over `pem` (which must outlive it); null for text
// past what OpenSSL can address.
inline Bio ReadOnly(absl::string_view pem) {
  if (pem.size() > static_cast<size_t>(INT_MAX)) return nullptr;
  return Bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// The next certificate `bio` holds, skipping blocks of other kinds; null at
// the end or at a certificate block OpenSSL cannot read.
inline Certificate NextCertificate(BIO* bio) {
  Certificate cert(
      bio == nullptr ? nullptr
                     : PEM_read_bio_X509(bio, nullptr, NoPassphrase, nullptr));
  ERR_clear_error();
  return cert;
}

// The first certificate of `pem` (a chain's leaf), or null.
inline Certificate FirstCertificate(absl::string_view pem) {
  const Bio bio = ReadOnly(pem);
  return NextCertificate(bio.get());
}

// The first unencrypted private key of `pem`, or null (an encrypted one is
// refused, never prompted for).
inline PrivateKey UnencryptedKey(absl::string_view pem) {
  const Bio bio = ReadOnly(pem);
  PrivateKey key(
      bio == nullptr
          ? nullptr
          : PEM_read_bio_PrivateKey(bio.get(), nullptr, NoPassphrase, nullptr));
  ERR_clear_error();
  return key;
}

// Whether `key` is the private key of `cert`'s public key.
inline bool KeyMatches(X509* cert, EVP_PKEY* key) {
  const bool matches = X509_check_private_key(cert, key) == 1;
  ERR_clear_error();
  return matches;
}

}  // namespace pem
}  // namespace attnserve

#endif  // ATTNSERVE_COMMON_PEM_H_
