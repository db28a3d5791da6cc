#include "attnserve/server/rpc/call_gate.h"

#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/sha.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <algorithm>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "attnserve/common/pem.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/security/auth_context.h"

namespace attnserve {
namespace {

// Compares without an early exit, so the time taken does not reveal how much of
// a guess matched.
bool ConstantTimeEquals(const std::string& expected, grpc::string_ref actual) {
  unsigned char difference = expected.size() == actual.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    const char got = i < actual.size() ? actual.data()[i] : '\0';
    difference |= static_cast<unsigned char>(expected[i] ^ got);
  }
  return difference == 0;
}

constexpr absl::string_view kScheme = "bearer ";

// The token of a call's one "authorization: Bearer <token>" header (the scheme
// in any case, as RFC 7235 has it), or nothing: no such header, another
// scheme, or more than one authorization header (which a proxy in front might
// read otherwise than the server).
std::optional<grpc::string_ref> BearerToken(
    const grpc::ServerContextBase& context) {
  const auto [first, end] =
      context.client_metadata().equal_range("authorization");
  if (first == end || std::next(first) != end) return std::nullopt;
  const grpc::string_ref value = first->second;
  if (value.size() < kScheme.size() ||
      !absl::EqualsIgnoreCase(absl::string_view(value.data(), kScheme.size()),
                              kScheme)) {
    return std::nullopt;
  }
  return value.substr(kScheme.size());
}

// The first 128 bits of the SHA-256 of `bytes`, in hex, after `prefix`.
std::string HashedName(absl::string_view prefix, absl::string_view bytes) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(),
         digest);
  return absl::StrCat(prefix, absl::BytesToHexString(absl::string_view(
                                  reinterpret_cast<const char*>(digest), 16)));
}

// Appends `length` DER bytes at `der` to `names`, after their length, so that
// no two sequences of parts give the same text.
void AppendPart(const unsigned char* der, int length, std::string* names) {
  if (der == nullptr || length <= 0) {
    absl::StrAppend(names, "-;");
    return;
  }
  absl::StrAppend(names, length, ":",
                  absl::string_view(reinterpret_cast<const char*>(der),
                                    static_cast<size_t>(length)));
}

// A client certificate's identity, hashed from what names its holder and who
// vouches for it: the issuer's name and key (the authority key identifier,
// where the certificate has one), the subject's name, and its subject
// alternative names (where SPIFFE and service meshes name a workload, often
// under an empty subject). So one subject from two trusted CAs, even two of
// the same name, is two identities, and so are two workloads whose names
// differ only in their SANs, while a re-issued certificate (another key,
// another validity, the same names from the same CA) keeps its sessions. A
// certificate the server cannot read (gRPC verified it, so this is not
// expected) is an identity of its own, by its PEM, never the namespace of
// callers without one.
std::string CertificateIdentity(absl::string_view pem) {
  const pem::Certificate leaf = pem::FirstCertificate(pem);
  if (leaf == nullptr) return HashedName("x509-pem:", pem);
  X509* const cert = leaf.get();
  std::string names;
  for (const X509_NAME* name :
       {X509_get_issuer_name(cert), X509_get_subject_name(cert)}) {
    unsigned char* der = nullptr;
    const int length = i2d_X509_NAME(name, &der);
    AppendPart(der, length, &names);
    OPENSSL_free(der);
  }
  const ASN1_OCTET_STRING* issuer_key = X509_get0_authority_key_id(cert);
  AppendPart(
      issuer_key == nullptr ? nullptr : ASN1_STRING_get0_data(issuer_key),
      issuer_key == nullptr ? 0 : ASN1_STRING_length(issuer_key), &names);
  // Each name alone, sorted and once: a certificate re-issued with its
  // names in another order (another CSR template, an issuer that sorts) is
  // the same holder.
  GENERAL_NAMES* sans = static_cast<GENERAL_NAMES*>(
      X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr));
  std::vector<std::string> alternatives;
  for (int i = 0; sans != nullptr && i < sk_GENERAL_NAME_num(sans); ++i) {
    unsigned char* der = nullptr;
    const int length = i2d_GENERAL_NAME(sk_GENERAL_NAME_value(sans, i), &der);
    if (length > 0) {
      alternatives.emplace_back(reinterpret_cast<const char*>(der),
                                static_cast<size_t>(length));
    }
    OPENSSL_free(der);
  }
  GENERAL_NAMES_free(sans);
  ERR_clear_error();
  std::sort(alternatives.begin(), alternatives.end());
  alternatives.erase(std::unique(alternatives.begin(), alternatives.end()),
                     alternatives.end());
  absl::StrAppend(&names, alternatives.size(), ";");
  for (const std::string& name : alternatives) {
    AppendPart(reinterpret_cast<const unsigned char*>(name.data()),
               static_cast<int>(name.size()), &names);
  }
  return HashedName("x509:", names);
}

// Whether `presented` is one of `tokens`; every token compared, so the time
// taken does not say which matched.
bool OneOf(const std::vector<std::string>& tokens, grpc::string_ref presented) {
  bool matched = false;
  for (const std::string& token : tokens) {
    matched = ConstantTimeEquals(token, presented) || matched;
  }
  return matched;
}

}  // namespace

absl::Status CallGate::Admit(const grpc::ServerContextBase& context) const {
  if (closed_.load()) {
    refused_closed_.fetch_add(1);
    return absl::UnavailableError(
        "the server is shutting down; retry on another replica");
  }
  if (bearer_tokens_.empty()) return absl::OkStatus();
  const std::optional<grpc::string_ref> presented = BearerToken(context);
  // Both lists compared whole, so the time taken does not say which holds it.
  const bool caller =
      presented.has_value() && OneOf(bearer_tokens_, *presented);
  const bool admin = presented.has_value() && OneOf(admin_tokens_, *presented);
  if (!caller && !admin) {
    return absl::UnauthenticatedError(
        "authorization is missing or wrong, expected one header "
        "\"authorization: Bearer <token>\" with the server's token");
  }
  return absl::OkStatus();
}

absl::Status CallGate::AdmitWeightChange(
    const grpc::ServerContextBase& context) const {
  if (admin_tokens_.empty()) return absl::OkStatus();
  const std::optional<grpc::string_ref> presented = BearerToken(context);
  if (!presented.has_value()) {
    return absl::UnauthenticatedError(
        "putting or deleting a weight set needs one header \"authorization: "
        "Bearer <token>\" with a token of weights_admin_token_file");
  }
  if (!OneOf(admin_tokens_, *presented)) {
    return absl::PermissionDeniedError(
        "putting or deleting a weight set needs a token of "
        "weights_admin_token_file, and this caller's is not one");
  }
  return absl::OkStatus();
}

std::string CallGate::Identity(const grpc::ServerContextBase& context) const {
  // With bearer tokens, the caller's (Admit checked it); admin tokens alone
  // leave callers to their certificates, so that a certificate holding one
  // keeps its own sessions.
  if (!bearer_tokens_.empty()) {
    const std::optional<grpc::string_ref> token = BearerToken(context);
    if (!token.has_value()) return "";
    return HashedName("token:",
                      absl::string_view(token->data(), token->size()));
  }
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return "";
  const std::vector<grpc::string_ref> pem =
      auth->FindPropertyValues(GRPC_X509_PEM_CERT_PROPERTY_NAME);
  if (pem.empty()) return "";
  // Parsing a certificate takes a few hundred microseconds: each is parsed
  // once while it is among the last kCachedCertificates seen, kept by the
  // hash of its PEM (a certificate may take 90 KB; its hash, 32 bytes).
  const absl::string_view certificate(pem.front().data(), pem.front().size());
  const std::string key = HashedName("", certificate);
  {
    absl::MutexLock lock(&certificates_mutex_);
    const auto found = certificate_identities_.find(key);
    if (found != certificate_identities_.end()) return found->second;
  }
  std::string identity = CertificateIdentity(certificate);
  absl::MutexLock lock(&certificates_mutex_);
  if (certificate_identities_.size() >= kCachedCertificates) {
    certificate_identities_.clear();
  }
  certificate_identities_.emplace(key, identity);
  return identity;
}

std::optional<CallGate::Ticket> CallGate::HoldRefusal(
    std::function<void()> answer) const {
  absl::MutexLock lock(&mutex_);
  if (!holding_) return std::nullopt;
  const Ticket ticket = next_++;
  held_.emplace(ticket, std::move(answer));
  return ticket;
}

bool CallGate::Unhold(Ticket ticket) const {
  absl::MutexLock lock(&mutex_);
  return held_.erase(ticket) == 1;
}

void CallGate::HoldRefusals() {
  absl::MutexLock lock(&mutex_);
  holding_ = true;
}

int CallGate::ReleaseHeld() {
  std::map<Ticket, std::function<void()>> held;
  {
    absl::MutexLock lock(&mutex_);
    holding_ = false;
    held.swap(held_);
  }
  for (auto& [ticket, answer] : held) answer();
  return static_cast<int>(held.size());
}

}  // namespace attnserve
